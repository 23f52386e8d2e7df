"""Does speculation still pay under a grammar? Tokens/s of AR and SD (mode ``ssd`` runs SD's rounds under a
grammar) on the default pair, with and without a JSON schema, greedy and sampled (temperature 0.7, top_p 0.9).

    python benchmarks/parts/grammar_speculation.py [--backend inductor] [--reps 3] [--max-new-tokens 96] [--json F]

Each row decodes the same prompts (code that goes on to a JSON literal) ``--reps`` times after an untimed call
per prompt that compiles its stages at that shape; rows alternate by repetition, so a loaded machine's drift falls on all of them. Tokens/s
is new tokens over wall time (the grammar's host work, masks on the target's verification and the draft's steps,
included), with the mean accepted length (tokens decided per round). The JSON rows end when the document ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import saguaro
from saguaro import Grammar

PROMPTS = [
    "import json\n\n\ndef load_user():\n    return json.loads('",
    "SETTINGS = json.loads('",
    'def test_payload():\n    payload = json.loads("""',
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "active": {"type": "boolean"},
        "path": {"type": "string", "maxLength": 60},
    },
    "required": ["name", "id", "tags", "active", "path"],
    "additionalProperties": False,
}
SAMPLED = {"temperature": 0.7, "seed": 0}


def rows(grammar) -> list:
    """``(name, mode, temperature options, controls)`` of each row."""
    out = []
    for kind, sampling, filters in (("greedy", {}, {}), ("sampled", SAMPLED, {"top_p": 0.9})):
        for constrained in (False, True):
            controls = {**filters, **({"grammar": grammar} if constrained else {})} or None
            for mode in ("ar", "sd"):
                name = f"{mode} {kind}{' +schema' if constrained else ''}"
                out.append((name, mode, sampling, controls))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["eager", "inductor"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    target, draft, tokenizer = saguaro.default_pair()
    program = saguaro.compile(target, draft, k=args.k, mode="sd", backend=args.backend)
    grammar = Grammar.json_schema(SCHEMA, tokenizer, target.config.vocab_size)
    prompts = [torch.tensor([tokenizer(p).input_ids]) for p in PROMPTS]
    table = rows(grammar)
    seconds = {name: 0.0 for name, *_ in table}
    tokens = {name: 0 for name, *_ in table}
    accepted = {name: [] for name, *_ in table}
    texts = {}

    def run(name, mode, sampling, controls, prompt):
        out = program.generate(
            prompt, max_new_tokens=args.max_new_tokens, mode=mode, controls=controls, **sampling
        )
        new = out.sequences[0, prompt.shape[1] :].tolist()
        eos = program.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        count = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        return out, new[:count]

    for row in table:  # compiles each row's stages at each prompt's shape
        for prompt in prompts:
            run(*row, prompt)
    for _ in range(args.reps):
        for name, mode, sampling, controls in table:
            for prompt in prompts:
                started = time.perf_counter()
                out, new = run(name, mode, sampling, controls, prompt)
                seconds[name] += time.perf_counter() - started
                tokens[name] += len(new)
                if mode != "ar":
                    accepted[name].append(out.stats["mean_accepted_len"])
                texts.setdefault(name, tokenizer.decode(new, skip_special_tokens=True))
    results = []
    print(f"{'row':22} {'tok/s':>7} {'tokens':>7} {'accepted':>9}  SD/AR")
    for name, mode, *_ in table:
        rate = tokens[name] / seconds[name]
        base = name.replace("sd ", "ar ", 1)
        ratio = rate / (tokens[base] / seconds[base]) if mode == "sd" else None
        mean = statistics.mean(accepted[name]) if accepted[name] else 1.0
        print(
            f"{name:22} {rate:7.1f} {tokens[name]:7d} {mean:9.2f}  {'' if ratio is None else f'{ratio:.2f}'}"
        )
        results.append(
            {"row": name, "tok_s": rate, "tokens": tokens[name], "mean_accepted": mean, "sd_over_ar": ratio}
        )
    for name in ("sd greedy +schema", "sd sampled +schema"):
        print(f"{name}: {texts[name]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "k": args.k, "rows": results, "texts": texts}, f, indent=1)


if __name__ == "__main__":
    main()
