"""What a benchmark row streams from memory: the weight bytes a decided token reads, the rate that makes,
and its share of the machine's read bandwidth, measured on the spot.

A token reads ``(target + k * draft) / mean_accepted_len`` bytes (AR: the target's), each model's bytes those
its decode stages read as they hold them, embedding lookups left out. SSD's glue and tree calls are not
counted: its share is a floor.
"""

from __future__ import annotations

import torch

from saguaro.core.stages import TARGET_PREFILL

EMBEDDING_OPS = {
    torch.ops.aten.embedding.default,
    torch.ops.aten.index_select.default,
    torch.ops.aten.index.Tensor,
}
MIN_WEIGHT_ELEMENTS = 4096  # smaller tensors (norms, biases) are read from cache


def stream_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of the tensor attributes ``gm`` reads a call, each storage once, less the tensors only an
    embedding lookup reads and the small ones."""
    seen, total = set(), 0
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users or all(u.target in EMBEDDING_OPS for u in node.users):
            continue
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part, None)
        if not isinstance(value, torch.Tensor) or value.numel() < MIN_WEIGHT_ELEMENTS:
            continue
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.numel())
        if key not in seen:
            seen.add(key)
            total += value.numel() * value.element_size()
    return total


def model_stream_bytes(program, model: str) -> int | None:
    """The most bytes a decode stage of ``model`` built so far streams a call; None without such a model or
    stage (a loaded artifact's stages hold no graph)."""
    runner = program.runner(model) if program is not None else None
    if runner is None:
        return None
    sizes = [stream_bytes(gm) for stage, gm in runner.stage_graphs() if stage.family != TARGET_PREFILL.family]
    return max(sizes) if sizes else None


def token_bytes(program, mode: str, k: int, mean_accepted_len: float | None) -> int | None:
    """The weight bytes a decided token of a ``mode`` row reads (the module's model); None: unknown."""
    target = model_stream_bytes(program, "target")
    if target is None or not mean_accepted_len:
        return None
    if mode == "ar":
        return target
    draft = model_stream_bytes(program, "draft") or 0
    return round((target + k * draft) / mean_accepted_len)


def add_bandwidth(row: dict, read_gbs: float | None) -> None:
    """``weight_gbs`` (``weight_bytes_per_token`` x the decode rate) and ``roofline_share`` (that over
    ``read_gbs``, the machine's measured read bandwidth) of a row that has its bytes a token."""
    per_token = row.get("weight_bytes_per_token")
    rate = row.get("decode_tokens_per_s")
    row["weight_gbs"] = per_token * rate / 1e9 if per_token and rate else None
    row["roofline_share"] = row["weight_gbs"] / read_gbs if row["weight_gbs"] and read_gbs else None


def measure_read_gbs(threads: int | None = None) -> float | None:
    """The machine's read bandwidth in GB/s on ``threads`` intra-op threads (None: torch's), measured now;
    None where the kernel library cannot be built."""
    from saguaro.tensor_math.packed_linear import available, read_bandwidth

    if not available():
        return None
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        return read_bandwidth()
    finally:
        torch.set_num_threads(before)
