"""``saguaro generate``: complete one prompt with a compiled (or ``--program``-loaded) pair, printing the
completion as each round decides it (``program.stream``), then a stats line."""

from __future__ import annotations

import sys

from saguaro.cli.args import add_model_args, add_plan_arg, sd_when_faster
from saguaro.cli.program import add_program_arg, check_program_args, load_program
from saguaro.cli.registry import Subcommand
from saguaro.core.config import MODES
from saguaro.core.errors import SaguaroError
from saguaro.runtime.base.stats import RAN_AS_SD


def add_arguments(gen) -> None:
    gen.add_argument("--prompt", required=True, help="text to complete")
    gen.add_argument("--mode", default="sd", choices=list(MODES),
                     help="ar: target alone; sd: speculative decoding; ssd: speculative speculative decoding "
                          "(default sd)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--trace", metavar="FILE", default=None,
                     help="write a timeline of the call here (Chrome trace-event JSON: open it in "
                          "https://ui.perfetto.dev or chrome://tracing)")
    add_plan_arg(gen)
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
        program = saguaro_compile(target, draft, k=args.k, mode=args.mode, backend=args.backend,
                                  sd_when_faster=sd_when_faster(args))
    if not sd_when_faster(args) and args.program is not None:
        program = program.reconfigure(sd_when_faster=False)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with program.stream(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                        trace=args.trace) as stream:
        print_as_decided(tokenizer, args.prompt, stream)
    sys.stdout.write(stats_line(stream.output.stats) + "\n")
    if args.trace:
        sys.stdout.write(f"wrote the timeline to {args.trace} (open it in https://ui.perfetto.dev)\n")
    return 0


def print_as_decided(tokenizer, prompt: str, stream) -> None:
    """Write the prompt, then the completion as each round of ``stream`` decides it (flushed per round),
    and a newline. A round's text is written once it decodes to an extension of what is on the screen
    (a trailing incomplete character waits for the next round); a tokenizer that rewrites earlier text
    gets the whole completion written again on a line of its own at the end."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    tokens, shown = [], ""
    for chunk in stream:
        tokens += chunk.new_tokens[0]
        text = tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(shown) and len(text) > len(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    final = tokenizer.decode(tokens, skip_special_tokens=True)
    sys.stdout.write((final[len(shown):] if final.startswith(shown) else "\n" + prompt + final) + "\n")
    sys.stdout.flush()


def stats_line(s: dict) -> str:
    """``[mode] N tokens in ...``; ``[ssd, ran as SD: no tree pays here] ...`` where the planner ran SD."""
    label = f"{s['mode']}, {RAN_AS_SD}" if s.get("planned_sd") else s["mode"]
    hits = f", cache hit rate {s['cache_hit_rate']:.2f}" if "cache_hit_rate" in s else ""
    return (f"[{label}] {s['new_tokens']} tokens in {s['wall_s']:.2f}s: {s['tokens_per_s']:.1f} tokens/s, "
            f"mean accepted length {s['mean_accepted_len']:.2f}, {s['rounds']} rounds{hits}")


COMMAND = Subcommand("generate", "complete a prompt and print the completion and a stats line", add_arguments, run)
