"""Build a target/draft pair of a real model's shape, offline: seeded random weights, a draft made of the
target's first layer(s), its final norm and its head, and a greedy agreement tuned to a requested value.

    python benchmarks/real_size/make_pair.py --shape tinyllama-1.1b --agreement 0.75 --out pairs/tinyllama
    python benchmarks/real_size/make_pair.py --shape qwen2.5-0.5b --draft-layers 2 --dtype bfloat16 --out pairs/qwen
    python benchmarks/real_size/make_pair.py --target-dir MY_TARGET --out pairs/mine   # your own checkpoint's draft

Writes ``OUT/target`` and ``OUT/draft`` (Hugging Face folders: ``config.json``, ``model.safetensors``, a
byte-level tokenizer whose first 256 tokens are the 256 bytes, so text means the same token ids to every engine)
and ``OUT/pair.json`` (the shape, seed, layers, the scale and the agreement measured). Nothing is downloaded:
the shapes are the published configs' numbers (``SHAPES``), the weights ``transformers``' own initialisation
under ``--seed``.

The draft is the target's first ``--draft-layers`` decoder layers with the target's embedding, final norm and
head, so it agrees with the target where the later layers add little. ``--agreement A`` scales the output
projections (``o_proj``, ``down_proj``) of the target's later layers by one factor, found by bisection, until
the draft's greedy token equals the target's on a fraction ``A`` of the positions of the target's own greedy
continuations of ``saguaro bench``'s prompts (their first 12 bytes) (``--agreement 0`` keeps ``transformers``' initialisation as it is). With
``--target-dir`` the target is your checkpoint, left unchanged, and only the draft is made from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from saguaro.bench.real_size import (  # noqa: F401 - the names this script's users import from it
    BYTES,
    SHAPES,
    agreement,
    bench_prompt_ids,
    byte_tokenizer,
    bytes_to_unicode,
    draft_of,
    later_projections,
    make_config,
    random_target,
    tune,
)

log = logging.getLogger("make_pair")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape", default="tinyllama-1.1b", help=f"one of {', '.join(SHAPES)} (default tinyllama-1.1b)"
    )
    p.add_argument("--target-dir", metavar="DIR", help="your own Hugging Face target; only the draft is made")
    p.add_argument("--draft-layers", type=int, default=1, help="decoder layers of the draft (default 1)")
    p.add_argument("--agreement", type=float, default=0.75, help="greedy agreement to tune to (default 0.75)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", required=True, metavar="DIR")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    if args.target_dir:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=dtype).eval()
        shape = f"own:{args.target_dir}"
    else:
        target, shape = random_target(args.shape, args.seed, dtype), args.shape
    layers = args.draft_layers
    if not 1 <= layers < target.config.num_hidden_layers:
        raise SystemExit(f"--draft-layers {layers} must lie in 1..{target.config.num_hidden_layers - 1}")
    draft = draft_of(target, layers)
    log.info(
        "target %.2fB parameters, draft %.3fB (built in %.0f s)",
        target.num_parameters() / 1e9,
        draft.num_parameters() / 1e9,
        time.perf_counter() - started,
    )
    if args.target_dir or not args.agreement:
        scale, measured = 1.0, None
    else:
        scale, measured = tune(target, draft, layers, args.agreement)
    out = Path(args.out)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.pad_token_id = 0
        model.save_pretrained(out / name)
        if not args.target_dir:
            tokenizer = byte_tokenizer(model.config.vocab_size)
            tokenizer.save_pretrained(out / name)
    if args.target_dir:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.target_dir).save_pretrained(out / "draft")
    record = {
        "shape": shape,
        "seed": args.seed,
        "dtype": args.dtype,
        "draft_layers": layers,
        "later_projection_scale": scale,
        "agreement_wanted": args.agreement,
        "agreement_measured": measured,
        "target_parameters": target.num_parameters(),
        "draft_parameters": draft.num_parameters(),
    }
    (out / "pair.json").write_text(json.dumps(record, indent=2) + "\n")
    log.info("wrote %s (agreement %s, %.0f s)", out, measured, time.perf_counter() - started)


if __name__ == "__main__":
    main()
