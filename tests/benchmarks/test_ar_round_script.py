"""``benchmarks/parts/ar_round.py`` and its harness ``benchmarks/parts/alternating.py`` without a compile (the A/B itself runs
for minutes): the options, the switch between AR's two forms, the alternating order and the report."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import alternating
import ar_round as script

from saguaro.core.stages import TARGET_ROUND, TARGET_STEP, TARGET_VERIFY, TARGET_VERIFY_ROUND


def test_options_and_refusals():
    args = alternating.checked(
        alternating.ab_parser("doc"), ["--threads", "1", "--passes", "3", "--json", "o.json"]
    )
    assert (args.threads, args.passes, args.prompts, args.new, args.json) == (1, 3, 4, 128, "o.json")
    with pytest.raises(SystemExit):
        alternating.checked(alternating.ab_parser("doc"), ["--passes", "0"])


def test_the_switch_hides_the_round_and_gives_it_back():
    class Runner:
        def provides(self, stage):
            return True

    program = SimpleNamespace(target=Runner())
    script.use_round(program, False)
    assert not program.target.provides(TARGET_ROUND) and program.target.provides(TARGET_STEP)
    assert not program.target.provides(TARGET_VERIFY_ROUND) and program.target.provides(TARGET_VERIFY.greedy)
    script.use_round(program, True)
    assert program.target.provides(TARGET_ROUND) and program.target.provides(TARGET_VERIFY_ROUND)


def test_passes_alternate_and_the_report_is_written(monkeypatch, tmp_path, capsys):
    import linear_as_reduction

    order = []
    state = {}
    monkeypatch.setattr(
        linear_as_reduction,
        "timed_pass",
        lambda program, prompts, mode, new: (0.0, 10.0 if state["form"] == "a" else 15.0, ["x"]),
    )
    monkeypatch.setattr(linear_as_reduction, "equal_to_expected", lambda outputs, expected: outputs == ["x"])

    def use(form):
        state["form"] = form
        order.append(form)

    args = SimpleNamespace(passes=3, new=4, json=str(tmp_path / "r.json"))
    rates, exact = alternating.alternate(None, ("a", "b"), use, ("ar",), args, [], [])
    assert exact and order == [
        "a",
        "b",
        "a",
        "b",
        "b",
        "a",
        "a",
        "b",
    ]  # warm-ups, then flipped every other pass
    rows = alternating.report(("a", "b"), ("ar",), rates, exact, args)
    assert rows[0]["a"] == 10.0 and rows[0]["b"] == 15.0
    assert "1.500" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["passes"]["b"] == [15.0] * 3
