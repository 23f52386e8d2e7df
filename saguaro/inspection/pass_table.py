"""The stage pass pipeline observed: node counts after each pass and the code before and after it."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from saguaro.core.stages import Stage
from saguaro.runtime.base.model_runner import StageBuilder


@dataclass(frozen=True)
class PassStep:
    """One point of a stage's pipeline: ``"captured"`` (the base graph) or a pass, after it ran."""

    stage: str
    name: str
    nodes: int  # nodes of the graph after this pass
    delta: int  # nodes added (negative: removed) by this pass
    code: str  # the graph's Python code after this pass


def pass_steps(builder: StageBuilder, stage: Stage) -> tuple[list, object]:
    """Build ``stage`` with ``builder`` watching every pass (the pipeline's own ``observe`` hook);
    returns ``(steps, the stage graph)``."""
    steps: list[PassStep] = []

    def observe(name: str, gm: torch.fx.GraphModule) -> None:
        gm.recompile()
        nodes = len(gm.graph.nodes)
        delta = nodes - steps[-1].nodes if steps else 0
        steps.append(PassStep(stage.qualified, name, nodes, delta, gm.code))

    graph = builder.stage_graph(stage, observe=observe)
    return steps, graph


def pass_diff(steps: list[PassStep], pass_name: str) -> str:
    """Unified diff of the graph code before and after ``pass_name``."""
    names = [s.name for s in steps]
    if pass_name not in names[1:]:
        raise ValueError(
            f"pass {pass_name!r} is not in the pipeline of {steps[0].stage}: "
            f"choose one of {', '.join(names[1:])}"
        )
    i = names.index(pass_name)
    before, after = steps[i - 1], steps[i]
    return "".join(
        difflib.unified_diff(
            before.code.splitlines(keepends=True),
            after.code.splitlines(keepends=True),
            fromfile=f"{before.stage} after {before.name}",
            tofile=f"{after.stage} after {after.name}",
        )
    )


def format_table(steps: list[PassStep]) -> str:
    """``stage  pass  nodes  change`` rows."""
    rows = [f"{'stage':<28}{'pass':<24}{'nodes':>7}{'change':>8}"]
    for s in steps:
        change = "" if s.name == "captured" else f"{s.delta:+d}"
        rows.append(f"{s.stage:<28}{s.name:<24}{s.nodes:>7}{change:>8}")
    return "\n".join(rows)
