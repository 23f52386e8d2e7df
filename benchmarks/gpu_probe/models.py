"""The speed parts' pair, and the bytes each model reads per token.

``--scale 8b``: the target is Llama-3.1-8B's shape at full depth (32 layers, hidden 4096, 32 heads, 8 KV
heads, intermediate 14336, vocabulary 128256) in bfloat16, random weights (seeded) built on the device
itself (no download, no host copy); ``--scale tiny``: the same family at tiny widths, float32, for CPU
runs. The draft is the target's embeddings, first layer, final norm and head, copied: a 1-layer model of
the family whose step reads about 0.10 of the target step's bytes at 8B widths (:func:`step_bytes`).
The target's other layers write into the residual stream through ``o_proj`` and ``down_proj``; both
are scaled by one knob ``s`` (0: the target is the draft), bisected until the draft's greedy agreement
with the target over random contexts is near ``--acceptance``. Both the agreement found and the
per-token acceptance of the real runs are recorded.
"""

from __future__ import annotations

import copy

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
}
LAYERS = {"8b": 32, "tiny": 4}
MAX_DRAFT_RATIO = 0.12  # the draft step's bytes over the target step's, at most


def step_bytes(shape: dict, layers: int, dtype_bytes: int, context: int, rows: int = 1) -> dict:
    """Bytes one decode step of ``rows`` sequences reads at ``context`` tokens: every weight once (the
    embedding table only its ``rows`` rows), and each layer's K and V of the context per row."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim  # q and o, k and v
    layer = attention + 3 * h * inter + 2 * h  # + gate, up, down; two norms
    weights = layers * layer + h + (0 if shape.get("tie_word_embeddings") else vocab * h)  # final norm, head
    kv = layers * 2 * kv_heads * head_dim * context * rows
    out = {"weights": weights * dtype_bytes, "kv": kv * dtype_bytes, "embedding_rows": rows * h * dtype_bytes}
    return out | {"total": sum(out.values())}


def pair_bytes(scale: str, target_layers: int, dtype_bytes: int, context: int, rows: int = 1) -> dict:
    """Bytes per step of the target and of the 1-layer draft, and their ratio ``c_bytes``."""
    shape = SHAPES[scale]
    target = step_bytes(shape, target_layers, dtype_bytes, context, rows)
    draft = step_bytes(shape, 1, dtype_bytes, context, rows)
    return {
        "target": target["total"],
        "draft": draft["total"],
        "c_bytes": round(draft["total"] / target["total"], 4),
        "target_detail": target,
        "draft_detail": draft,
        "context": context,
        "rows": rows,
    }


def round_bytes(mode: str, k: int, pair: dict) -> int:
    """Bytes a round reads: the target once (a step, or a verify of ``k+1`` tokens: the weights once),
    plus the draft's steps: ``k`` for SD, ``k+1`` for SSD (the glue and ``k`` tree depths), none for AR."""
    draft_calls = {"ar": 0, "sd": k, "ssd": k + 1}[mode]
    return pair["target"] + draft_calls * pair["draft"]


def truncated(target, layers: int):
    """A draft of ``target``'s embeddings, first ``layers`` layers, final norm and head (copied), built
    where and in the dtype the target is."""
    import torch

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    default = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            draft = type(target)(config).eval()
    finally:
        torch.set_default_dtype(default)
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in own})
    return draft


def build_pair(args, device, dtype):
    """``target, draft, knob``: ``knob(s)`` scales the target's layers after the first by ``s``. The
    weights are drawn on ``device`` in ``dtype`` directly (16 GB at 8B: seconds on a GPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[args.scale],
        num_hidden_layers=args.target_layers,
        pad_token_id=0,
        max_position_embeddings=args.prompt_len + args.max_new_tokens + 256,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    draft = truncated(target, 1)
    writes = [
        w
        for layer in target.model.layers[1:]  # what the later layers add to the residual stream
        for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)
    ]
    originals = [w.detach().clone() for w in writes]

    def knob(s: float) -> None:
        with torch.no_grad():
            for w, original in zip(writes, originals):
                w.copy_(original * s)

    return target, draft, knob


def agreement(target, draft_tokens, contexts) -> float:
    """The fraction of positions where the target's greedy token is the draft's."""
    import torch

    with torch.inference_mode():
        return float((target(contexts).logits.argmax(-1) == draft_tokens).float().mean())


def tune(target, draft, knob, goal: float, vocab: int, device) -> dict:
    """Bisect the knob (geometrically) for greedy agreement ``goal`` on random contexts."""
    import torch

    contexts = torch.randint(3, vocab, (4, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        draft_tokens = draft(contexts).logits.argmax(-1)
    history = []

    def measure(s):
        knob(s)
        history.append((s, agreement(target, draft_tokens, contexts)))
        return history[-1][1]

    lo, hi, s = None, None, 1.0  # lo: agreement >= goal; hi: below it
    for _ in range(12):
        if measure(s) >= goal:
            lo = s
            s = s * 4 if hi is None else (s * hi) ** 0.5
        else:
            hi = s
            s = s / 4 if lo is None else (lo * s) ** 0.5
        if lo is not None and hi is not None and hi / lo < 1.15:
            break
    best_s, best = min(history, key=lambda h: abs(h[1] - goal))
    knob(best_s)
    return {
        "goal": goal,
        "rest_scale": best_s,
        "agreement": round(best, 4),
        "contexts": list(contexts.shape),
        "history": [(round(s, 5), round(a, 4)) for s, a in history],
    }


def acceptance(counters, k: int) -> float | None:
    """Per-token greedy acceptance of a speculative run: accepted / offered, per row and round."""
    decided = list(getattr(counters, "accepted_lengths", []) or [])
    offered = sum(min(d, k) for d in decided)
    return round(sum(d - 1 for d in decided) / offered, 4) if offered else None


def prompt(batch: int, vocab: int, length: int, device):
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(batch)).to(device)


def make_pair(args, ctx: dict) -> dict:
    """The part's pair, tuned, and what it reads per token (kept in ``ctx`` for the part's programs)."""
    import torch

    if "pair" in ctx:
        return ctx["pair"]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, draft, knob = build_pair(args, device, dtype)
    tuning = tune(target, draft, knob, args.acceptance, target.config.vocab_size, device)
    context = args.prompt_len + args.max_new_tokens // 2  # the mean context of the decode rounds
    size = torch.tensor([], dtype=dtype).element_size()
    info = {
        "scale": args.scale,
        "target_layers": args.target_layers,
        "draft_layers": 1,
        "dtype": str(dtype).removeprefix("torch."),
        "widths": {k: v for k, v in SHAPES[args.scale].items() if k.endswith("size") or "heads" in k},
        "params": {
            name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))
        },
        "tuning": tuning,
    }
    bytes_1 = pair_bytes(args.scale, args.target_layers, size, context, 1)
    info |= {
        "bytes_per_token": {"target": bytes_1["target"], "draft": bytes_1["draft"], "context": context},
        "c_bytes": bytes_1["c_bytes"],
    }
    ctx["pair"] = {"target": target, "draft": draft, "info": info, "dtype_bytes": size, "context": context}
    return ctx["pair"]
