"""What the server's scheduler could reach, without HTTP: tokens/s of AR and SD in one ``BatchSession`` of
``--rows`` rows on the default pair, greedy and sampled (temperature 0.7 with ``top_p`` 0.9, as the sampled load
table sends), in this process. SD twice: ``sd`` with the session's measured speculation length (its default,
``runtime/speculation_length.py``), ``sd-fixed`` at ``--k`` every round.

    python benchmarks/parts/batch_session_rates.py [--backend inductor] [--rows 1,16] [--reps 3] [--json F]

Each case joins its rows (prompts of several lengths, ``--max-new-tokens`` each; sampled rows unseeded, as the
load table sends them, from torch's generator seeded once), then steps the session until
every row ended; tokens/s is the rows' new tokens over the stepping's wall time (the joins' prefills excluded),
with the mean tokens a row gains a round and, for ``sd``, the ks its rounds ran (most run first). Every case runs
once untimed first (its shapes compiled), then the cases alternate by repetition; the table shows each case's
median, SD's beside its AR's.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import statistics
import time

import torch

import saguaro
from saguaro import SamplingControls
from saguaro.runtime.batching import BatchSession

log = logging.getLogger("batch_session_rates")

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:",
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main(argv):\n   ",
    "class Stack:\n    def push(self, item):\n       ",
]
KINDS = {"greedy": (0.0, None), "sampled": (0.7, {"top_p": 0.9})}  # temperature, controls
MODES = ("ar", "sd", "sd-fixed")  # sd-fixed: BatchSession(k_choice="fixed")


def cases(rows: list) -> list:
    """``(mode, kind, rows)`` of every case, each AR case before its SD cases."""
    return [(mode, kind, n) for kind in KINDS for n in rows for mode in MODES]


def run_case(program, prompt_ids: list, mode: str, kind: str, rows: int, max_new_tokens: int) -> dict:
    """One session of ``rows`` rows stepped to its end: ``{"tokens_per_s", "per_round", "ks"}`` (``per_round``:
    tokens a row gains a round, over the rounds each row took part in; ``ks``: ``{k: rounds}`` of SD's)."""
    temperature, controls = KINDS[kind]
    session = BatchSession(
        program,
        temperature,
        "sd" if mode == "sd-fixed" else mode,
        controls=SamplingControls.of(**controls) if controls else None,
        k_choice="fixed" if mode == "sd-fixed" else "measured",
    )
    for row in range(rows):
        session.join(prompt_ids[row % len(prompt_ids)], max_new_tokens)  # unseeded, as the load table's
    tokens = row_rounds = 0
    started = time.perf_counter()
    while session.size:
        row_rounds += session.size  # the rows this round decides for
        tokens += sum(len(out.new_tokens) for out in session.step())
    seconds = time.perf_counter() - started
    return {"tokens_per_s": tokens / seconds, "per_round": tokens / row_rounds, "ks": dict(session.ks_run)}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["eager", "inductor"])
    parser.add_argument("--rows", default="1,16", help="rows a session, comma-separated (default 1,16)")
    parser.add_argument("--reps", type=int, default=3, help="timed passes a case (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens a row (default 64)")
    parser.add_argument("--k", type=int, default=5, help="speculation length (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch._dynamo.config.recompile_limit = 64  # a session's batch shrinks row by row: each size may compile
    torch.manual_seed(0)  # the unseeded rows' generators are drawn from it
    target, draft, tokenizer = saguaro.default_pair()
    program = saguaro.compile(target, draft, k=args.k, mode="sd", backend=args.backend)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    todo = cases([int(n) for n in args.rows.split(",")])
    for case in todo:
        log.info("warming up %s %s, %d row(s) ...", *case)
        run_case(program, prompt_ids, *case, args.max_new_tokens)
    passes: dict = {case: [] for case in todo}
    for rep in range(args.reps):
        for case in todo:
            passes[case].append(run_case(program, prompt_ids, *case, args.max_new_tokens))
        log.info("pass %d of %d done", rep + 1, args.reps)
    rows = []
    for mode, kind, n in todo:
        rates = [p["tokens_per_s"] for p in passes[(mode, kind, n)]]
        per_round = statistics.median(p["per_round"] for p in passes[(mode, kind, n)])
        ks = sum((collections.Counter(p["ks"]) for p in passes[(mode, kind, n)]), collections.Counter())
        rows.append(
            {
                "mode": mode,
                "kind": kind,
                "rows": n,
                "tokens_per_s": statistics.median(rates),
                "passes": rates,
                "tokens_a_row_a_round": per_round,
                "ks": {str(k): count for k, count in ks.most_common()},
            }
        )
    ar = {(r["kind"], r["rows"]): r["tokens_per_s"] for r in rows if r["mode"] == "ar"}
    lines = [f"{'mode':<9}{'kind':<9}{'rows':>5}{'tokens/s':>10}{'vs AR':>8}{'tokens/row/round':>18}  ks run"]
    for r in rows:
        ratio = r["tokens_per_s"] / ar[(r["kind"], r["rows"])]
        r["vs_ar"] = ratio
        lines.append(
            f"{r['mode']:<9}{r['kind']:<9}{r['rows']:>5}{r['tokens_per_s']:>10.1f}{ratio:>7.2f}x"
            f"{r['tokens_a_row_a_round']:>18.2f}  {' '.join(f'{k}:{c}' for k, c in r['ks'].items())}"
        )
    log.info("\n%s", "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "backend": args.backend,
                    "k": args.k,
                    "max_new_tokens": args.max_new_tokens,
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
