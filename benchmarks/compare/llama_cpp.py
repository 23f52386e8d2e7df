"""Saguaro against llama.cpp on this CPU, from your own llama.cpp build and GGUF files of the pair.

    python benchmarks/compare/llama_cpp.py --llama-cpp ~/llama.cpp/build \\
        --target-gguf target-f32.gguf --draft-gguf draft-f32.gguf --threads 1,2 --json llama_cpp.json

Rows, at each thread count (tokens/s; the median of ``--repeats`` passes, a pass being every prompt once;
every row's passes alternate, llama.cpp's and Saguaro's, each Saguaro row warm in a process of its own,
as ``saguaro bench`` runs them):

- ``llama.cpp ar``: ``llama-completion`` per prompt, greedy, ``--ignore-eos``; tokens/s from its ``eval
  time`` line (the generated tokens only, prompt processing excluded, as ``llama-bench``'s tg).
- ``llama.cpp sd``: ``llama-speculative`` per prompt drafting K tokens (``--spec-draft-n-max K``, or
  ``--draft-max K`` in builds older than that flag); its ``decoded N tokens in
  S seconds`` line (drafting and verification after the prompt).
- ``saguaro ar`` / ``saguaro sd``: ``saguaro bench``'s rows (its worker processes) on the same prompts,
  ``--k K``; tokens/s after the prefill (``decode_tokens_per_s``: the tokens after the prefill's first over
  the seconds after the prefill, as llama.cpp's lines count), the rate with the prefill in the last column.
  Their float32 weights whose values are float16 values (the default pair's) are held as float16 in the
  one-row stages (``SaguaroConfig.narrow_weights``: float32 arithmetic, equal up to rounding order);
  ``--narrow-weights both`` adds each Saguaro row with every weight as loaded (``saguaro ar f32 weights``),
  ``off`` runs only those.
  ``--dtype`` casts the pair for these rows (``bfloat16`` beside f16 GGUF files: both halve the weights'
  bytes; greedy text then need not equal float32's, see the README on reduced precision).

The prompts are ``saguaro bench``'s (held-out snippets of the default pair), written as text files that
llama.cpp reads with ``-f``. Without a build (no ``--llama-cpp``, or its binaries not found) the script
says why, writes the reason to ``--json`` and exits 0: the benchmark is optional. Flags that differ
between llama.cpp versions can be added with ``--completion-args`` and ``--speculative-args``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMPLETION, SPECULATIVE = "llama-completion", "llama-speculative"
EVAL_LINE = re.compile(r"(?<!prompt )eval time\s*=\s*([\d.]+) ms\s*/\s*(\d+) (?:runs|tokens)")
DECODED_LINE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp build folder (holding bin/llama-completion)")
    p.add_argument(
        "--target-gguf", metavar="FILE", help="the target as GGUF (float32 for an exact comparison)"
    )
    p.add_argument("--draft-gguf", metavar="FILE", help="the draft as GGUF")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--prompts", type=int, default=4, help="saguaro bench's first N prompts (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--k", type=int, default=5, help="speculation length of both (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="passes per row (default 3)")
    p.add_argument(
        "--saguaro-modes", default="ar,sd", help="Saguaro rows to run, '' for none (default ar,sd)"
    )
    p.add_argument(
        "--linears", default="auto", help="SaguaroConfig.linears of the Saguaro rows (default auto)"
    )
    p.add_argument(
        "--narrow-weights",
        default="on",
        choices=["on", "off", "both"],
        help="SaguaroConfig.narrow_weights of the Saguaro rows: on (the default), off, or both: each "
        "Saguaro row twice, the second labelled 'f32 weights' (every weight as loaded)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype of the Saguaro rows (default float32; give GGUF files of the matching "
        "precision, e.g. f16 ones beside bfloat16)",
    )
    p.add_argument(
        "--target",
        metavar="DIR",
        help="the Saguaro rows' target folder (the GGUF files' source; default: the default pair)",
    )
    p.add_argument("--draft", metavar="DIR", help="the Saguaro rows' draft folder")
    p.add_argument(
        "--weights",
        default="as-loaded",
        choices=["as-loaded", "int8", "int4"],
        help="SaguaroConfig.weights of the Saguaro rows (give q8_0 / q4_0 GGUF files beside int8 / int4)",
    )
    p.add_argument("--completion-args", default="", help="more arguments for llama-completion")
    p.add_argument("--speculative-args", default="", help="more arguments for llama-speculative")
    p.add_argument("--json", metavar="PATH", help="write the table here as JSON")
    return p.parse_args(argv)


def find_binaries(folder: str | None) -> tuple[dict | None, str]:
    """``({name: path}, "")``, or ``(None, why)`` when the build is not given or lacks a binary."""
    if not folder:
        return None, "no llama.cpp build given (--llama-cpp DIR, the folder holding bin/llama-completion)"
    found = {}
    for name in (COMPLETION, SPECULATIVE):
        path = next((c for c in (Path(folder) / "bin" / name, Path(folder) / name) if c.is_file()), None)
        if path is None or not os.access(path, os.X_OK):
            return None, f"{name} not found in {folder} or {folder}/bin"
        found[name] = str(path)
    return found, ""


def eval_speed(output: str) -> tuple[int, float]:
    """``(tokens, seconds)`` from llama-completion's ``eval time = X ms / N runs`` line."""
    match = EVAL_LINE.search(output)
    if match is None:
        raise ValueError(f"no 'eval time' line in llama-completion's output: {output[-500:]!r}")
    return int(match.group(2)), float(match.group(1)) / 1000.0


def decoded_speed(output: str) -> tuple[int, float]:
    """``(tokens, seconds)`` from llama-speculative's ``decoded N tokens in S seconds`` line."""
    match = DECODED_LINE.search(output)
    if match is None:
        raise ValueError(f"no 'decoded N tokens' line in llama-speculative's output: {output[-500:]!r}")
    return int(match.group(1)), float(match.group(2))


ATTEMPTS = 3  # a llama.cpp run here now and then exits 0 before its report lines: run that prompt again


def llama_cpp_pass(binary: str, args: list, prompt_files: list, parse) -> float:
    """One pass over the prompts: generated tokens / seconds, summed over prompts."""
    tokens = seconds = 0.0
    for prompt in prompt_files:
        for attempt in range(1, ATTEMPTS + 1):
            done = subprocess.run(
                [binary, *args, "-f", prompt],
                capture_output=True,
                text=True,
                timeout=600,
                stdin=subprocess.DEVNULL,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{Path(binary).name} exited {done.returncode}: {done.stderr[-800:]}")
            try:
                n, s = parse(done.stdout + done.stderr)
                break
            except ValueError as exc:
                if attempt == ATTEMPTS:
                    raise
                print(
                    f"llama_cpp.py: {Path(binary).name} on {Path(prompt).name} gave no report "
                    f"({str(exc)[:60]}...); running it again",
                    flush=True,
                )
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


def draft_max_flag(speculative: str) -> str:
    """llama-speculative's flag for the number of tokens drafted: ``--spec-draft-n-max`` in builds that have it
    (``--draft-max`` was removed from them), ``--draft-max`` in older ones."""
    done = subprocess.run([speculative, "--help"], capture_output=True, text=True, timeout=60)
    return "--spec-draft-n-max" if "--spec-draft-n-max" in done.stdout + done.stderr else "--draft-max"


def llama_cpp_runs(binaries: dict, args, threads: int) -> dict:
    """``{row label: (binary, arguments, report parser)}`` of the two llama.cpp rows."""
    common = [
        "-n",
        str(args.max_new_tokens),
        "-t",
        str(threads),
        "--temp",
        "0",
        "--top-k",
        "1",
        "--ignore-eos",
    ]
    return {
        "llama.cpp ar": (
            binaries[COMPLETION],
            ["-m", args.target_gguf, *common, *shlex.split(args.completion_args)],
            eval_speed,
        ),
        "llama.cpp sd": (
            binaries[SPECULATIVE],
            [
                "-m",
                args.target_gguf,
                "-md",
                args.draft_gguf,
                "-td",
                str(threads),
                draft_max_flag(binaries[SPECULATIVE]),
                str(args.k),
                *common,
                *shlex.split(args.speculative_args),
            ],
            decoded_speed,
        ),
    }


def start_saguaro_rows(args, threads: int) -> dict:
    """``{row label: row}``: a ``saguaro bench`` row per Saguaro mode, each loaded, compiled and warmed up
    in a process of its own (``saguaro.bench.worker``), the same prompts, ``--k``, threads and tokens."""
    from saguaro.bench.run import start_row
    from saguaro.bench.worker import BenchParams

    modes = tuple(m for m in args.saguaro_modes.split(",") if m)
    narrow = {"on": (True,), "off": (False,), "both": (True, False)}[args.narrow_weights]
    rows = {}
    try:
        for narrow_weights in narrow:
            params = BenchParams(
                target=args.target,
                draft=args.draft,
                modes=modes,
                prompts=args.prompts,
                k=args.k,
                max_new_tokens=args.max_new_tokens,
                threads=threads,
                repeats=args.repeats,
                linears=args.linears,
                dtype=args.dtype,
                narrow_weights=narrow_weights,
                weights=args.weights,
            )
            suffix = "" if narrow_weights or args.narrow_weights == "off" else " f32 weights"
            for mode in modes:
                rows[f"saguaro {mode}{suffix}"] = start_row(params, mode, "inductor")
    except BaseException:
        for started in rows.values():
            started.close()
        raise
    return rows


def interleaved_rows(binaries: dict, args, threads: int, prompt_files: list) -> list:
    """Every row's timed passes alternate: llama.cpp AR, llama.cpp SD, then each Saguaro row's, ``--repeats``
    rounds; medians per row. A Saguaro pass counts its tokens after each prefill (as llama.cpp's lines do);
    the rate with the prefill rides along."""
    runs = llama_cpp_runs(binaries, args, threads)
    saguaro = start_saguaro_rows(args, threads)
    passes = {label: [] for label in [*runs, *saguaro]}
    with_prefill = {label: [] for label in saguaro}
    try:
        for _ in range(args.repeats):
            for label, (binary, run_args, parse) in runs.items():
                passes[label].append(llama_cpp_pass(binary, run_args, prompt_files, parse))
            for label, started in saguaro.items():
                timed = started.time_pass()
                passes[label].append(timed["decode_tokens_per_s"])
                with_prefill[label].append(timed["tokens_per_s"])
    finally:
        for started in saguaro.values():
            started.close()
    return [
        row(label, threads, speeds)
        | (
            {"with_prefill_tokens_per_s": statistics.median(with_prefill[label])}
            if label in with_prefill
            else {}
        )
        for label, speeds in passes.items()
    ]


def row(label: str, threads: int, speeds: list) -> dict:
    median = statistics.median(speeds)
    spread = 100.0 * (max(speeds) - min(speeds)) / median if len(speeds) > 1 else None
    return dict(row=label, threads=threads, tokens_per_s=median, passes=speeds, spread_pct=spread)


def write_prompts(
    count: int,
    max_new_tokens: int,
    workdir: Path,
    target_dir: str | None = None,
    draft_dir: str | None = None,
) -> list:
    """``saguaro bench``'s first ``count`` prompts (for the pair in ``target_dir`` / ``draft_dir``, default the
    default pair) as text files."""
    from saguaro.bench.worker import BenchParams, run_prompts
    from saguaro.models_io import load_pair

    target, _, tokenizer = load_pair(target_dir, draft_dir, need_draft=False, device="cpu")
    prompts = run_prompts(
        BenchParams(target=target_dir, draft=draft_dir, prompts=count, max_new_tokens=max_new_tokens),
        tokenizer,
        target,
    )
    files = []
    for i, ids in enumerate(prompts.ids):
        path = workdir / f"prompt_{i}.txt"
        # without the BOS text: llama.cpp adds its own BOS, so both read the same tokens
        path.write_text(tokenizer.decode(ids[0], skip_special_tokens=True))
        files.append(str(path))
    return files


def format_rows(rows: list) -> str:
    lines = [f"{'row':<24}{'threads':>8}{'tokens/s':>10}{'spread':>9}{'with prefill':>14}"]
    for r in rows:
        spread = "-" if r["spread_pct"] is None else f"{r['spread_pct']:.1f}%"
        prefill = r.get("with_prefill_tokens_per_s")
        prefill = "-" if prefill is None else f"{prefill:.1f}"
        lines.append(f"{r['row']:<24}{r['threads']:>8}{r['tokens_per_s']:>10.1f}{spread:>9}{prefill:>14}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    binaries, why = find_binaries(args.llama_cpp)
    if binaries is None or not (args.target_gguf and args.draft_gguf):
        why = why or "--target-gguf and --draft-gguf are both needed"
        print(f"llama_cpp.py: skipped: {why}")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": why}, indent=2))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="saguaro-llama-cpp-") as tmp:
        workdir = Path(tmp)
        prompt_files = write_prompts(args.prompts, args.max_new_tokens, workdir, args.target, args.draft)
        for threads in (int(t) for t in args.threads.split(",")):
            rows += interleaved_rows(binaries, args, threads, prompt_files)
            print(format_rows(rows), flush=True)
    report = {"config": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
