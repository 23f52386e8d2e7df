"""The passes' own machinery: ``graph_pass`` (a pass's declared facts, the ``PassManager`` that checks them,
a stage graph's lazy copy) and ``graph_splice`` (splicing tensor functions into graphs, ``PassError``).
May import core only; every pass imports it, it imports no pass."""
