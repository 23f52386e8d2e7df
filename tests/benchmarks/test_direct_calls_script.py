"""``benchmarks/parts/direct_calls.py`` without its compile (the A/B itself runs for minutes): its options, and that a
pass's form reaches every compiled stage of both models and nothing else."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import direct_calls as script


def test_options_and_refusals():
    args = script.parse_args(["--threads", "1", "--passes", "3", "--json", "out.json"])
    assert (args.threads, args.passes, args.json, args.linears) == (1, 3, "out.json", "auto")
    with pytest.raises(SystemExit):
        script.parse_args(["--passes", "0"])


def test_the_form_reaches_every_compiled_stage_of_both_models():
    compiled = [SimpleNamespace(direct_calls=True) for _ in range(3)]
    eager = object()  # an eager stage has no direct calls: left alone
    program = SimpleNamespace(
        target=SimpleNamespace(built_stages={"prefill": compiled[0], "step": eager}),
        draft=SimpleNamespace(built_stages={"prefill": compiled[1], "step": compiled[2]}),
    )
    stages = script.compiled_stages(program)
    assert stages == compiled
    script.use_direct_calls(stages, False)
    assert not any(s.direct_calls for s in compiled)
    script.use_direct_calls(stages, True)
    assert all(s.direct_calls for s in compiled)
