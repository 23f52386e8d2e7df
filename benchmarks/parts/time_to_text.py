"""Time a command's output as a user watching it sees it: when its first line comes, when the first text
after a marker line comes (the demo's streamed completion) and when it ends.

    python benchmarks/parts/time_to_text.py --json demo_warm.json
    python benchmarks/parts/time_to_text.py --cold --json demo_cold.json
    python benchmarks/parts/time_to_text.py --marker "" -- saguaro generate --prompt "def f(x):"

The command (default: this interpreter running ``examples/demo.py``) runs behind a pipe with
``PYTHONUNBUFFERED=1``; its output is echoed with the seconds since start. ``--cold`` runs it with a new
empty ``TMPDIR`` (Inductor's cache and its precompiled headers live under it by default) and new empty
``TORCHINDUCTOR_CACHE_DIR`` and ``SAGUARO_CACHE_DIR`` (Saguaro's capture cache), as on a fresh machine;
without it the caches are whatever earlier runs left. Prints the three times and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_MARKER = "--- Saguaro ("  # the line before the demo's streamed completion


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--marker",
        default=DEMO_MARKER,
        help="text of the line after which the first output is 'first text' (default: the demo's "
        f"{DEMO_MARKER!r}; '' for the first output at all)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="empty caches: new TMPDIR, TORCHINDUCTOR_CACHE_DIR and SAGUARO_CACHE_DIR",
    )
    p.add_argument("--json", metavar="PATH", help="write the times here")
    p.add_argument("--quiet", action="store_true", help="do not echo the command's output")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command after '--' (default: the demo)")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        args.command = [sys.executable, str(REPO / "examples" / "demo.py")]
    return args


def time_output(command: list, marker: str, env: dict, echo=None) -> dict:
    """Run ``command``; ``{"first_output_s", "first_text_s", "end_s", "exit_code"}``: first text is the
    first non-blank output after the line that starts with ``marker`` (any output for ``""``). A time is
    None when it never came."""
    started = time.perf_counter()
    times = {"first_output_s": None, "first_text_s": None, "end_s": None, "exit_code": None}
    before = None if marker == "" else ""  # the output up to the end of the marker line, while it is awaited
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    while chunk := proc.stdout.read1(65536):
        now = time.perf_counter() - started
        text = chunk.decode(errors="replace")
        if echo is not None:
            echo(f"[{now:7.2f}] {text}")
        if times["first_output_s"] is None:
            times["first_output_s"] = now
        if before is not None:  # still looking for the marker line's end
            before += text
            at = before.find(marker)
            while at > 0 and before[at - 1] != "\n":
                at = before.find(marker, at + 1)
            line_end = before.find("\n", at) if at >= 0 else -1
            if line_end < 0:
                continue
            text, before = before[line_end + 1 :], None
        if times["first_text_s"] is None and text.strip():
            times["first_text_s"] = now
    times["exit_code"] = proc.wait()
    times["end_s"] = time.perf_counter() - started
    return times


def main(argv=None) -> int:
    args = parse_args(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="saguaro_cold_") as cold:
        if args.cold:
            for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "SAGUARO_CACHE_DIR"):
                env[name] = os.path.join(cold, name.lower())
                os.makedirs(env[name])
        echo = (
            None
            if args.quiet
            else (
                lambda line: (
                    sys.stdout.write(line if line.endswith("\n") else line + "\n"),
                    sys.stdout.flush(),
                )
            )
        )
        times = time_output(args.command, args.marker, env, echo)
    report = {
        "command": args.command,
        "marker": args.marker,
        "cold": args.cold,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **times,
    }
    fmt = lambda s: "never" if s is None else f"{s:.1f} s"
    print(
        f"first output {fmt(times['first_output_s'])}, first text {fmt(times['first_text_s'])}, "
        f"end {fmt(times['end_s'])} (exit code {times['exit_code']})"
    )
    if args.json:
        path = Path(args.json)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(path)
    return 0 if times["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
