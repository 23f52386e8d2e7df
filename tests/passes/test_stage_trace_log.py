"""Each stage graph after the passes goes to ``torch._logging``'s structured trace (TORCH_TRACE, read
by tlparse) as an artifact named after the stage."""

import logging

import torch
from torch._logging._internal import LazyTraceHandler, trace_log

from saguaro.core.stages import TARGET_VERIFY
from saguaro.passes.pipeline import build_stage
from tests.conftest import tiny_pair


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_stage_graph_is_a_structured_trace_artifact():
    _, _, program = tiny_pair("llama")
    builder = program.target.build
    handler = Records()
    trace_log.addHandler(handler)  # what TORCH_TRACE=dir installs
    try:
        gm = build_stage(
            builder.graph_module, TARGET_VERIFY.greedy, builder.width, attention=builder.attention
        )
    finally:
        trace_log.removeHandler(handler)
    artifacts = [
        r for r in handler.records if r.metadata.get("artifact", {}).get("name", "").startswith("saguaro_")
    ]
    assert [r.metadata["artifact"]["name"] for r in artifacts] == ["saguaro_stage_target.verify_greedy"]
    payload = artifacts[0].payload
    assert "draft_tokens" in payload and payload.count("\n") >= len(gm.graph.nodes) - 5


def test_without_a_trace_folder_the_stage_text_is_not_made(monkeypatch):
    """torch's own handler, installed in every process, has no folder unless TORCH_TRACE gives it one: the
    verbose text of a stage graph (costly: its first call imports ``torch.distributed.tensor``) is not made."""
    _, _, program = tiny_pair("llama")
    builder = program.target.build
    folderless = LazyTraceHandler(None)  # what torch installs in a process without TORCH_TRACE
    monkeypatch.setattr(trace_log, "handlers", [folderless])
    made = []
    real = torch.fx.GraphModule.print_readable
    monkeypatch.setattr(
        torch.fx.GraphModule, "print_readable", lambda self, *a, **k: made.append(1) or real(self, *a, **k)
    )
    build_stage(builder.graph_module, TARGET_VERIFY.greedy, builder.width, attention=builder.attention)
    assert made == []
    trace_log.addHandler(Records())
    build_stage(builder.graph_module, TARGET_VERIFY.greedy, builder.width, attention=builder.attention)
    assert made == [1]  # the same build with a handler of one's own makes it
