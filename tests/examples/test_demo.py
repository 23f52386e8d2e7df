"""`examples/demo.py` (`make demo`) and `examples/quickstart.py`, a tiny pair standing in for the default one."""

import re
import runpy
from pathlib import Path

import pytest

import saguaro
from saguaro.core.errors import SaguaroError
from tests.models import tiny_target, truncated_draft
from tests.tiny_tokenizer import tiny_tokenizer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def demo_main():
    return runpy.run_path(str(EXAMPLES / "demo.py"))["main"]


@pytest.fixture
def tiny_default_pair(monkeypatch):
    target = tiny_target("llama", logit_scale=4.0)
    pair = (target, truncated_draft(target), tiny_tokenizer())
    monkeypatch.setattr(saguaro, "default_pair", lambda dtype=None: pair)
    return pair


@pytest.mark.heavy
def test_demo_prints_completion_table_and_bench_hint(demo_main, tiny_default_pair, capsys):
    assert demo_main(["--prompt", "def f(x):", "--max-new-tokens", "6", "--prompts", "2", "--k", "3",
                      "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert "def f(x):" in out
    table = out[out.index("mode "):].splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["ar", "sd"]
    assert table[3].split()[4] == "1.00x" and re.match(r"[0-9.]+x$", table[4].split()[-5])  # vs SD filled
    assert "make bench" in out and "saguaro bench --json bench.json" in out


def test_demo_without_default_pair_names_the_training_command(demo_main, monkeypatch, capsys):
    def absent(dtype=None):
        raise SaguaroError("the default model pair is not built")

    monkeypatch.setattr(saguaro, "default_pair", absent)
    assert demo_main([]) == 1
    err = capsys.readouterr().err
    assert "python examples/train_default_pair.py" in err


def test_quickstart_runs(tiny_default_pair, capsys):
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("def fibonacci(n):") and "mean accepted length" in out[-1]
