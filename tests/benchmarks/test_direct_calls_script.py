"""``benchmarks/direct_calls.py`` without its compile (the A/B itself runs for minutes): its options, and that a
pass's form reaches every compiled stage of both models and nothing else."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "direct_calls.py"


def load():
    spec = importlib.util.spec_from_file_location("direct_calls_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_and_refusals():
    script = load()
    args = script.parse_args(["--threads", "1", "--passes", "3", "--json", "out.json"])
    assert (args.threads, args.passes, args.json, args.linears) == (1, 3, "out.json", "auto")
    with pytest.raises(SystemExit):
        script.parse_args(["--passes", "0"])


def test_the_form_reaches_every_compiled_stage_of_both_models():
    script = load()
    compiled = [SimpleNamespace(direct_calls=True) for _ in range(3)]
    eager = object()  # an eager stage has no direct calls: left alone
    program = SimpleNamespace(target=SimpleNamespace(built_stages={"prefill": compiled[0], "step": eager}),
                              draft=SimpleNamespace(built_stages={"prefill": compiled[1], "step": compiled[2]}))
    stages = script.compiled_stages(program)
    assert stages == compiled
    script.use_direct_calls(stages, False)
    assert not any(s.direct_calls for s in compiled)
    script.use_direct_calls(stages, True)
    assert all(s.direct_calls for s in compiled)
