"""Lanes: where the draft server runs (thread, process, another host, a tensor-parallel rank) behind
``DraftLane`` and the typed ``DraftClient``; their owner and stream hand-off. May import runtime.draft,
runtime.base and core. Only this folder spells a server method's name."""
