"""A stage lowered while another thread compiles (``saguaro/lower/forward_code.py``): while dynamo
compiles, it swaps FX's code generator process-wide for one that marks each new forward as never to be
compiled, so a stage graph built on one thread during the compile thread's compile ran eager under
``torch.compile`` for good. Lowering now regenerates the forward once no compile runs."""

import threading

import torch
import torch.fx.graph_module as fx_graph_module
from torch._dynamo import convert_frame
from torch._dynamo.utils import counters

from saguaro.lower.lowering import lower_graph


def stage_fn(x):
    return torch.sin(x) * 2 + 1


class DynamoCompileElsewhere:
    """What a dynamo compile on another thread does to FX while it runs, held open until ``end()``."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._compile)

    def _compile(self):
        with convert_frame.compile_lock:
            prior = fx_graph_module._forward_from_src
            fx_graph_module._forward_from_src = convert_frame.fx_forward_from_src_skip_result
            self.started.set()
            self.release.wait(60)
            fx_graph_module._forward_from_src = prior

    def __enter__(self):
        self.thread.start()
        assert self.started.wait(60)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(60)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_a_stage_lowered_while_another_thread_compiles_is_compiled():
    with DynamoCompileElsewhere() as elsewhere:
        gm = torch.fx.symbolic_trace(stage_fn)  # its forward is marked never to be compiled
        threading.Timer(0.3, elsewhere.release.set).start()
        stage = lower_graph(gm, "inductor", "test.stage")  # waits for that compile, then a new forward
    before = graphs()
    with torch.inference_mode():
        out = stage(torch.ones(4))
    assert graphs() == before + 1, "the stage was not compiled"  # without the fix: never compiled
    assert torch.equal(out, stage_fn(torch.ones(4)))
