"""``benchmarks/matmul_rates.py``: every matmul path over a model's weight matrices gives ``x @ W.T`` (to
rounding) and is timed; the JSON names each path per row count, with the bytes it read per second."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import matmul_rates  # noqa: E402
from tests.models import tiny_target  # noqa: E402


def test_every_path_computes_the_product_and_is_reported(tmp_path):
    folder = tmp_path / "tiny"
    tiny_target("llama").save_pretrained(folder)
    mats = matmul_rates.weight_matrices(str(folder))
    assert len(mats) == 2 * 7 + 1  # 7 linear layers in each of 2 layers, and the LM head
    for rows in (1, 3):
        found = matmul_rates.paths(mats, rows, inductor=False)
        assert set(found) == {"linear", "transposed", "onednn", "mul_sum"}
        expected = found["linear"]()
        for name, fn in found.items():
            for got, want in zip(fn(), expected):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    out = tmp_path / "rates.json"
    assert matmul_rates.main(["--target", str(folder), "--rows", "1,3", "--repeats", "1", "--no-inductor",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["rows"], r["path"]) for r in report["results"]] == [
        (m, p) for m in (1, 3) for p in ("linear", "transposed", "onednn", "mul_sum")]
    assert all(r["ms"] > 0 and r["gb_per_s"] > 0 for r in report["results"])
    assert report["megabytes"] == sum(w.numel() * 4 for w in mats) / 1e6
