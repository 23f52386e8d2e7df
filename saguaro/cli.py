"""Command line: ``saguaro generate`` and ``saguaro bench``.

Bad arguments exit with status 2 and a message naming the value: argparse rejects malformed values
before any model is loaded, and ``main`` turns a ``ValueError`` / ``SaguaroError`` raised later
(a missing folder, a model that will not load, the default pair not built) into the same status.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from contextlib import contextmanager

from saguaro.config import MAX_K, MODES
from saguaro.errors import SaguaroError


def int_at_least(low: int, name: str, high: int | None = None):
    """An argparse ``type`` accepting ints in ``low..high``; the error names the value and the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < low or (high is not None and value > high):
            allowed = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{name}={value} is not allowed: it must be an int {allowed}")
        return value
    return parse


def temperature_arg(text: str) -> float:
    """An argparse ``type``: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"temperature={text} is not allowed: it must be a finite number >= 0")
    return value


def _add_model_args(parser, backends=("eager", "inductor")):
    parser.add_argument("--target", metavar="DIR", help="saved target model folder (default: the default pair)")
    parser.add_argument("--draft", metavar="DIR", help="saved draft model folder (default: the default pair)")
    parser.add_argument("--k", type=int_at_least(1, "k", MAX_K), default=5,
                        help=f"speculation length, 1..{MAX_K} (default 5)")
    parser.add_argument("--max-new-tokens", type=int_at_least(1, "max_new_tokens"), default=64,
                        help="tokens to generate per prompt (default 64)")
    parser.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 for greedy (default 0)")
    parser.add_argument("--backend", default="eager", choices=list(backends),
                        help="lowering backend (default eager)" + ("; both: eager and inductor rows in one run"
                                                                   if "both" in backends else ""))
    parser.add_argument("--device", default="cpu", help="where both models run: cpu, cuda, cuda:1, ... "
                        "(default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights dtype of both models (default float32)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro", description="Speculative speculative decoding for HF causal LMs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (capture, compile)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt and print the completion and a stats line")
    gen.add_argument("--prompt", required=True, help="text to complete")
    gen.add_argument("--mode", default="sd", choices=list(MODES),
                     help="ar: target alone; sd: speculative decoding; ssd: speculative speculative decoding "
                          "(default sd)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    _add_model_args(gen)
    bench = sub.add_parser("bench", help="AR, SD, SSD and transformers (assisted) generation over the same prompts: "
                                               "a table and JSON")
    from saguaro.bench import add_bench_args

    add_bench_args(bench)
    _add_model_args(bench, backends=("eager", "inductor", "both"))
    return parser


def cmd_generate(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text to complete")
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    target, draft, tokenizer = load_pair(args.target, args.draft, need_draft=args.mode != "ar",
                                         dtype=DTYPES[args.dtype], device=args.device)
    if tokenizer is None:
        raise SaguaroError(f"no tokenizer beside the target in {args.target!r}; generate needs one to read --prompt")
    if args.mode == "ar":
        draft = None  # AR never runs the draft: do not capture it
    program = saguaro_compile(target, draft, k=args.k, mode=args.mode, backend=args.backend)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = program.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    completion = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    s = out.stats
    sys.stdout.write(args.prompt + completion + "\n")
    hits = f", cache hit rate {s['cache_hit_rate']:.2f}" if "cache_hit_rate" in s else ""
    sys.stdout.write(
        f"[{s['mode']}] {s['new_tokens']} tokens in {s['wall_s']:.2f}s: {s['tokens_per_s']:.1f} tokens/s, "
        f"mean accepted length {s['mean_accepted_len']:.2f}, {s['rounds']} rounds{hits}\n")
    return 0


@contextmanager
def _quiet_transformers(quiet: bool):
    """Hide transformers' weight-loading progress bars and warnings (shown with -v); restore them after,
    since ``main`` may run inside another program (the tests, a notebook)."""
    from transformers.utils import logging as hf_logging

    if not quiet:
        yield
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        with _quiet_transformers(not args.verbose):
            if args.command == "generate":
                return cmd_generate(args)
            from saguaro.bench import cmd_bench

            return cmd_bench(args)
    except (SaguaroError, ValueError) as exc:
        sys.stderr.write(f"saguaro: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
