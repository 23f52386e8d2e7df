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
    run_rows, tables = demo_main.__globals__["run_rows"], []  # the rows the demo's tables show

    def recorded(*args, **kwargs):
        tables.append(run_rows(*args, **kwargs))
        return tables[-1]

    monkeypatch.setitem(demo_main.__globals__, "run_rows", recorded)
    # the real-size table's pair: a second tiny pair standing in for seeded_pair's 1.1B one
    real = tiny_target("qwen2", logit_scale=4.0)
    shapes = []
    monkeypatch.setitem(
        demo_main.__globals__,
        "seeded_pair",
        lambda shape: shapes.append(shape) or (real, truncated_draft(real), tiny_tokenizer()),
    )
    assert (
        demo_main(
            [
                "--prompt",
                "def f(x):",
                "--max-new-tokens",
                "6",
                "--prompts",
                "2",
                "--k",
                "3",
                "--backend",
                "eager",
                "--repeats",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "def f(x):" in out
    [rows, real_rows] = tables
    assert shapes == ["tinyllama-1.1b"]  # the default shape, built once
    assert [row["mode"] for row in rows] == [row["mode"] for row in real_rows] == ["ar", "sd", "ssd"]
    first, second = out.split("A pair of a size people run: the tinyllama-1.1b shape")
    check_timed_passes(
        rows, 2, first
    )  # every mode warmed up, then ar, sd, ssd, ar, sd, ssd; median and spread
    check_timed_passes(real_rows, 2, second)
    assert "1 prompt x 40 tokens" in second and "eager stages over the packed kernel" in second
    gigabytes = sum(t.numel() * t.element_size() for t in real.parameters()) / 1e9
    assert f"({gigabytes:.1f} GB of weights)" in second
    busy = [
        row["mode"] for row in rows if (row["spread_pct"] or 0) > 25
    ]  # under the table when the machine was busy
    assert ("The machine was busy" in first) == bool(busy) and all(
        mode in first.split("was busy")[-1] for mode in busy
    )
    assert table_column(first, "vs SD", 3)[1] == "1.00x" and table_column(second, "vs SD", 3)[1] == "1.00x"
    assert all(re.fullmatch(r"[0-9.]+x", cell) for cell in table_column(out, "vs SD", 3))  # vs SD filled
    assert "make bench" in out and "saguaro bench --json bench.json" in out


def test_demo_real_size_off_builds_no_second_pair(demo_main, tiny_default_pair, capsys, monkeypatch):
    monkeypatch.setitem(
        demo_main.__globals__, "seeded_pair", lambda shape: pytest.fail("built a real-size pair")
    )
    assert (
        demo_main(
            [
                "--max-new-tokens",
                "4",
                "--prompts",
                "1",
                "--k",
                "2",
                "--backend",
                "eager",
                "--repeats",
                "1",
                "--real-size",
                "off",
            ]
        )
        == 0
    )
    assert "A pair of a size people run" not in capsys.readouterr().out


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


def test_definition_end_is_the_first_line_no_deeper_than_the_def(demo_main):
    definition_end = demo_main.__globals__["definition_end"]
    text = " return len(self.items)\n\n    def push(self, item):\n"
    assert definition_end(text, 4) == len(" return len(self.items)\n\n")
    assert definition_end(" x = 1\n        y = 2\n\n", 4) is None  # deeper lines and blanks go on
    assert definition_end("    x = 1\ny = 2\n", -1) is None  # no definition: no stop
    assert definition_end("    x = 1\ny = 2\n", 0) == len("    x = 1\n")


def test_write_methods_prints_the_target_greedy_text_up_to_the_definition_end(demo_main, capsys):
    target = tiny_target("llama", logit_scale=4.0)
    tokenizer = tiny_tokenizer()
    program = saguaro.compile(target, truncated_draft(target), k=3, backend="eager")
    write_methods, definition_end = (
        demo_main.__globals__["write_methods"],
        demo_main.__globals__["definition_end"],
    )
    prompt = "class A:\n\n"
    text, _, stats = write_methods(program, tokenizer, prompt, ["f(self)", "g(self, x)"], 12, "ssd")
    printed = capsys.readouterr().out
    assert printed == text  # what it printed is the text it kept
    expected = prompt
    for method in [
        "f(self)",
        "g(self, x)",
    ]:  # each completion: the target's own greedy text, cut at the def's end
        expected += f"    def {method}:\n       "
        ids = tokenizer(expected, return_tensors="pt").input_ids
        reference = target.generate(
            ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        decoded = tokenizer.decode(reference[0, ids.shape[1] :], skip_special_tokens=True)
        expected += decoded[: definition_end(decoded, 4)].rstrip() + "\n\n"
    assert text == expected
    assert stats["new_tokens"] == 24 and stats["rounds"] >= 2 and stats["mean_accepted_len"] > 0
