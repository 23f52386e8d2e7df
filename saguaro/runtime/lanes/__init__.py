"""Lanes: where the draft server runs (a thread, another process or host) behind the ``DraftLane`` protocol
and the typed ``DraftClient``; their owner, the CUDA stream hand-off, the draft process's entry point
and the draft as files. May import runtime.draft, runtime.base and core. Only this folder spells a
server method's name."""
