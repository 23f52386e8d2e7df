"""A row in its own process (``saguaro.bench.run.WorkerRow``) that dies: the error names the row, its exit
code and the tail of its stderr. Stand-in workers (no torch import) keep this cheap; the real worker's
protocol runs in tests/test_cli.py."""

import pytest

from saguaro.bench import run as bench_run
from saguaro.bench.worker import BenchParams


@pytest.mark.parametrize(
    "script, code, said",
    [
        (
            "import sys; sys.stderr.write('loading\\nValueError: no such folder\\n'); sys.exit(3)",
            3,
            "ValueError: no such folder",
        ),  # dies before it is ready
        (
            "import json, sys\nprint(json.dumps({'ready': True, 'setup_s': 73.25}), flush=True)\nsys.stdin.readline()\n"
            "sys.stderr.write('killed mid-pass\\n'); sys.exit(9)",
            9,
            "killed mid-pass",
        ),  # dies in a timed pass
    ],
    ids=["before-ready", "mid-pass"],
)
def test_a_row_process_that_dies_names_its_row_and_stderr(monkeypatch, script, code, said):
    monkeypatch.setattr(bench_run, "WORKER", ("-c", script))
    with pytest.raises(RuntimeError) as failed:
        row = bench_run.WorkerRow(BenchParams(), "sd", "eager")
        try:
            assert row.setup_s == 73.25  # the worker's figure, not its 'ready' flag
            row.time_pass()
        finally:
            row.close()
    message = str(failed.value)
    assert message.startswith(f"benchmark row sd (eager) failed with exit code {code}:") and said in message
