"""benchmarks/gpu_probe.py keeps working between GPU sessions: its tiny CPU run writes every phase with
exactness all true, a phase that raises is recorded and the next one still runs, and it refuses a CUDA
device where there is none."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_probe.py"
PHASES = ("environment", "exactness", "speed", "overlap")


def _probe(tmp_path, *args):
    done = subprocess.run([sys.executable, str(SCRIPT), "--scale", "tiny", "--device", "cpu", "--out", str(tmp_path),
                           "--kernel-dir", str(tmp_path / "cache"), *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report_path = tmp_path / "gpu_probe.json"
    assert report_path.exists(), done.stdout[-2000:] + done.stderr[-3000:]
    return done, json.loads(report_path.read_text())


@pytest.mark.heavy
def test_tiny_cpu_probe_writes_every_phase_with_exactness_true(tmp_path):
    done, report = _probe(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    phases = report["phases"]
    assert set(PHASES) <= set(phases)
    assert {name: phases[name]["status"] for name in PHASES} == dict.fromkeys(PHASES, "ok")
    assert report["summary"]["exactness_all_true"] is True

    env = phases["environment"]
    assert env["torch"] == torch.__version__ and "cuda_graphs" in env["options"]

    eager = phases["exactness"]["subphases"]["eager"]
    names = {c["name"] for c in eager["checks"]}
    for batch in (1, 3):
        for label in ("ar", "sd", "ssd_thread", "ssd_fan_out_0", "ssd_process"):
            assert f"llama/b{batch}/greedy_{label}" in names
        for label in ("ar", "sd", "ssd_thread", "ssd_process"):
            assert f"llama/b{batch}/sampled_{label}" in names
    assert all(c["ok"] for c in eager["checks"]) and not eager["skipped"]
    by_name = {c["name"]: c for c in eager["checks"]}
    assert by_name["llama/b3/greedy_ssd_process"]["lane"] == "process"  # the lane asked for, not its fallback
    assert by_name["llama/b3/greedy_ssd_fan_out_0"]["cache_hit_rate"] == 0.0
    for sub in ("inductor", "inductor_cuda_graphs_flex"):  # eager only on CPU, and the JSON says so
        assert phases["exactness"]["subphases"][sub]["status"].startswith("skipped: not in --exactness")

    speed = phases["speed"]
    assert abs(speed["tuning"]["agreement"] - 0.7) <= 0.1  # the knob found the asked-for agreement
    assert {(r["batch"], r["row"]) for r in speed["rows"]} == {
        (b, row) for b in (1, 8) for row in ("ar", "sd", "ssd", "ssd_planner")}
    for row in speed["rows"]:
        assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["ms_per_round"] > 0
    assert all("planned_sd" in r and "cache_hit_rate" in r for r in speed["rows"] if r["row"].startswith("ssd"))

    overlap = phases["overlap"]
    assert "CUDA-only" in overlap["cuda_events"]
    for batch in ("1", "8"):
        data = overlap["batches"][batch]
        assert data["rounds"] > 0 and 0.0 <= data["hidden_fraction_host"] <= 1.0
        assert data["hidden_fraction_gpu"] is None and "verify [caller]" in data["stages"]
    assert overlap["trace"].startswith("gpu_probe_trace.json")
    assert json.loads((tmp_path / "gpu_probe_trace.json").read_text())["traceEvents"]
    assert "exactness all true: True" in done.stdout


@pytest.mark.heavy
def test_a_broken_phase_is_recorded_and_the_next_one_runs(tmp_path):
    done, report = _probe(tmp_path, "--phases", "environment,exactness,overlap", "--fail-phase", "exactness")
    assert done.returncode == 1  # an exactness sub-phase that could not run: exactness is not all true
    phases = report["phases"]
    eager = phases["exactness"]["subphases"]["eager"]
    assert eager["status"] == "error" and "broken on purpose" in eager["error"]["traceback"]
    assert phases["exactness"]["status"].startswith("eager: error")
    assert report["summary"]["exactness_all_true"] is False
    assert phases["environment"]["status"] == "ok" and phases["overlap"]["status"] == "ok"
    assert phases["overlap"]["batches"]["1"]["rounds"] > 0  # ran after the broken phase, on its own program
    assert phases["speed"]["status"] == "skipped: not in --phases"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown where CUDA is absent")
def test_cuda_without_a_gpu_is_refused_clearly(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--device cuda is not allowed here: CUDA is not available" in done.stderr
    assert not (tmp_path / "gpu_probe.json").exists()


def _benchmark_module(name):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_full_scale_speed_target_has_llama_8b_widths():
    shape = _benchmark_module("probe_speed").SHAPES["full"]
    assert (shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]) == (4096, 14336, 128256)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"]) == (32, 8)


def test_rounds_pair_each_verify_with_the_build_posted_for_it():
    """The overlap phase's arithmetic on a made-up timeline: half of the first build hides under its
    verify, all of the second; a build is paired with the verify it was posted for, even when its
    thread started it after the verify began."""
    probe_overlap = _benchmark_module("probe_overlap")
    calls = [
        {"name": "build", "lane": "lane", "host": (0.0, 4.0), "gpu": (0.0, 4.0)},
        {"name": "verify", "lane": "caller", "host": (0.0, 2.0), "gpu": (2.0, 6.0)},
        {"name": "verify", "lane": "caller", "host": (7.0, 11.0), "gpu": (7.0, 11.0)},
        {"name": "build", "lane": "lane", "host": (7.5, 9.0), "gpu": (8.0, 10.0)},
    ]
    found = probe_overlap.summary(calls, cuda=True)
    assert found["rounds"] == 2
    assert [r["hidden_gpu"] for r in found["per_round"]] == [0.5, 1.0]
    assert found["hidden_fraction_gpu"] == round((2.0 + 2.0) / (4.0 + 2.0), 3)
    assert found["stages"]["verify [caller]"]["calls"] == 2
