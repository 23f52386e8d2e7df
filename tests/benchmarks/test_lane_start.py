"""benchmarks/parts/lane_start.py refuses a repeat count it cannot run, naming it (the timing itself needs the
default pair and a draft process: run by hand, figures in benchmarks/README.md)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_zero_repeats_are_refused_naming_the_value(capsys):
    sys.path.insert(0, str(REPO / "benchmarks" / "parts"))
    try:
        import lane_start
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit) as exited:
        lane_start.main(["--repeats", "0"])
    assert exited.value.code == 2 and "--repeats 0 is not allowed" in capsys.readouterr().err
