"""Grammar libraries for structured output, side by side on the default pair's tokenizer: xgrammar, llguidance,
outlines-core.

    python benchmarks/parts/grammar_libraries.py [--reps 5] [--k 5] [--json out.json]

For each library and each schema (a flat object, a nested one with arrays and enums, and ``{"type":
"object"}``-free JSON, ``json_object``): the tokenizer set-up once (per server), the schema's compile (cold, per
request), and along a valid document tokenized by the default pair's tokenizer the per-token mask (computed into a
bitmask and turned into a ``[V]`` bool tensor, as the runtime takes it) and accept; then a speculative round's
masks: ``k + 1`` masks along ``k`` draft tokens and the rollback. Medians over ``--reps`` repetitions; one thread
(what the scheduler's thread gets). Prints a table and, with ``--json``, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "day": {"type": "integer", "minimum": 1, "maximum": 31},
                        "high": {"type": "number"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["day", "high"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
    "json_object": None,  # any JSON object
}
DOCUMENTS = {
    "flat": {"name": "Alice Example", "age": 30, "admin": False},
    "nested": {
        "city": "Paris",
        "unit": "celsius",
        "days": [
            {"day": 1, "high": 21.5, "tags": ["sunny", "dry"]},
            {"day": 2, "high": 18.0, "tags": ["rain"]},
            {"day": 3, "high": 19.25, "tags": []},
        ],
    },
    "json_object": {"answer": [1, 2, 3], "note": "anything goes", "ok": True},
}


def bool_mask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """An int32 bitmask ``[W]`` (bit ``i % 32`` of word ``i // 32``) as ``[vocab]`` bool."""
    bits = torch.arange(32, dtype=torch.int32, device="cpu")
    return ((bitmask[:, None] >> bits) & 1).flatten()[:vocab].bool()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m, buffer):
        m.fill_next_token_bitmask(buffer)
        return bool_mask(buffer[0], self.vocab)

    def accept(self, m, token):
        assert m.accept_token(token), token

    def rollback(self, m, n):
        m.rollback(n)

    def buffer(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.vocab = llguidance, vocab
        self.fill = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)  # the grammar's compile runs here
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)

    def mask(self, m, buffer):
        self.fill(m, buffer)
        return bool_mask(buffer[0], self.vocab)

    def accept(self, m, token):
        assert m.consume_token(token), (token, m.get_error())

    def rollback(self, m, n):
        m.rollback(n)

    def buffer(self):
        return torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32, device="cpu")


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab):
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        self.Guide, self.Index, self.regex, self.vocab = Guide, Index, build_regex_from_schema, vocab
        decoder = bytes_of_byte_level()
        tokens: dict = {}
        for text, i in tokenizer.get_vocab().items():
            if i == tokenizer.eos_token_id or i in tokenizer.all_special_ids:
                continue
            tokens.setdefault(bytes(decoder[c] for c in text), []).append(i)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, schema):
        schema = schema if schema is not None else {"type": "object"}
        return self.Index(self.regex(json.dumps(schema), whitespace_pattern=r"[ ]?"), self.vocabulary)

    def matcher(self, compiled):
        return self.Guide(compiled)

    def mask(self, m, buffer):
        m.write_mask_into(buffer.data_ptr(), buffer.numel(), buffer.element_size())
        return bool_mask(buffer[0], self.vocab)

    def accept(self, m, token):
        m.advance(token)

    def rollback(self, m, n):
        m.rollback_state(n)

    def buffer(self):
        return torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32, device="cpu")


def bytes_of_byte_level() -> dict:
    """GPT-2's byte-level alphabet: each of its 256 characters to the byte it stands for."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    kept += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def measure(lib_cls, tokenizer, vocab, reps, k):
    lib, setup_s = timed(lib_cls, tokenizer, vocab)
    rows = []
    for schema_name, schema in SCHEMAS.items():
        doc = json.dumps(DOCUMENTS[schema_name], separators=(", ", ": "))
        tokens = tokenizer(doc, add_special_tokens=False).input_ids
        compile_s, mask_us, accept_us, round_us, allowed = [], [], [], [], []
        for _ in range(reps):
            compiled, seconds = timed(lib.compile, schema)
            compile_s.append(seconds)
            m, buffer = lib.matcher(compiled), lib.buffer()
            masks, accepts = [], []
            for t in tokens:
                mask, seconds = timed(lib.mask, m, buffer)
                masks.append(seconds)
                assert mask[t], (lib.name, schema_name, t)
                allowed.append(int(mask.sum()))
                _, seconds = timed(lib.accept, m, t)
                accepts.append(seconds)
            mask_us.append(1e6 * statistics.median(masks))
            accept_us.append(1e6 * statistics.median(accepts))
            # a speculative round: from each position, k+1 masks along the next k tokens, then roll them back
            m = lib.matcher(compiled)
            rounds = []
            for start in range(0, len(tokens) - k, k):
                began = time.perf_counter()
                for t in tokens[start : start + k]:
                    lib.mask(m, buffer)
                    lib.accept(m, t)
                lib.mask(m, buffer)
                lib.rollback(m, k)
                rounds.append(time.perf_counter() - began)
                for t in tokens[start : start + k]:  # commit the round's tokens
                    lib.accept(m, t)
            round_us.append(1e6 * statistics.median(rounds))
        rows.append(
            {
                "library": lib.name,
                "schema": schema_name,
                "setup_s": setup_s,
                "compile_ms": 1e3 * statistics.median(compile_s),
                "mask_us": statistics.median(mask_us),
                "accept_us": statistics.median(accept_us),
                "round_us": statistics.median(round_us),
                "k": k,
                "doc_tokens": len(tokens),
                "mean_allowed": sum(allowed) / len(allowed),
            }
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--libraries", default="xgrammar,llguidance,outlines-core")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from saguaro.default_pair import ASSETS_DIR

    tokenizer = AutoTokenizer.from_pretrained(ASSETS_DIR / "target")
    vocab = len(tokenizer)
    libs = {c.name: c for c in (XGrammar, LLGuidance, OutlinesCore)}
    rows = []
    for name in args.libraries.split(","):
        rows += measure(libs[name], tokenizer, vocab, args.reps, args.k)
    print(
        f"{'library':14} {'schema':12} {'setup s':>8} {'compile ms':>11} {'mask us':>8} {'accept us':>10} "
        f"{'round us (k=' + str(args.k) + ')':>16} {'allowed':>8}"
    )
    for r in rows:
        print(
            f"{r['library']:14} {r['schema']:12} {r['setup_s']:8.3f} {r['compile_ms']:11.2f} {r['mask_us']:8.1f} "
            f"{r['accept_us']:10.1f} {r['round_us']:16.1f} {r['mean_allowed']:8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": vocab, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
