"""``saguaro generate``: complete one prompt with a compiled (or ``--program``-loaded) pair and print the
completion and a stats line."""

from __future__ import annotations

import sys

from saguaro.cli.args import add_model_args
from saguaro.cli.program import add_program_arg, check_program_args, load_program
from saguaro.cli.registry import Subcommand
from saguaro.core.config import MODES
from saguaro.core.errors import SaguaroError


def add_arguments(gen) -> None:
    gen.add_argument("--prompt", required=True, help="text to complete")
    gen.add_argument("--mode", default="sd", choices=list(MODES),
                     help="ar: target alone; sd: speculative decoding; ssd: speculative speculative decoding "
                          "(default sd)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--trace", metavar="FILE", default=None,
                     help="write a timeline of the call here (Chrome trace-event JSON: open it in "
                          "https://ui.perfetto.dev or chrome://tracing)")
    add_model_args(gen)
    add_program_arg(gen)


def run(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text to complete")
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    check_program_args(args)
    if args.program is not None:
        program, tokenizer = load_program(args)
        if tokenizer is None:
            raise SaguaroError(f"no tokenizer in the exported program {args.program!r}; generate needs one to read "
                               "--prompt (export with a tokenizer beside the target)")
    else:
        target, draft, tokenizer = load_pair(args.target, args.draft, need_draft=args.mode != "ar",
                                             dtype=DTYPES[args.dtype], device=args.device)
        if tokenizer is None:
            raise SaguaroError(f"no tokenizer beside the target in {args.target!r}; generate needs one to read "
                               "--prompt")
        if args.mode == "ar":
            draft = None  # AR never runs the draft: do not capture it
        program = saguaro_compile(target, draft, k=args.k, mode=args.mode, backend=args.backend)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = program.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                           trace=args.trace)
    completion = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    s = out.stats
    sys.stdout.write(args.prompt + completion + "\n")
    hits = f", cache hit rate {s['cache_hit_rate']:.2f}" if "cache_hit_rate" in s else ""
    sys.stdout.write(
        f"[{s['mode']}] {s['new_tokens']} tokens in {s['wall_s']:.2f}s: {s['tokens_per_s']:.1f} tokens/s, "
        f"mean accepted length {s['mean_accepted_len']:.2f}, {s['rounds']} rounds{hits}\n")
    if args.trace:
        sys.stdout.write(f"wrote the timeline to {args.trace} (open it in https://ui.perfetto.dev)\n")
    return 0


COMMAND = Subcommand("generate", "complete a prompt and print the completion and a stats line", add_arguments, run)
