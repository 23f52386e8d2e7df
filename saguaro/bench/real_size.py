"""Pairs of a real model's shape, offline: seeded random weights of a published config (:data:`SHAPES`), a
draft of the target's first layer(s) with its embedding, final norm and head, and a byte tokenizer.

Scaling the output projections of the target's later layers sets how often the draft agrees (:func:`tune`
bisects the factor). ``benchmarks/real_size/make_pair.py`` writes such pairs to folders.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# The published configs' shapes (max_position_embeddings capped at 4096: the KV store is sized by it).
SHAPES = {
    "tinyllama-1.1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}
BYTES = 256  # the tokenizer's first ids: one per byte


def make_config(shape: str):
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r} is not known; choose one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    theta = fields.pop("rope_theta")
    config = AutoConfig.for_model(model_type, **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


def random_target(shape: str, seed: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(shape), dtype=torch.float32)
    return model.to(dtype).eval()


def draft_of(target, layers: int):
    """A model of the target's class and config but ``layers`` decoder layers, holding copies of the target's
    first ``layers`` layers, its embedding, final norm and head."""
    import copy

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = type(target)(config).to(next(target.parameters()).dtype).eval()
    state = {
        name: value
        for name, value in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise SystemExit(
            f"the draft does not take the target's weights: missing {missing}, unexpected {unexpected}"
        )
    if config.tie_word_embeddings:
        draft.tie_weights()
    return draft


@torch.no_grad()
def agreement(target, draft, prompts: torch.Tensor, new_tokens: int) -> float:
    """The fraction of positions of the target's greedy continuations of ``prompts`` where the draft's greedy
    token (teacher-forced on the same sequence) equals the target's."""
    sequences = target.generate(
        prompts, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, pad_token_id=0
    )
    start = prompts.shape[1] - 1
    want = sequences[:, start + 1 :]
    got = draft(sequences).logits[:, start:-1].argmax(-1)
    return float((got == want).float().mean())


def later_projections(target, layers: int):
    for index, layer in enumerate(target.model.layers):
        if index >= layers:
            yield layer.self_attn.o_proj.weight
            yield layer.mlp.down_proj.weight


def bench_prompt_ids() -> torch.Tensor:
    """``saguaro bench``'s fixed prompts as the byte tokenizer's ids, their first 12 bytes: ``[8, 12]``."""
    from saguaro.bench.prompts import DEFAULT_PROMPTS

    return torch.tensor(
        [list(text.encode())[:12] for text in DEFAULT_PROMPTS if len(text.encode()) >= 12][:8]
    )


@torch.no_grad()
def tune(
    target, draft, layers: int, wanted: float, steps: int = 8, prompts: torch.Tensor | None = None
) -> tuple[float, float]:
    """Scale the later layers' output projections by the factor (bisected over ``[0, 1]``) that brings the
    agreement on ``prompts`` (default :func:`bench_prompt_ids`) nearest ``wanted``; leaves the target so
    scaled and returns ``(scale, agreement)``."""
    originals = [w.clone() for w in later_projections(target, layers)]
    prompts = bench_prompt_ids() if prompts is None else prompts

    def measure(scale: float) -> float:
        for w, original in zip(later_projections(target, layers), originals):
            w.copy_(original * scale)
        value = agreement(target, draft, prompts, 32)
        log.info("scale %.4f: agreement %.3f", scale, value)
        return value

    low, high = 0.0, 1.0  # agreement falls as the scale grows: 1.0 at scale 0 (the target is the draft then)
    best = (1.0, measure(1.0))
    if best[1] >= wanted:
        return best
    for _ in range(steps):
        middle = (low + high) / 2
        value = measure(middle)
        if abs(value - wanted) < abs(best[1] - wanted):
            best = (middle, value)
        low, high = (middle, high) if value > wanted else (low, middle)
    measure(best[0])
    return best


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (byte-level BPE's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(BYTES + extra)
            extra += 1
    return chars


def byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer without merges: ids 0..255 are the bytes (GPT-2's byte-to-unicode map), the
    rest placeholders; text is its bytes' ids, the same in every engine that reads the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(BYTES)}
    vocab.update({f"<unused{i}>": i for i in range(BYTES, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# seed 0's scale for an agreement of about 0.75 with a one-layer draft of the TinyLlama shape (make_pair's
# bisection: 0.76 measured, docs/measurements/2026-12-06-real-size-roofline.md); the agreement of a
# seeded model does not depend on the machine
TINYLLAMA_SEED0_SCALE = 0.015625


@torch.no_grad()
def seeded_pair(
    shape: str = "tinyllama-1.1b",
    seed: int = 0,
    scale: float = TINYLLAMA_SEED0_SCALE,
    draft_layers: int = 1,
    dtype: torch.dtype = torch.bfloat16,
):
    """``(target, draft, tokenizer)`` of ``shape`` in memory: :func:`random_target`, its later layers' output
    projections times ``scale`` (no tuning), its first ``draft_layers`` layers as the draft, the byte
    tokenizer. ``SystemExit`` for an unknown shape or ``draft_layers`` outside ``1..layers-1``."""
    target = random_target(shape, seed, dtype)
    if not 1 <= draft_layers < target.config.num_hidden_layers:
        raise SystemExit(f"draft_layers={draft_layers} must lie in 1..{target.config.num_hidden_layers - 1}")
    for weight in later_projections(target, draft_layers):
        weight.mul_(scale)
    draft = draft_of(target, draft_layers)
    for model in (target, draft):
        model.generation_config.pad_token_id = 0
    return target, draft, byte_tokenizer(target.config.vocab_size)
