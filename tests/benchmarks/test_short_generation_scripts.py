"""``benchmarks/parts/prefill_linears.py`` and ``draft_feed.py`` without their compiles (each A/B runs for minutes):
their options, the switches between the two forms, and the harness's whole-generation rates."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import alternating
import draft_feed
import prefill_linears

from saguaro.core.stages import DRAFT_CHAIN, DRAFT_PREFILL, TARGET_PREFILL


@pytest.mark.parametrize(
    "script, command",
    [(prefill_linears, "prefill_linears.py --modes ar,sd"), (draft_feed, "draft_feed.py --new 64")],
)
def test_help_names_the_command_and_rates_count_the_prefill_unless_asked(script, command, capsys):
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0 and f"python benchmarks/parts/{command}" in capsys.readouterr().out


def test_the_harness_counts_the_prefill_on_request_and_runs_the_program_a_form_gives(monkeypatch):
    import linear_as_reduction

    seen = []
    monkeypatch.setattr(
        linear_as_reduction,
        "timed_pass",
        lambda program, prompts, mode, new: (seen.append(program) or 8.0, 10.0, ["x"]),
    )
    monkeypatch.setattr(linear_as_reduction, "equal_to_expected", lambda outputs, expected: True)
    for with_prefill, rate in ((True, 8.0), (False, 10.0)):
        seen.clear()
        args = SimpleNamespace(passes=2, new=4, json=None, with_prefill=with_prefill)
        rates, exact = alternating.alternate(
            "main", ("a", "b"), lambda form: "other" if form == "b" else None, ("ar",), args, [], []
        )
        assert exact and rates[("a", "ar")] == [rate] * 2 and rates[("b", "ar")] == [rate] * 2
        assert seen == [
            "main",
            "other",
            "main",
            "other",
            "other",
            "main",
        ]  # a form's program, or the one given


class Runner:  # a ModelRunner's part the script uses: its builder, its built stages
    def __init__(self, linears):
        self.built, self._stages = [], {}

        def build(stage, linears=None):
            self.built.append((stage, linears))
            return f"{stage.qualified} {linears}"

        build.linears_of = lambda stage: linears
        self.build = build

    def stage(self, stage):
        return self._stages.setdefault(stage, f"{stage.qualified} as built")


def test_prefill_forms_build_both_and_the_switch_swaps_the_runners_stages():
    program = SimpleNamespace(target=Runner("packed"), draft=Runner("packed"))
    forms = prefill_linears.prefill_forms(program)
    assert forms["packed"][program.target] == {TARGET_PREFILL: "target.prefill as built"}
    assert forms["gemm"][program.draft] == {DRAFT_PREFILL: "draft.prefill gemm"}
    assert program.target.built == [(TARGET_PREFILL, "gemm")]
    prefill_linears.use_prefill(forms, "gemm")
    assert program.target._stages[TARGET_PREFILL] == "target.prefill gemm"
    assert program.draft._stages[DRAFT_PREFILL] == "draft.prefill gemm"
    prefill_linears.use_prefill(forms, "packed")
    assert program.target._stages[TARGET_PREFILL] == "target.prefill as built"
    with pytest.raises(SystemExit, match="not on the packed kernel here"):
        prefill_linears.prefill_forms(SimpleNamespace(target=Runner("gemm"), draft=None))


def test_the_feed_switch_sets_draft_decode_s_rule_and_gives_it_back():
    from saguaro.runtime.draft import decode

    packed = SimpleNamespace(build=SimpleNamespace(linears_of=lambda stage: "packed"))
    rule = decode.feeds_together
    try:
        draft_feed.use_feed("apart")
        assert not decode.feeds_together(packed, DRAFT_CHAIN)
        draft_feed.use_feed("together")
        assert decode.feeds_together is rule and decode.feeds_together(packed, DRAFT_CHAIN)
    finally:
        decode.feeds_together = rule
