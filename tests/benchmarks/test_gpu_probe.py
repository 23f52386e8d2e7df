"""benchmarks/gpu_probe keeps working between GPU sessions: each part runs at ``--scale tiny --device cpu``
and writes every field its rows promise, a part whose time share runs out gets SIGTERM (then SIGKILL)
and keeps what it measured, a part that raises is recorded and the next one runs, a CUDA device is
refused where there is none, and the 8B pair's arithmetic holds without building it."""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_probe import cli, counting, models, overlap
from benchmarks.gpu_probe.report import Report

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_probe.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
K = 3  # the tiny scale's k


def _command(tmp_path, *args):
    return [
        sys.executable,
        str(SCRIPT),
        "--scale",
        "tiny",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "cache"),
        *args,
    ]


def _probe(tmp_path, *args):
    done = subprocess.run(
        _command(tmp_path, *args), check=False, cwd=REPO, capture_output=True, text=True, timeout=280, env=ENV
    )
    report_path = tmp_path / "gpu_probe.json"
    assert report_path.exists(), done.stdout[-2000:] + done.stderr[-3000:]
    return done, json.loads(report_path.read_text())


def _check_row(row: dict, mode: str, batch: int) -> None:
    """The fields every speed row promises, with sane values."""
    assert row["status"] == "ok", row
    assert row["batch"] == batch and row["mode"] == mode
    assert row["tokens_per_s"] > 0 and row["ms_per_round"] > 0 and row["rounds"] > 0
    assert row["bytes_per_round"] > 0 and row["bytes_per_token"] > 0
    assert 0 < row["roofline_share"] < 5  # on a CPU the tiny model sits in cache: past 1 is possible, not far
    assert isinstance(row["host_syncs_per_round"], int) and 0 <= row["host_syncs_per_round"] <= 2
    assert (
        row["host_syncs"]["rounds"] > 0 and row["host_syncs"]["where"]
    )  # its own generation: SSD's rounds vary
    launches = row["launches_per_stage"]
    assert launches and all(isinstance(n, int) and n > 0 for n in launches.values())
    assert "target.prefill" in launches and row["launches_source"] == [
        "aten operators of the stage graph (eager)"
    ]
    if row["ran"] == "ssd":
        assert set(row["hits_by_position"]) == {str(i) for i in range(K + 1)}
        assert set(row["fallbacks"]) == {"neural", "fast"}
        assert 0.0 <= row["cache_hit_rate"] <= 1.0
    assert row["counted_ran"] in ("ar", "sd", "ssd")
    if (
        row["counted_ran"] == "ssd"
    ):  # the fan-outs: the counted generation's (the planner decides per generation)
        assert row["fan_out_per_round"] and all(len(f) == K + 1 for f in row["fan_out_per_round"])
        assert sum(row["branches_per_round_counts"].values()) == row["fan_out_rounds"]
    if row["ran"] == "sd":
        assert 0 < row["c_measured"] and row["acceptance"] is not None


def _check_part_head(part: dict, tmp_path, name: str) -> None:
    assert part["environment"]["torch"] == torch.__version__
    assert part["bandwidth"]["gb_per_s"] > 0
    assert abs(part["models"]["tuning"]["agreement"] - 0.75) <= 0.1  # the knob found the asked-for agreement
    assert part["models"]["bytes_per_token"]["target"] > part["models"]["bytes_per_token"]["draft"] > 0
    trace = part["trace"]
    assert trace["file"] == f"gpu_probe_trace_{name}.json" and 3 <= trace["rounds"] <= 5
    assert json.loads((tmp_path / trace["file"]).read_text())["traceEvents"]
    averages = trace["key_averages"]
    assert averages["top"] and averages["cpu_ms_total"] > 0 and averages["device_ms_total"] is None


@pytest.fixture(scope="module")
def speed_parts(tmp_path_factory):
    """Parts A, B, C and E in one run (one process: torch imported once)."""
    tmp_path = tmp_path_factory.mktemp("speed_parts")
    done, report = _probe(tmp_path, "--part", "A,B,C,E")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, report, tmp_path


@pytest.mark.heavy
@pytest.mark.xdist_group("gpu_probe_speed_parts")
@pytest.mark.parametrize("name", ["A", "B", "C", "E"])
def test_each_speed_part_writes_every_row_field(name, speed_parts):
    done, report, tmp_path = speed_parts
    part = report["parts"][name]
    assert part["status"] == "ok", part.get("error") or part["status"]
    _check_part_head(part, tmp_path, name)
    rows = {r["row"]: r for r in part["rows"]}
    if name == "A":
        _check_row(rows["ar_graphs_off"], "ar", 1)
        assert rows["ar_graphs_on"]["status"].startswith("skipped: cuda_graphs=True needs")  # CUDA only
        assert rows["ar_graphs_on_attention_reduce"]["status"].startswith("skipped: cuda_graphs=True needs")
        micro = part["micro"]["rows"]
        assert any(r["variant"] == "aten F.linear" and r["us"] > 0 for r in micro)
        assert any(r["variant"] == "sdpa over the valid slots" and r["us"] > 0 for r in micro)
        assert all(r["status"] == "ok" or r["status"].startswith("skipped: CUDA only") for r in micro)
    elif name == "B":
        _check_row(rows["sd_graphs_off"], "sd", 1)
        assert list(rows) == ["sd_graphs_on", "sd_graphs_off", "ar_graphs_on"]  # what a user gets first
        assert rows["ar_graphs_on"]["status"].startswith("skipped: cuda_graphs=True needs")  # CUDA only
    elif name == "C":
        _check_row(rows["ssd"], "ssd", 1)
        assert rows["ssd"]["ran"] == rows["ssd"]["counted_ran"] == "ssd" and rows["ssd"]["lane"] == "thread"
        _check_row(rows["ssd_planner"], "ssd", 1)
        assert part["overlap"]["status"] == "ok" and part["overlap"]["rounds"] > 0
        assert (
            0.0 <= part["overlap"]["hidden_fraction_host"] <= 1.0
            and "CUDA-only" in part["overlap"]["cuda_events"]
        )
    else:
        assert set(rows) == {"ar", "sd", "ssd_planner", "ssd"}
        for label, row in rows.items():
            _check_row(row, label.removesuffix("_planner"), 8)
    assert f"part {name}" in done.stdout and "roofline" in done.stdout


@pytest.mark.heavy
def test_exactness_part_checks_every_path_and_says_what_needs_cuda(tmp_path):
    done, report = _probe(tmp_path, "--part", "D", "--exactness", "inductor_cuda_graphs,eager")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    subphases = report["parts"]["D"]["subphases"]
    assert subphases["inductor_cuda_graphs"]["status"] == "skipped: cuda_graphs needs CUDA"
    eager = subphases["eager"]
    names = {c["name"] for c in eager["checks"]}
    for batch in (1, 3):
        for label in ("ar", "sd", "ssd_thread", "ssd_fan_out_0", "ssd_process"):
            assert f"llama/b{batch}/greedy_{label}" in names
        for label in ("ar", "sd", "ssd_thread", "ssd_process"):
            assert f"llama/b{batch}/sampled_{label}" in names
    assert eager["status"] == "ok" and all(c["ok"] for c in eager["checks"]) and not eager["skipped"]
    assert report["summary"]["exactness_all_true"] is True and "exactness all true: True" in done.stdout


@pytest.mark.heavy
def test_sigterm_to_a_part_keeps_what_it_measured(tmp_path):
    """The child of part B stalls after its first measured row (``--test-hang``); SIGTERM to it marks the part
    terminated and keeps the row, its trace, and the head of the part."""
    parent = subprocess.Popen(
        _command(tmp_path, "--part", "B", "--isolate", "yes", "--test-hang", "--budget-s", "600"),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    path, part, waited = tmp_path / "gpu_probe.json", {}, time.time()
    try:
        while time.time() - waited < 240 and parent.poll() is None:
            part = json.loads(path.read_text()).get("parts", {}).get("B", {}) if path.exists() else {}
            if part.get("trace") and any(row["status"] == "ok" for row in part.get("rows", [])):
                break
            time.sleep(0.5)
        assert part.get("trace"), parent.stdout.read()[-3000:] if parent.poll() is not None else part
        os.kill(part["pid"], signal.SIGTERM)
        out, _ = parent.communicate(timeout=120)
    finally:
        if parent.poll() is None:
            parent.kill()
    part = json.loads(path.read_text())["parts"]["B"]
    assert part["status"].startswith("terminated: SIGTERM"), out[-2000:]
    measured = [
        row for row in part["rows"] if row["status"] == "ok"
    ]  # graphs on is CUDA only: graphs off here
    assert [row["row"] for row in measured] == ["sd_graphs_off"]
    _check_row(measured[0], "sd", 1)
    assert part["bandwidth"]["gb_per_s"] > 0 and part["trace"]["file"]


def test_a_part_past_its_budget_gets_sigterm_then_sigkill(tmp_path):
    """The parent's side, with stand-in children: one stops on SIGTERM, one ignores it and is killed
    after the grace period; a row still running is marked, a finished one kept."""
    report = Report(tmp_path / "gpu_probe.json")
    stops = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)"
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    args = argparse.Namespace(grace_s=1.0)
    for name, code in (("A", stops), ("B", ignores)):
        report.update(
            ("parts", name),
            {
                "status": "running",
                "rows": [{"row": "done", "status": "ok"}, {"row": "mid", "status": "running"}],
            },
        )
        cli.run_child(name, args, report, budget=1.5, cmd=[sys.executable, "-c", code])
    parts = report.load()["parts"]
    assert parts["A"]["status"].startswith("terminated: its process stopped after SIGTERM")
    assert parts["B"]["status"].startswith("terminated: killed 1s after SIGTERM")
    for name in ("A", "B"):
        assert [r["status"] for r in parts[name]["rows"]] == ["ok", parts[name]["status"]]


def test_a_part_that_raises_is_recorded_with_its_traceback(tmp_path):
    args = cli.parse_args(["--device", "cpu", "--part", "A,B", "--fail-part", "A", "--out", str(tmp_path)])
    report = Report(tmp_path / "gpu_probe.json")
    cli.run_part("A", args, report, time.time() + 60)
    part = report.load()["parts"]["A"]
    assert part["status"] == "error" and "broken on purpose" in part["error"]["traceback"]
    assert report.load()["summary"]["status"] == {"A": "error"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown where CUDA is absent")
def test_cuda_without_a_gpu_is_refused_clearly(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--part", "A"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert done.returncode != 0
    assert "--device cuda is not allowed here: CUDA is not available" in done.stderr
    assert not (tmp_path / "gpu_probe.json").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--part", "F"], "--part F is not allowed: choose from A, B, C, D, E"),
        (["--acceptance", "1.5"], "--acceptance 1.5 is not allowed"),
        (["--exactness", "fast"], "--exactness fast is not allowed"),
    ],
)
def test_bad_options_are_refused_naming_the_value(argv, says, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", *argv])
    assert says in capsys.readouterr().err


def test_8b_pair_reads_what_its_config_says_and_the_draft_at_most_012_of_it():
    """Bytes per token from the config's arithmetic, checked against the parameters of the real model
    built on the meta device (no memory), and the 1-layer draft's share."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = models.SHAPES["8b"]
    assert (shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]) == (4096, 14336, 128256)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], models.LAYERS["8b"]) == (32, 8, 32)
    pair = models.pair_bytes("8b", 32, 2, context=192)
    target = pair["target_detail"]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape, num_hidden_layers=32))
    read = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert target["weights"] == 2 * read  # every weight but the embedding table, once, in bf16
    assert target["kv"] == 32 * 2 * 8 * 128 * 192 * 2  # K and V of each layer over the context
    assert math.isclose(pair["target"] / 1e9, 15.03, abs_tol=0.01)
    assert pair["draft"] / pair["target"] == pytest.approx(pair["c_bytes"], abs=1e-4)
    assert pair["c_bytes"] <= models.MAX_DRAFT_RATIO
    assert models.round_bytes("sd", 5, pair) == pair["target"] + 5 * pair["draft"]
    assert models.round_bytes("ar", 5, pair) == pair["target"]


def test_launches_are_counted_from_the_generated_call():
    code = '''
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', """...""")
class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        buf0 = empty_strided_cuda((6, 4096), (4096, 1), torch.bfloat16)
        triton_poi_fused_add_0.run(arg0_1, buf0, 24576, stream=stream0)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        cpp_fused_mul_1(buf1, buf2)
        buf3 = torch.ops.saguaro.attention.default(buf2, arg0_1)
        return (reinterpret_tensor(buf1, (6, 4096), (4096, 1), 0), )
def benchmark_compiled_module():
    triton_poi_fused_add_0.run(x, y, 1)
'''
    assert counting.launches_in_code(code) == 4

    def f(x):
        return (x.view(-1) * 2).reshape(2, 2).relu()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.ones(4))
    assert counting.launches_in_graph(gm) == 2  # mul and relu; the views launch nothing


def test_rounds_pair_each_verify_with_the_build_posted_for_it():
    """The overlap's arithmetic on a made-up timeline: half of the first build hides under its verify,
    all of the second; a build is paired with the verify it was posted for, even when its thread
    started it after the verify began."""
    calls = [
        {"name": "build", "lane": "lane", "host": (0.0, 4.0), "gpu": (0.0, 4.0)},
        {"name": "verify", "lane": "caller", "host": (0.0, 2.0), "gpu": (2.0, 6.0)},
        {"name": "verify", "lane": "caller", "host": (7.0, 11.0), "gpu": (7.0, 11.0)},
        {"name": "build", "lane": "lane", "host": (7.5, 9.0), "gpu": (8.0, 10.0)},
    ]
    found = overlap.summary(calls, cuda=True)
    assert found["rounds"] == 2
    assert [r["hidden_gpu"] for r in found["per_round"]] == [0.5, 1.0]
    assert found["hidden_fraction_gpu"] == round((2.0 + 2.0) / (4.0 + 2.0), 3)
    assert found["stages"]["verify [caller]"]["calls"] == 2


class _FakeEvent:
    """``torch.cuda.Event`` on a CPU: each record reads a clock that advances 2 ms per reading."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        _FakeEvent.clock += 2.0
        self.at = _FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.at - self.at


def test_cuda_timing_and_key_averages_paths_on_a_cpu(monkeypatch):
    """The CUDA branches a CPU can reach: event timing (against a stand-in event) and the profiler's
    device columns (zero on a CPU trace, but read the way a CUDA one is)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_probe import hardware, trace

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    calls = []
    assert hardware.median_s(lambda: calls.append(1), torch.device("cuda"), repeats=5) == pytest.approx(0.002)
    assert len(calls) == 3 + 5  # warm-up, then the timed calls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    found = trace.key_averages(prof, rounds=2, cuda=True)
    assert found["sorted_by"] == "self_device_ms" and found["top"]
    assert found["device_ms_total"] == 0.0 and found["device_kernels_per_round"] == 0.0
    assert found["cpu_ms_per_round"] == pytest.approx(found["cpu_ms_total"] / 2, abs=1e-3)
