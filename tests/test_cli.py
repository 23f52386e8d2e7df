"""``saguaro generate`` and ``saguaro bench`` through ``saguaro.cli.main.main``, and the console script once.

A tiny target/draft pair and a character tokenizer are saved to a temporary folder. Tests check
structure and losslessness, never wall-clock time.
"""

import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saguaro.bench.report import row_label
from saguaro.cli.main import main
from saguaro.core.errors import SaguaroError
from saguaro.runtime.base.trace_read import check_trace, slices
from tests.bench.timed_passes import check_timed_passes, table_column
from tests.models import EOS, reference_greedy, tiny_target, truncated_draft
from tests.tiny_tokenizer import tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def f(x):"
STATS_LINE = re.compile(
    r"^\[(ar|sd|ssd)(?:, ran as SD: no tree pays here)?\] (\d+) tokens in [\d.]+s: [\d.]+ "
    r"tokens/s, mean accepted length [\d.]+, \d+ rounds(, cache hit rate [\d.]+)?$"
)


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """``(target_dir, draft_dir)``: a tiny Llama pair, the tokenizer saved beside the target."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target("llama", logit_scale=4.0)
    draft = truncated_draft(target)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    tiny_tokenizer().save_pretrained(root / "target")
    return str(root / "target"), str(root / "draft")


def run_cli(argv, capsys):
    """``(exit status, stdout, stderr)`` of ``saguaro argv``; argparse errors exit through SystemExit."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def rounds_at_each_write(monkeypatch) -> list:
    """``(text, rounds committed so far)`` of each write to stdout, and the number of rounds at the end."""
    from saguaro.runtime.base.state import DecodeState

    rounds, writes, real_round, real_write = [0], [], DecodeState.round_committed, sys.stdout.write

    def counted(self):
        rounds[0] += 1
        real_round(self)

    monkeypatch.setattr(DecodeState, "round_committed", counted)
    monkeypatch.setattr(
        sys.stdout, "write", lambda text: writes.append((text, rounds[0])) or real_write(text)
    )
    return writes, rounds


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_generate_prints_the_targets_greedy_completion_and_stats(saved_pair, mode, capsys, monkeypatch):
    target_dir, draft_dir = saved_pair
    writes, rounds = rounds_at_each_write(monkeypatch)
    rc, out, err = run_cli(
        [
            "generate",
            "--prompt",
            PROMPT,
            "--target",
            target_dir,
            "--draft",
            draft_dir,
            "--mode",
            mode,
            "--k",
            "3",
            "--max-new-tokens",
            "12",
            "--backend",
            "eager",
        ],
        capsys,
    )
    assert rc == 0, err
    # streamed: the completion is written round by round, its first text before the last round ran
    text_writes = [r for text, r in writes[1:-1] if text.strip()]  # after the prompt, before the stats line
    assert len(text_writes) >= 2 and text_writes[0] < rounds[0], writes
    lines = out.splitlines()
    stats = STATS_LINE.match(lines[-1])
    assert stats and stats.group(1) == mode, out
    assert (stats.group(3) is not None) == (mode == "ssd")  # the cache hit rate is an SSD statistic
    # greedy SD is lossless: the printed text is the target's own greedy completion
    tok = tiny_tokenizer()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    expected = reference_greedy(target, ids, torch.ones_like(ids), 12, eos_token_id=EOS)
    completion = tok.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    assert "\n".join(lines[:-1]) == PROMPT + completion
    assert 1 <= int(stats.group(2)) <= 12


class Compiled(Exception):
    """Raised by a stand-in ``saguaro.compile``: what the command asked for, before any capture."""


@pytest.mark.parametrize("command", ["generate", "report", "bench"])
@pytest.mark.parametrize("plan", [None, "auto", "always-ssd"])
def test_plan_always_ssd_turns_sd_when_faster_off(saved_pair, command, plan, capsys, monkeypatch):
    """``--plan always-ssd`` (documented in --help) compiles with ``sd_when_faster=False``; ``auto``, the
    default, with True. (What a generation the planner ran as SD prints: tests/runtime/test_planner.py.)"""

    def stand_in(*args, **options):
        raise Compiled(options.get("sd_when_faster"))

    def bench_stand_in(params, announce):
        raise Compiled(params.plan != "always-ssd")

    monkeypatch.setattr(importlib.import_module("saguaro.compile"), "compile", stand_in)
    monkeypatch.setattr(importlib.import_module("saguaro.bench.run"), "run_bench", bench_stand_in)
    target_dir, draft_dir = saved_pair
    argv = {
        "generate": ["generate", "--prompt", PROMPT],
        "report": ["report", "out.html"],
        "bench": ["bench"],
    }[command]
    with pytest.raises(Compiled) as compiled:
        main(
            argv
            + ["--target", target_dir, "--draft", draft_dir, "--backend", "eager"]
            + (["--plan", plan] if plan else [])
        )
    assert compiled.value.args == (plan != "always-ssd",)
    assert "always-ssd" in run_cli([command, "--help"], capsys)[1]


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("linears", [None, "template", "gemm"])
def test_linears_reaches_compile(saved_pair, command, linears, capsys, monkeypatch):
    """``--linears`` (documented in --help) is the ``linears`` the program compiles with; ``auto`` by default.
    A bench row's worker compiles with its ``BenchParams.linears`` (``saguaro.bench.rows.compile_for``)."""

    def stand_in(*args, **options):
        raise Compiled(options.get("linears"))

    def bench_stand_in(params, announce):
        raise Compiled(params.linears)

    monkeypatch.setattr(importlib.import_module("saguaro.compile"), "compile", stand_in)
    monkeypatch.setattr(importlib.import_module("saguaro.bench.run"), "run_bench", bench_stand_in)
    target_dir, draft_dir = saved_pair
    argv = {"generate": ["generate", "--prompt", PROMPT], "bench": ["bench"]}[command]
    with pytest.raises(Compiled) as compiled:
        main(
            argv
            + ["--target", target_dir, "--draft", draft_dir, "--backend", "eager"]
            + (["--linears", linears] if linears else [])
        )
    assert compiled.value.args == (linears or "auto",)
    assert "template" in run_cli([command, "--help"], capsys)[1]
    with pytest.raises(Compiled) as compiled:  # the worker's side: compile_for passes it on
        importlib.import_module("saguaro.bench.rows").compile_for(
            None, None, 3, "eager", linears=linears or "auto"
        )
    assert compiled.value.args == (linears or "auto",)


def table_rows(out: str) -> list[str]:
    """The first column of the bench table's rows (between the header rule and the notes after it)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode")) + 2
    notes = ("wrote", "skipped", "The machine was busy")
    return [line.split()[0] for line in lines[start:] if line and not line.startswith(notes)]


@pytest.mark.heavy
def test_bench_prints_rows_and_writes_json(saved_pair, capsys, tmp_path):
    target_dir, draft_dir = saved_pair
    path = tmp_path / "out" / "bench.json"
    traces = tmp_path / "traces"
    rc, out, err = run_cli(
        [
            "bench",
            "--target",
            target_dir,
            "--draft",
            draft_dir,
            "--json",
            str(path),
            "--prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--k",
            "3",
            "--backend",
            "eager",
            "--same-process",
            "--trace",
            str(traces),
            "--repeats",
            "2",
        ],
        capsys,
    )
    assert rc == 0, err
    # --trace: one timeline per Saguaro row; ssd-uniform runs SSD's rounds whatever the timings (the
    # planner's row may measure SD faster and run it), so its timeline holds the draft lane's glue
    written = sorted(p.name for p in traces.iterdir())
    assert written == sorted(f"{m}-eager.json" for m in ("ar", "sd", "ssd", "ssd-uniform", "ssd-process"))
    uniform = json.loads((traces / "ssd-uniform-eager.json").read_text())
    check_trace(uniform)
    assert "draft.glue" in {s.name for s in slices(uniform)}
    table_modes = table_rows(out)
    assert re.search(r"^ssd \(eager\): load, compile, warm up$", out, re.M)
    assert re.search(r"^  ready; capture \+ compile \+ warm-up took [0-9.]+s$", out, re.M)
    assert re.search(r"^timed pass 2/2, tokens/s: ar [0-9.]+, sd [0-9.]+, ssd [0-9.]+, ", out, re.M)
    assert {"ar", "sd", "ssd", "ssd-uniform", "ssd-process", "hf-assisted", "hf"} <= set(table_modes)
    assert f"wrote {path}" in out
    report = json.loads(path.read_text())
    assert (
        report["config"]["k"] == 3 and report["config"]["prompts"] == 2 and report["config"]["repeats"] == 2
    )
    assert report["config"]["order"] == table_modes * 2
    check_timed_passes(report["rows"], 2, out)  # alternating passes, median, spread, the spread column
    assert report["prompts"]["source"] == "fixed"  # a user's pair: not the default pair's held-out files
    # a loaded machine's rows, by their table label: "ssd (ran as SD: no tree pays here)" where the planner ran SD
    busy = [row_label(row) for row in report["rows"] if (row["spread_pct"] or 0) > 25]
    assert report["busy_machine"] == busy and ("The machine was busy" in out) == bool(busy)
    rows = {row["mode"]: row for row in report["rows"]}
    assert list(rows) == table_modes
    for mode, row in rows.items():
        assert {"tokens_per_s", "mean_accepted_len", "speedup_vs_ar", "new_tokens", "wall_s"} <= set(row)
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
        assert math.isfinite(row["speedup_vs_ar"]) and row["speedup_vs_ar"] > 0, row
        assert row["new_tokens"] == 2 * 2 * 8, (
            row
        )  # eos is ignored: every pass of every row makes the same tokens
        if mode in ("ar", "sd", "ssd", "ssd-uniform", "ssd-process"):
            assert 1.0 <= row["mean_accepted_len"] <= 3 + 1, row
            # a round decides at most k+1 tokens of each prompt (batch 1): fewer rounds means lost counts
            assert row["rounds"] * (3 + 1) >= row["new_tokens"] and row["rounds"] <= row["new_tokens"], row
            assert 0 < row["round_ms_p50"] <= row["round_ms_p99"], row
            if mode.startswith("ssd"):
                hits, misses = sum(row["hits_by_position"].values()), sum(row["fallbacks"].values())
                if (
                    row["planned_sd_fraction"] == 0
                ):  # only SSD rounds ran: every round but a call's last looks up
                    assert hits + misses >= row["rounds"] - 2 * 2, row
                assert (hits > 0) == (row["cache_hit_rate"] > 0), row
                assert row["verify_ms_per_round"] > 0, row
                assert row["overlap_efficiency"] > 0, row
        else:
            assert row["mean_accepted_len"] is None  # transformers does not report it
    assert rows["ar"]["speedup_vs_ar"] == 1.0 and rows["ar"]["mean_accepted_len"] == 1.0
    assert rows["sd"]["speedup_vs_sd"] == 1.0 and all(
        math.isfinite(row["speedup_vs_sd"]) for row in rows.values()
    )
    assert all(re.fullmatch(r"[0-9.]+x", cell) for cell in table_column(out, "vs SD", len(rows)))


@pytest.mark.heavy
def test_bench_rows_without_a_draft(saved_pair, capsys, tmp_path):
    """Each row in its own process: the processes live together, warm, and take turns at timed passes."""
    target_dir, _ = saved_pair
    path = tmp_path / "bench.json"
    rc, out, err = run_cli(
        [
            "bench",
            "--target",
            target_dir,
            "--modes",
            "ar,hf",
            "--prompts",
            "1",
            "--max-new-tokens",
            "4",
            "--backend",
            "eager",
            "--repeats",
            "2",
            "--json",
            str(path),
        ],
        capsys,
    )
    assert rc == 0, err
    assert table_rows(out) == ["ar", "hf"]
    report = json.loads(path.read_text())
    assert report["config"]["order"] == ["ar", "hf", "ar", "hf"]
    check_timed_passes(
        report["rows"], 2, out
    )  # pass times from both processes: ar, hf, ar, hf, none overlapping
    assert table_column(out, "vs SD", 2) == ["-", "-"]  # no SD row


@pytest.mark.parametrize(
    "argv, named",
    [
        (["bench", "--modes", "foo"], "'foo'"),
        (["bench", "--modes", "ar,beam"], "'beam'"),
        (["generate", "--prompt", "x", "--k", "0"], "k=0"),
        (["bench", "--k", "17"], "k=17"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens=0"),
        (["bench", "--temperature", "-1"], "temperature=-1"),
        (["bench", "--temperature", "nan"], "temperature=nan"),
        (["bench", "--prompts", "0"], "prompts=0"),
        (["bench", "--batch", "two"], "'two'"),
        (["generate", "--prompt", "x", "--mode", "beam"], "'beam'"),
        (["bench", "--dtype", "int8"], "'int8'"),
        (["generate", "--prompt", "x", "--device", "warp-drive"], "'warp-drive'"),
    ],
)
def test_bad_values_exit_2_naming_the_value(argv, named, capsys):
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2
    assert named in err


def test_bad_model_folders_exit_2_naming_them(saved_pair, capsys, tmp_path):
    target_dir, draft_dir = saved_pair
    missing = str(tmp_path / "no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_text("")
    cases = [
        (
            ["generate", "--prompt", "x", "--target", missing, "--draft", draft_dir],
            [missing, "does not exist"],
        ),
        (["bench", "--target", target_dir, "--draft", missing], [missing, "--draft"]),
        (["generate", "--prompt", "x", "--target", target_dir], [target_dir, "without --draft"]),
        (["bench", "--draft", draft_dir], [draft_dir, "without --target"]),
        (["bench", "--target", str(a_file), "--draft", draft_dir], [str(a_file), "not a folder"]),
        (["bench", "--target", str(empty), "--draft", draft_dir], [str(empty), "could not load the target"]),
        (["generate", "--prompt", "", "--target", target_dir, "--draft", draft_dir], ["--prompt is empty"]),
        (
            ["generate", "--prompt", "x", "--target", draft_dir, "--draft", draft_dir],
            ["no tokenizer", draft_dir],
        ),
        (
            [
                "bench",
                "--target",
                target_dir,
                "--draft",
                draft_dir,
                "--batch",
                "2",
                "--modes",
                "sd,hf-assisted",
            ],
            ["hf-assisted", "--batch 2"],
        ),
    ]
    if not torch.cuda.is_available():
        cases.append(
            (
                [
                    "generate",
                    "--prompt",
                    "x",
                    "--target",
                    target_dir,
                    "--draft",
                    draft_dir,
                    "--device",
                    "cuda",
                ],
                ["--device 'cuda'", "no CUDA"],
            )
        )
    for argv, named in cases:
        rc, _, err = run_cli(argv, capsys)
        assert rc == 2, (argv, err)
        for text in named:
            assert text in err, (argv, err)
        assert "Traceback" not in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "def"], ["bench", "--prompts", "1"]])
def test_missing_default_pair_exits_with_a_clear_message(command, monkeypatch, capsys):
    default_pair = importlib.import_module("saguaro.default_pair")
    message = "the default model pair is not built: build it with `python examples/train_default_pair.py`"

    def absent(*args, **kwargs):
        raise SaguaroError(message)

    monkeypatch.setattr(default_pair, "load_default_pair", absent)
    rc, out, err = run_cli(command, capsys)
    assert rc != 0
    assert message in err and "Traceback" not in err
    assert out == ""


def test_console_script_end_to_end(saved_pair):
    """The installed ``saguaro`` script, AR mode with only a target (AR needs no draft)."""
    script = Path(sys.executable).parent / "saguaro"
    if not script.exists():
        pytest.skip(f"console script not installed beside {sys.executable}")
    target_dir, _ = saved_pair
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            str(script),
            "generate",
            "--prompt",
            PROMPT,
            "--target",
            target_dir,
            "--mode",
            "ar",
            "--max-new-tokens",
            "6",
            "--backend",
            "eager",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(PROMPT)
    stats = STATS_LINE.match(lines[-1])
    assert stats and stats.group(1) == "ar", proc.stdout
    assert "Loading weights" not in proc.stderr  # progress bars only with -v


def test_benchmark_script_forwards_to_bench(capsys, monkeypatch):
    """``benchmarks/bench.py`` is ``saguaro bench``: same options, same errors."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py", "--modes", "nope"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / "benchmarks" / "bench.py"), run_name="__main__")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "saguaro bench" in err and "'nope'" in err
