"""``benchmarks/parts/linear_as_reduction.py``: ``--compare`` must name two different ``linears`` settings (checked
before any model loads)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import linear_as_reduction


@pytest.mark.parametrize("compare", ["auto", "auto,auto", "gemm,auto,template"])
def test_compare_names_two_different_settings(compare, capsys):
    with pytest.raises(SystemExit) as exit_:
        linear_as_reduction.main(["--compare", compare])
    assert exit_.value.code == 2
    assert f"--compare {compare!r}: name two different linears settings" in capsys.readouterr().err
