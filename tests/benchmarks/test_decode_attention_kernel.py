"""``benchmarks/decode_attention_kernel.py``: without a build it says why and exits 0 (the experiment is
optional); the vector-width defines follow torch's CPU capability."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention_kernel  # noqa: E402


def test_no_build_is_a_skip_with_its_reason(monkeypatch, tmp_path, capsys):
    def no_compiler(directory=None):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(decode_attention_kernel, "build", no_compiler)
    out = tmp_path / "r.json"
    assert decode_attention_kernel.main(["--json", str(out)]) == 0
    why = "the kernel could not be built here (RuntimeError: Ninja is required to load C++ extensions)"
    assert f"skipped: {why}" in capsys.readouterr().out
    assert json.loads(out.read_text()) == {"skipped": why}


def test_vector_width_follows_torch_capability():
    assert decode_attention_kernel.capability_flags("AVX512") == [
        "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-march=native"]
    assert decode_attention_kernel.capability_flags("AVX2")[0] == "-DCPU_CAPABILITY_AVX2"
    assert decode_attention_kernel.capability_flags("DEFAULT") == []
