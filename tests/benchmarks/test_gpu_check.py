"""benchmarks/gpu_check.py keeps working between GPU sessions: its tiny scale on the CPU writes every
figure the GPU check reports, and it refuses a CUDA device where there is none."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(*args, tmp_path):
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--kernel-dir", str(tmp_path / "cache")],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.heavy
def test_tiny_cpu_run_reports_every_figure(tmp_path):
    report_path = tmp_path / "check.json"
    done = _run("--scale", "tiny", "--device", "cpu", "--backend", "eager", "--k", "3", "--prompt-len", "12",
                "--max-new-tokens", "12", "--repeats", "2", "--target-layers", "3", "--json", str(report_path), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    for key in ("verify_ms", "glue_ms", "draft_step_ms", "sd_round_ms", "ssd_round_ms", "compile_s"):
        assert report[key] > 0, key
    assert len(report["tree_ms_per_depth"]) == 3 and all(ms > 0 for ms in report["tree_ms_per_depth"])
    # SSD's own figures are reported for the SSD row only (their values depend on the planner's timings)
    assert report["rounds"]["ssd"]["rounds"] >= 1
    assert {"cache_hit_rate", "draft_wait_ms_per_round"} <= set(report["rounds"]["ssd"])
    assert not {"cache_hit_rate", "draft_wait_ms_per_round"} & set(report["rounds"]["sd"])
    assert report["kernels"]["triton_count"] == 0  # the eager backend generates none
    assert report["shapes"]["target"]["num_hidden_layers"] == 3  # --target-layers overrides the shape's 2
    assert "verify_ms" in done.stdout and str(report_path) in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown where CUDA is absent")
def test_cuda_without_a_gpu_is_refused_clearly(tmp_path):
    done = _run("--scale", "tiny", "--json", str(tmp_path / "x.json"), tmp_path=tmp_path)
    assert done.returncode != 0
    assert "--device cuda is not allowed here: CUDA is not available" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_full_scale_shapes_are_the_llama_ones():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    target, draft = gpu_check.SHAPES["full"]["target"], gpu_check.SHAPES["full"]["draft"]
    assert (target["hidden_size"], target["num_hidden_layers"], target["intermediate_size"]) == (4096, 32, 14336)
    assert (draft["hidden_size"], draft["num_hidden_layers"], draft["intermediate_size"]) == (2048, 16, 8192)
    assert target["vocab_size"] == draft["vocab_size"] == 128256
    assert target["num_key_value_heads"] == draft["num_key_value_heads"] == 8
