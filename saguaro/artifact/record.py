"""Record the inputs the runtime passes each stage: export traces each stage with inputs of the dtypes
and static sizes the runtime really uses. A short generation per mode over stage graphs built for
export (eager, attention inline) calls every stage once; the first call's inputs are kept."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import torch

from saguaro.core.stages import Stage, stages_for
from saguaro.passes.pipeline import PipelineStages
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.program import Program

log = logging.getLogger(__name__)


class Recorder(PipelineStages):
    """The :class:`~saguaro.runtime.base.model_runner.StageBuilder` of a recording runner: the stage
    graph for export (the stage pass pipeline, not lowered), which records the first call's inputs."""

    def __init__(self, base: torch.fx.GraphModule, width: int, attention: str):
        super().__init__(base, width, attention)
        self.graphs: dict[Stage, torch.fx.GraphModule] = {}
        self.inputs: dict[Stage, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def __call__(self, stage: Stage):
        gm = self.stage_graph(stage)
        self.graphs[stage] = gm

        def run(*args):
            with self._lock:
                if stage not in self.inputs:
                    self.inputs[stage] = [a.detach().clone() for a in args]
            return gm(*args)

        return run


def record_stages(program: Program, modes: tuple, temperatures: tuple, attention: str) -> dict[str, Recorder]:
    """Run ``program``'s modes at ``temperatures`` over recording runners; ``{model: Recorder}``."""
    recorders, runners = {}, {}
    needed = {s.model for m in modes for t in temperatures for s in stages_for(m, t)}
    for name in ("target", "draft"):
        runner = program.runner(name)
        if runner is None or name not in needed:  # AR only: the draft is neither run nor exported
            continue
        recorders[name] = Recorder(runner.captured.graph_module, runner.width, attention)
        runners[name] = ModelRunner(name, runner.captured, recorders[name], runner.width)
    config = replace(program.config, lane="thread")  # in this process, where the recorders are
    recording = Program(
        config,
        runners["target"],
        runners.get("draft"),
        program.pad_token_id,
        program.eos_token_id,
        program.shapes,
    )
    spec = program.target.spec
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (2, 5), generator=gen).to(spec.device)  # [B, T]
    try:
        for mode in modes:
            for temperature in temperatures:
                wanted = set(stages_for(mode, temperature))
                if wanted <= {s for r in recorders.values() for s in r.inputs}:
                    continue
                recording.generate(
                    ids,
                    max_new_tokens=3 * (program.config.k + 1),
                    temperature=temperature,
                    seed=0,
                    mode=mode,
                    eos_token_id=None,
                )
                missing = wanted - {s for r in recorders.values() for s in r.inputs}
                if missing:
                    raise RuntimeError(
                        f"a {mode} generation at temperature {temperature} did not call "
                        f"{sorted(s.qualified for s in missing)}"
                    )
    finally:
        recording.close()
    return recorders
