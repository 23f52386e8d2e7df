"""`examples/demo.py` (`make demo`) and `examples/quickstart.py`, a tiny pair standing in for the default one."""

import re
import runpy
from pathlib import Path

import pytest

import saguaro
from saguaro.core.errors import SaguaroError
from tests.bench.timed_passes import check_timed_passes, table_column
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
def test_demo_prints_completion_table_and_bench_hint(demo_main, tiny_default_pair, capsys, monkeypatch):
    run_rows, tables = demo_main.__globals__["run_rows"], []  # the rows the demo's table shows

    def recorded(*args, **kwargs):
        tables.append(run_rows(*args, **kwargs))
        return tables[-1]

    monkeypatch.setitem(demo_main.__globals__, "run_rows", recorded)
    assert demo_main(["--prompt", "def f(x):", "--max-new-tokens", "6", "--prompts", "2", "--k", "3",
                      "--backend", "eager", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "def f(x):" in out
    [rows] = tables
    assert [row["mode"] for row in rows] == ["ar", "sd", "ssd"]
    check_timed_passes(rows, 2, out)  # every mode warmed up, then ar, sd, ssd, ar, sd, ssd; median and spread
    busy = [row["mode"] for row in rows if (row["spread_pct"] or 0) > 25]  # under the table when the machine was busy
    assert ("The machine was busy" in out) == bool(busy) and all(mode in out.split("was busy")[-1] for mode in busy)
    assert table_column(out, "vs SD", 3)[1] == "1.00x"
    assert all(re.fullmatch(r"[0-9.]+x", cell) for cell in table_column(out, "vs SD", 3))  # vs SD filled
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
