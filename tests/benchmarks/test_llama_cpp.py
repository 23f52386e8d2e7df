"""``benchmarks/compare/llama_cpp.py``: skipped with its reason without a llama.cpp build; with one (here a fake
build whose two programs print llama.cpp's own report lines, tokens/s set by the test) its llama.cpp rows
are those lines' speeds, medians over alternating passes; Saguaro's rows (``saguaro bench``'s worker
processes, faked here) alternate with them and count the tokens after the prefill, as llama.cpp does."""

import importlib
import json
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "compare"))
import llama_cpp

COMPLETION_OUT = (
    "llama_perf_context_print: prompt eval time =      12.00 ms /    20 tokens (0.60 ms per token)\n"
    "llama_perf_context_print:        eval time =    {ms} ms /   {n} runs   (    2.00 ms per token,   500.00 tokens"
    " per second)\n"
)
SPECULATIVE_OUT = (
    "encoded   20 tokens in    0.010 seconds\ndecoded  {n} tokens in    {s} seconds, speed:  1.0 t/s\n"
)


def _program(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_without_a_build_it_says_why_and_writes_the_reason(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert llama_cpp.main(["--json", str(out)]) == 0
    assert "skipped: no llama.cpp build given" in capsys.readouterr().out
    assert "no llama.cpp build given" in json.loads(out.read_text())["skipped"]
    assert llama_cpp.main(["--llama-cpp", str(tmp_path), "--json", str(out)]) == 0
    assert (
        json.loads(out.read_text())["skipped"]
        == f"llama-completion not found in {tmp_path} or {tmp_path}/bin"
    )


def test_the_report_lines_are_read_and_a_missing_one_is_named():
    assert llama_cpp.eval_speed(COMPLETION_OUT.format(ms="254.00", n=127)) == (127, 0.254)  # not the prompt's
    assert llama_cpp.decoded_speed(SPECULATIVE_OUT.format(n=128, s="0.200")) == (128, 0.2)
    with pytest.raises(ValueError, match="no 'eval time' line"):
        llama_cpp.eval_speed("llama_perf_context_print: prompt eval time = 1.0 ms / 3 tokens")


def test_rows_from_a_fake_build_are_medians_of_alternating_passes(tmp_path, monkeypatch):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "calls"
    # each call appends its name; llama-completion's speed rises per call: 100, 200, 300 tokens/s
    _program(
        bin_dir / "llama-completion",
        f'echo c >> {calls}; n=$(grep -c "^c" {calls}); '
        f'printf "{COMPLETION_OUT.format(ms="1000.00", n="$((n * 100))")}" >&2\n',
    )
    # llama-speculative's --help names the drafting flag of builds since --draft-max was removed
    _program(
        bin_dir / "llama-speculative",
        'if [ "$1" = --help ]; then echo "--spec-draft-n-max N"; exit 0; fi\n'
        f'echo "s $*" >> {calls}; printf "{SPECULATIVE_OUT.format(n=50, s="0.100")}"\n',
    )
    prompts = [str(tmp_path / "p0.txt")]
    monkeypatch.setattr(llama_cpp, "write_prompts", lambda count, new, workdir, target, draft: prompts)
    out = tmp_path / "r.json"
    assert (
        llama_cpp.main(
            [
                "--llama-cpp",
                str(tmp_path / "build"),
                "--target-gguf",
                "t.gguf",
                "--draft-gguf",
                "d.gguf",
                "--threads",
                "1,2",
                "--repeats",
                "3",
                "--saguaro-modes",
                "",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r["threads"]) for r in rows] == [
        ("llama.cpp ar", 1),
        ("llama.cpp sd", 1),
        ("llama.cpp ar", 2),
        ("llama.cpp sd", 2),
    ]
    assert rows[0]["passes"] == [100.0, 200.0, 300.0] and rows[0]["tokens_per_s"] == 200.0
    assert rows[2]["passes"] == [400.0, 500.0, 600.0]
    assert rows[1]["tokens_per_s"] == 500.0 and rows[1]["spread_pct"] == 0.0
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["c", "s"] * 6  # the two rows' passes alternate
    assert all(
        "--spec-draft-n-max 5 " in line and "--draft-max" not in line for line in lines if line[0] == "s"
    )


def test_an_older_build_drafts_with_draft_max(tmp_path):
    old = tmp_path / "llama-speculative"
    _program(old, 'echo "--draft-max N    number of tokens to draft"\n')
    assert llama_cpp.draft_max_flag(str(old)) == "--draft-max"


class FakeRow:
    """A Saguaro row as ``start_row`` gives one: its passes' rates set by the test, its calls recorded."""

    def __init__(self, label, calls, rates):
        self.label, self.calls, self.rates = label, calls, iter(rates)
        self.closed = False

    def time_pass(self):
        self.calls.append(self.label)
        decode = next(self.rates)
        return {"tokens_per_s": decode - 10.0, "decode_tokens_per_s": decode, "started": 0.0, "ended": 1.0}

    def close(self):
        self.closed = True


def test_saguaro_rows_alternate_with_llama_cpp_s_and_read_the_rate_after_the_prefill(tmp_path, monkeypatch):
    calls, started = [], {}

    def start_rows(args, threads):
        assert (args.k, args.prompts, args.max_new_tokens, threads) == (5, 4, 128, 2)
        started.update(
            {
                f"saguaro {m}": FakeRow(m, calls, rates)
                for m, rates in (("ar", [300.0, 320.0, 310.0]), ("sd", [400.0, 450.0, 500.0]))
            }
        )
        return dict(started)

    monkeypatch.setattr(llama_cpp, "start_saguaro_rows", start_rows)
    monkeypatch.setattr(
        llama_cpp, "llama_cpp_pass", lambda binary, run_args, prompts, parse: calls.append(binary) or 100.0
    )
    monkeypatch.setattr(llama_cpp, "draft_max_flag", lambda speculative: "--spec-draft-n-max")
    args = llama_cpp.parse_args(
        [
            "--k",
            "5",
            "--prompts",
            "4",
            "--max-new-tokens",
            "128",
            "--repeats",
            "3",
            "--target-gguf",
            "t.gguf",
            "--draft-gguf",
            "d.gguf",
        ]
    )
    binaries = {llama_cpp.COMPLETION: "completion", llama_cpp.SPECULATIVE: "speculative"}
    rows = llama_cpp.interleaved_rows(binaries, args, 2, ["p0.txt"])
    assert calls == ["completion", "speculative", "ar", "sd"] * 3  # every row's passes alternate
    assert [r["row"] for r in rows] == ["llama.cpp ar", "llama.cpp sd", "saguaro ar", "saguaro sd"]
    assert rows[2]["passes"] == [300.0, 320.0, 310.0] and rows[2]["tokens_per_s"] == 310.0
    assert rows[3]["tokens_per_s"] == 450.0 and rows[3]["with_prefill_tokens_per_s"] == 440.0
    assert "with_prefill_tokens_per_s" not in rows[0] and all(row.closed for row in started.values())
    assert llama_cpp.format_rows(rows[3:]).splitlines()[1].split() == [
        "saguaro",
        "sd",
        "2",
        "450.0",
        "22.2%",
        "440.0",
    ]


def test_saguaro_rows_compile_with_the_linears_asked_for(monkeypatch):
    started = []
    monkeypatch.setattr(
        importlib.import_module("saguaro.bench.run"),
        "start_row",
        lambda params, mode, backend: started.append((params.linears, mode, backend)) or mode,
    )
    for given, expected in (([], "auto"), (["--linears", "template"], "template")):
        started.clear()
        args = llama_cpp.parse_args(["--saguaro-modes", "ar,sd", *given])
        assert llama_cpp.start_saguaro_rows(args, 1) == {"saguaro ar": "ar", "saguaro sd": "sd"}
        assert started == [(expected, "ar", "inductor"), (expected, "sd", "inductor")]


def test_saguaro_rows_hold_narrow_weights_as_asked_and_both_ways_side_by_side(monkeypatch):
    started = []
    monkeypatch.setattr(
        importlib.import_module("saguaro.bench.run"),
        "start_row",
        lambda params, mode, backend: started.append((params.narrow_weights, mode)) or mode,
    )
    for given, expected in (
        ([], {"saguaro ar": (True, "ar")}),
        (["--narrow-weights", "off"], {"saguaro ar": (False, "ar")}),
        (["--narrow-weights", "both"], {"saguaro ar": (True, "ar"), "saguaro ar f32 weights": (False, "ar")}),
    ):
        started.clear()
        args = llama_cpp.parse_args(["--saguaro-modes", "ar", *given])
        rows = llama_cpp.start_saguaro_rows(args, 2)
        assert list(rows) == list(expected) and started == list(expected.values()), given
    with pytest.raises(SystemExit):
        llama_cpp.parse_args(["--narrow-weights", "maybe"])


def test_saguaro_rows_load_the_pair_in_the_dtype_asked_for(monkeypatch):
    started = []
    monkeypatch.setattr(
        importlib.import_module("saguaro.bench.run"),
        "start_row",
        lambda params, mode, backend: started.append((params.dtype, mode)) or mode,
    )
    for given, expected in (([], "float32"), (["--dtype", "bfloat16"], "bfloat16")):
        started.clear()
        args = llama_cpp.parse_args(["--saguaro-modes", "ar,sd", *given])
        assert llama_cpp.start_saguaro_rows(args, 2) == {"saguaro ar": "ar", "saguaro sd": "sd"}
        assert started == [(expected, "ar"), (expected, "sd")]
    with pytest.raises(SystemExit):
        llama_cpp.parse_args(["--dtype", "int8"])


def test_saguaro_rows_take_the_pairs_folders_and_quantized_weights(monkeypatch):
    started = []
    monkeypatch.setattr(
        importlib.import_module("saguaro.bench.run"),
        "start_row",
        lambda params, mode, backend: started.append((params.target, params.draft, params.weights)) or mode,
    )
    args = llama_cpp.parse_args(
        ["--saguaro-modes", "ar", "--target", "pairs/t", "--draft", "pairs/d", "--weights", "int8"]
    )
    assert llama_cpp.start_saguaro_rows(args, 2) == {"saguaro ar": "ar"}
    assert started == [("pairs/t", "pairs/d", "int8")]
    assert llama_cpp.parse_args([]).weights == "as-loaded"
    with pytest.raises(SystemExit):
        llama_cpp.parse_args(["--weights", "int3"])
