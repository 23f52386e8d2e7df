"""benchmarks/parts/time_to_text.py times what a user watching a command sees: the first output, the first text
after a marker line (the demo's streamed completion), the end; and --cold gives the command empty caches."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "parts" / "time_to_text.py"
CHILD = (
    "import os, sys, time\n"
    "print('loading', flush=True); time.sleep(0.3)\n"
    "print('--- Saguaro (ssd) completes', flush=True); print('', flush=True); time.sleep(0.4)\n"
    "print('def f(x):', flush=True); time.sleep(0.2)\n"
    "print(os.environ.get('TMPDIR', '-'), os.environ.get('SAGUARO_CACHE_DIR', '-'), flush=True)\n"
    "sys.exit(int(sys.argv[1]))\n"
)


def run(tmp_path, *options, code=0):
    out = tmp_path / "times.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--json",
            str(out),
            *options,
            "--",
            sys.executable,
            "-c",
            CHILD,
            str(code),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, json.loads(out.read_text())


def test_first_text_is_the_first_output_after_the_marker_line(tmp_path):
    done, times = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert (
        0 <= times["first_output_s"]
        and times["first_output_s"] + 0.3 <= times["first_text_s"] < times["end_s"]
    )
    # the blank line after the marker is not text; the child slept 0.3 s before the marker, 0.4 s after it
    assert times["first_text_s"] - times["first_output_s"] >= 0.65
    assert times["exit_code"] == 0 and "first text" in done.stdout and "def f(x):" in done.stdout
    assert "saguaro_cold_" not in done.stdout  # without --cold the caches are the caller's


def test_cold_gives_empty_cache_folders_and_a_failure_is_reported(tmp_path):
    done, times = run(tmp_path, "--cold", "--marker", "", code=3)
    assert done.returncode == 1 and times["exit_code"] == 3
    assert times["first_text_s"] == times["first_output_s"]  # no marker: any output is text
    assert "saguaro_cold_" in done.stdout and "tmpdir" in done.stdout and "saguaro_cache_dir" in done.stdout
