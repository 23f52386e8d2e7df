"""What weight-only quantization costs in quality: the default pair's target's perplexity on held-out text (the
Python standard library files it never trained on), as loaded, in bfloat16, and with int8 / int4 weights.

    python benchmarks/parts/quantized_perplexity.py --snippets 64 --json perplexity.json

The quantized rows compute what Saguaro's quantized stages compute: every linear's weight (the LM head included)
replaced by its dequantized value (``saguaro.tensor_math.quantized_linear``: ``float(q) * scale``, int8 one scale
per output column, int4 one per ``--group`` ``k``), the arithmetic in float32. Prints a table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch


def quantized_copy(model, bits: int, group: int | None):
    from saguaro.tensor_math.quantized_linear import dequantize, quantize

    copied = copy.deepcopy(model)
    with torch.no_grad():
        for module in copied.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize(*quantize(module.weight, bits, group)))
    return copied


@torch.no_grad()
def perplexity(model, texts: list[str], tokenizer) -> tuple[float, int]:
    """``(exp(mean next-token NLL), tokens scored)`` over ``texts``, each scored on its own, cut to the model's
    positions."""
    total, count = 0.0, 0
    positions = model.config.max_position_embeddings
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :positions]  # [1, T]
        if ids.shape[1] < 2:
            continue
        logits = model(ids).logits[0, :-1].float()  # [T-1, V]
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count), count


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snippets", type=int, default=64, help="held-out snippets to score (default 64)")
    p.add_argument("--group", type=int, default=64, help="k per int4 scale (default 64, the library's)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    import saguaro
    from saguaro.default_pair import heldout_snippets

    target, _, tokenizer = saguaro.default_pair()
    texts = [s.text for s in heldout_snippets(args.snippets, max_lines=40, max_chars=2000)]
    rows = []
    for label, model in (
        ("as loaded (float16 values)", target),
        ("bfloat16", copy.deepcopy(target).bfloat16()),
        ("int8", quantized_copy(target, 8, None)),
        (f"int4 (group {args.group})", quantized_copy(target, 4, args.group)),
    ):
        value, count = perplexity(model.eval(), texts, tokenizer)
        rows.append({"weights": label, "perplexity": value, "tokens": count})
    base = rows[0]["perplexity"]
    print(f"{'weights':<28}{'perplexity':>12}{'vs as loaded':>14}")
    for row in rows:
        print(f"{row['weights']:<28}{row['perplexity']:>12.3f}{row['perplexity'] / base:>13.3f}x")
    print(f"{rows[0]['tokens']} tokens of {len(texts)} held-out snippets")
    if args.json:
        Path(args.json).write_text(json.dumps({"snippets": len(texts), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
