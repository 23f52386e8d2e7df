"""What ``serve_load.py`` and ``serve_soak.py`` share: a ``saguaro serve`` process on loopback, one request
timed from the client's side (time to first token, inter-token latencies), the server's resources read
from /proc, and percentiles."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"saguaro serve: (\S+) at (http://\S+/v1)")
PROMPTS = [  # short, medium and long prompts of code
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main(argv):\n    ",
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n        self.items = []\n\n'
    "    def push(self, item):\n        ",
    "def read_config(path):\n    with open(path) as f:\n        ",
    "for i in range(10):\n    if i % 2 == 0:\n        ",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n    ",
]


def add_model_args(parser) -> None:
    parser.add_argument("--target", metavar="DIR", help="saved target folder (default: the default pair)")
    parser.add_argument("--draft", metavar="DIR", help="saved draft folder (default: the default pair)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the tests' tiny random pair (a quick check of the script, not a measurement)",
    )
    parser.add_argument(
        "--backend",
        default="eager",
        choices=["eager", "inductor"],
        help="saguaro serve --backend (default eager)",
    )
    parser.add_argument("--k", type=int, default=5, help="speculation length (default 5)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results here as JSON")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the server's torch threads (OMP_NUM_THREADS; "
        "default: torch's). On a loaded machine 1 avoids OpenMP threads waiting on each other",
    )


def tiny_pair_dirs() -> tuple[str, str]:
    """The tests' tiny llama pair (and tokenizer) saved in a temporary folder."""
    sys.path.insert(0, str(REPO))
    from tests.models import tiny_target, truncated_draft
    from tests.tiny_tokenizer import tiny_tokenizer

    root = Path(tempfile.mkdtemp(prefix="saguaro-serve-tiny-"))
    atexit.register(shutil.rmtree, root, True)
    target = tiny_target("llama")
    truncated_draft(target).save_pretrained(root / "draft")
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    return str(root / "target"), str(root / "draft")


def model_dirs(args) -> tuple:
    if args.tiny:
        return tiny_pair_dirs()
    return args.target, args.draft


COMPILED = re.compile(r"compiled in ([0-9.]+)s|compile included\) took ([0-9.]+)s")


def slow_compiles(lines) -> int:
    """The lines of a server's log that tell of a stage call compiling for a second or more."""
    found = (COMPILED.search(line) for line in lines)
    return sum(float(match.group(1) or match.group(2)) >= 1.0 for match in found if match)


class ServerProcess:
    """``saguaro serve`` in a child process on 127.0.0.1, a port the system picks; ``stop()`` sends SIGTERM."""

    def __init__(
        self,
        target,
        draft,
        mode: str,
        backend: str,
        k: int,
        max_batch: int,
        max_queue: int,
        threads: int | None = None,
        extra: tuple = (),
    ):
        argv = [
            "--verbose",  # INFO: a stage call that compiled is logged (compiles_logged)
            "serve",
            "--mode",
            mode,
            "--backend",
            backend,
            "--k",
            str(k),
            "--port",
            "0",
            "--max-batch",
            str(max_batch),
            "--max-queue",
            str(max_queue),
            *extra,
        ]
        argv += ["--target", target] if target else []
        argv += ["--draft", draft] if draft and mode != "ar" else []
        code = "import sys; from saguaro.cli import main; sys.exit(main(sys.argv[1:]))"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        line = self.process.stdout.readline()
        ready = READY.search(line)
        if not ready:
            self.process.wait(timeout=60)
            self.log.seek(0)
            raise RuntimeError(f"saguaro serve did not start: {line!r}\n{self.log.read()[-4000:]}")
        self.model, self.url = ready.group(1), ready.group(2)
        self.base = self.url.removesuffix("/v1")

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 300) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            self.process.stdout.close()

    def compiles_logged(self) -> int:
        """How many stage calls the server has logged as compiling for a second or more (``lowering.CompiledStage``'s
        "compiled in" and "compile included" lines; a new shape key that a dynamic graph already covers logs
        0.0s): a count taken before and after a timed row tells whether a compile ran inside it."""
        self.log.seek(0)
        return slow_compiles(self.log)

    def stderr_tail(self, chars: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:]


def request(client: httpx.Client, url: str, body: dict, timeout: float = 600) -> dict:
    """One completion request: ``status``, ``text``, ``tokens`` (usage), ``ttft`` and ``itl`` (streamed:
    seconds to the first text and between texts; whole: the latency as ttft), ``error`` (None, or words)."""
    started = time.perf_counter()
    result = {
        "status": None,
        "text": "",
        "tokens": 0,
        "ttft": None,
        "itl": [],
        "error": None,
        "stream": bool(body.get("stream")),
        "accepted": False,
    }
    try:
        if not body.get("stream"):
            answer = client.post(url + "/completions", json=body, timeout=timeout)
            result["status"] = answer.status_code
            result["ttft"] = time.perf_counter() - started
            if answer.status_code == 200:
                result["accepted"] = True
                data = answer.json()
                result["text"], result["tokens"] = (
                    data["choices"][0]["text"],
                    data["usage"]["completion_tokens"],
                )
            else:
                result["error"] = answer.text[:200]
            return result
        body = {**body, "stream_options": {"include_usage": True}}
        with client.stream("POST", url + "/completions", json=body, timeout=timeout) as answer:
            result["status"] = answer.status_code
            if answer.status_code != 200:
                answer.read()
                result["error"] = answer.text[:200]
                return result
            result["accepted"] = True
            last, done = None, False
            for line in answer.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result["error"] = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            result["ttft"] = now - started
                        else:
                            result["itl"].append(now - last)
                        last = now
                        result["text"] += choice["text"]
            if not done:
                result["error"] = "the stream ended without data: [DONE]"
    except httpx.HTTPError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def percentile(values, q: float):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def resources(pid: int) -> dict:
    """The server's resident memory (MiB), open file descriptors, threads and child processes."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "children": len(children(pid)),
    }


def fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


if __name__ == "__main__":  # shared code, not a benchmark of its own: say so and what runs it
    import argparse

    argparse.ArgumentParser(
        description=__doc__ + "\nNot a benchmark by itself: run serve_load.py or serve_soak.py."
    ).parse_args()
    raise SystemExit("serve_common.py is shared by serve_load.py and serve_soak.py: run one of those")
