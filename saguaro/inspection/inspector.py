"""``saguaro.inspect``: what the compiler built for a Program, and where a round's time goes.

An :class:`Inspector` shows each stage's pass pipeline (node counts, per-pass diffs), its graph as text /
DOT / SVG, each mode's round DAG with measured costs, and (Inductor) each stage's kernels and compile time.
``saguaro inspect`` is its CLI.
"""

from __future__ import annotations

from saguaro.core.config import MODES
from saguaro.core.stages import STAGES, Stage, stage_named, stages_for
from saguaro.inspection.graph_view import graph_dot, graph_text, to_svg
from saguaro.inspection.pass_table import PassStep, format_table, pass_diff, pass_steps
from saguaro.inspection.schedule_view import schedule_dot
from saguaro.runtime.base.trace_read import stage_costs

FORMATS = ("text", "dot", "svg")


def inspect(program=None, target=None, draft=None, **config) -> Inspector:
    """An :class:`Inspector` over ``program``, or over ``saguaro.compile(target, draft, **config)``, or
    (neither given) over the default pair."""
    if program is None:
        from saguaro.compile import compile as saguaro_compile

        if target is None:
            from saguaro.default_pair import load_default_pair

            target, draft, _ = load_default_pair()
        program = saguaro_compile(target, draft, **({"mode": "ssd" if draft is not None else "ar"} | config))
    return Inspector(program)


def resolve_stage(name: str | Stage) -> Stage:
    """A stage by qualified name (``target.verify_greedy``) or by its name within a model
    (``verify_greedy``) when only one model has it."""
    if isinstance(name, Stage):
        return name
    if "." in name:
        return stage_named(name)
    matches = [s for s in STAGES if s.name == name]
    if len(matches) == 1:
        return matches[0]
    allowed = ", ".join(s.qualified for s in STAGES)
    if matches:
        raise ValueError(
            f"stage {name!r} is ambiguous ({', '.join(s.qualified for s in matches)}): "
            f"name it with its model, one of {allowed}"
        )
    raise ValueError(f"stage {name!r} does not exist: choose one of {allowed}")


class Inspector:
    """Views of one Program. Stage graphs come from each runner's stage builder: a compiled program's rebuilds
    them through the pass pipeline, watching every pass; a loaded program's reads them from its artifact,
    after every pass (its per-pass views raise ``ValueError``)."""

    def __init__(self, program):
        self.program = program
        self._steps: dict = {}
        self._graphs: dict = {}
        self.costs: dict = {}  # seconds per stage call measured by traced runs (every process)

    def stages(self) -> list[Stage]:
        """Every stage of the program's models (the draft's only with a draft)."""
        return [s for s in STAGES if s.model == "target" or self.program.draft is not None]

    def _runner(self, stage: Stage):
        runner = self.program.runner(stage.model)
        if runner is None:
            raise ValueError(f"stage {stage.qualified} needs a draft model; this program has none")
        return runner

    def pass_steps(self, stage) -> list[PassStep]:
        """The stage pipeline of ``stage`` observed: ``captured`` then one step per pass."""
        stage = resolve_stage(stage)
        if stage not in self._steps:
            self._steps[stage] = pass_steps(self._runner(stage).build, stage)
            self._graphs[stage] = self._steps[stage][1]
        return self._steps[stage][0]

    def passes(self, stage=None) -> str:
        """The table of pass, node count and change, for ``stage`` or every stage."""
        stages = [resolve_stage(stage)] if stage is not None else self.stages()
        return format_table([step for s in stages for step in self.pass_steps(s)])

    def pass_diff(self, stage, pass_name: str) -> str:
        """Unified diff of ``stage``'s graph code before and after ``pass_name``."""
        return pass_diff(self.pass_steps(stage), pass_name)

    def stage_graph(self, stage):
        """The stage's GraphModule after every pass."""
        stage = resolve_stage(stage)
        if stage not in self._graphs:
            self._graphs[stage] = self._runner(stage).build.stage_graph(stage)
        return self._graphs[stage]

    def graph(self, stage, format: str = "text", expand: bool = False) -> str:
        """``stage``'s graph as ``text``, ``dot`` or ``svg`` (Graphviz ``dot`` needed); one box per
        decoder layer unless ``expand``."""
        _check_format(format)
        stage = resolve_stage(stage)
        gm = self.stage_graph(stage)
        if format == "text":
            return graph_text(gm, expand=expand)
        dot = graph_dot(gm, stage.qualified, expand=expand)
        return dot.to_string() if format == "dot" else to_svg(dot)

    def measure(self, mode: str, new_tokens: int = 24, input_ids=None) -> dict:
        """Run a short traced greedy generation in ``mode``, whose stage costs (a draft process's included)
        cost the schedule from then on; its stats."""
        import torch

        program = self.program
        if input_ids is None:
            input_ids = (
                torch.arange(3, 11, device=program.target.spec.device)[None, :]
                % program.target.spec.vocab_size
            )
        out = program.generate(input_ids, max_new_tokens=new_tokens, mode=mode, eos_token_id=None, trace=True)
        self.observe(out.trace)
        return out.stats

    def observe(self, trace: dict) -> None:
        """Take the stage costs measured in ``trace`` (``generate(trace=...)``) for the schedule."""
        self.costs.update(stage_costs(trace))

    def schedule(
        self, mode: str | None = None, format: str = "dot", sampled: bool = False, measure: bool = False
    ) -> str:
        """The round DAG of ``mode`` (default: the program's) as ``dot`` / ``svg`` / ``text``, costed with
        the measured stage times (``DEFAULT_COST_S`` before any run; ``measure``: run one first)."""
        _check_format(format)
        mode = mode or self.program.config.mode
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not allowed: choose one of {', '.join(MODES)}")
        if measure:
            self.measure(mode)
        g = self.schedule_graph(mode, sampled)
        if format == "text":
            return "\n".join(f"{n}\t{d['lane']}\t{1000 * d['cost']:.3f} ms" for n, d in g.nodes(data=True))
        dot = schedule_dot(g)
        return dot.to_string() if format == "dot" else to_svg(dot)

    def schedule_graph(self, mode: str, sampled: bool = False):
        """The program's round DAG of ``mode`` with the costs traced runs measured (any process), the
        program's own measurements elsewhere."""
        g = self.program.round_schedule(mode, sampled=sampled)
        for node, data in g.nodes(data=True):
            stage = data.get("stage")
            key = stage.qualified if stage is not None else node
            if key in self.costs:
                data["cost"] = self.costs[key]
        return g

    def kernels(self, mode: str | None = None, warm: bool = True) -> list[dict]:
        """Per stage of ``mode`` (Inductor): compile time and the generated code files with their kernel
        names; ``warm``: a short generation first, so every stage has compiled. ``ValueError`` otherwise."""
        program = self.program
        if program.config.backend != "inductor":
            raise ValueError(
                f"kernels need backend='inductor'; this program uses backend={program.config.backend!r}"
            )
        mode = mode or program.config.mode
        if warm:
            self.measure(mode, new_tokens=2 * program.config.k + 2)
        rows = []
        for stage in stages_for(mode, 0.0):
            runner = program.runner(stage.model)
            fn = runner.built_stages.get(stage)
            files = list(getattr(fn, "output_code", []) or [])
            rows.append(
                {
                    "stage": stage.qualified,
                    "build_s": runner.stage_build_s.get(stage.qualified),
                    "compile_s": getattr(fn, "compile_s", None),
                    "kernel_count": sum(len(f["kernels"]) for f in files),
                    "kernels": sorted({k for f in files for k in f["kernels"]}),
                    "files": [f["file"] for f in files],
                }
            )
        return rows

    def weights(self, modes: tuple = (), new_tokens: int = 4) -> dict:
        """The weights the program holds (:func:`~saguaro.inspection.weights.program_weights`); ``modes``: a
        short generation in each first, building their stages."""
        from saguaro.inspection.weights import program_weights

        for mode in modes:
            self.measure(mode, new_tokens=new_tokens)
        return program_weights(self.program)


def format_kernels(rows: list[dict]) -> str:
    lines = [f"{'stage':<28}{'compile s':>10}{'kernels':>9}  files / kernel names"]
    for r in rows:
        compile_s = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        lines.append(
            f"{r['stage']:<28}{compile_s:>10}{r['kernel_count']:>9}  {', '.join(map(str, r['files']))}"
        )
        if r["kernels"]:
            lines.append(f"{'':<43}{', '.join(r['kernels'])}")
    return "\n".join(lines)


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not allowed: choose one of {', '.join(FORMATS)}")
