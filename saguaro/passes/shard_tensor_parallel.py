"""Pass ``shard_tensor_parallel``: one rank's slice of a captured model's weights (Megatron style).

Rank ``r`` of ``world`` keeps block ``r`` of each of :data:`PROJECTIONS` (q/k/v, gate/up column-parallel; o,
down row-parallel, each followed by a functional ``all_reduce`` + ``wait_tensor``, then its bias); the rest
is replicated, so every rank computes the whole logits. ``val`` metadata keeps unsharded shapes. Requires
``no_runtime_checks`` and ``flat_signature``; guarantees ``tensor_parallel``. ``CaptureError`` for head
counts or an MLP width ``world`` does not divide; ``PassError`` for a matrix it cannot place.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import torch

from saguaro.capture.export import ModelSpec
from saguaro.core.errors import CaptureError
from saguaro.passes.base.graph_pass import FLAT_SIGNATURE, NO_RUNTIME_CHECKS, TENSOR_PARALLEL, GraphPass
from saguaro.passes.base.graph_splice import PassError, get_attribute

log = logging.getLogger(__name__)

LINEAR = torch.ops.aten.linear.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
MATMUL_OPS = {
    LINEAR,
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.einsum.default,
}
# parameter path suffix → (role, what one rank's slice counts: "heads", "kv_heads" or "mlp")
PROJECTIONS = {
    "self_attn.q_proj": ("column", "heads"),
    "self_attn.k_proj": ("column", "kv_heads"),
    "self_attn.v_proj": ("column", "kv_heads"),
    "self_attn.o_proj": ("row", "heads"),
    "mlp.gate_proj": ("column", "mlp"),
    "mlp.up_proj": ("column", "mlp"),
    "mlp.down_proj": ("row", "mlp"),
}
_PARAM = re.compile(r"(?:^|\.)(" + "|".join(re.escape(p) for p in PROJECTIONS) + r")\.(weight|bias)$")


@dataclass(frozen=True)
class Shard:
    """One rank's place in a tensor-parallel group: ``rank`` of ``world``, collectives over ``group_name``."""

    rank: int
    world: int
    group_name: str


def check_divisible(spec: ModelSpec, world: int) -> None:
    """Raise ``CaptureError`` naming the head counts of ``spec`` that do not divide by ``world``."""
    bad = [
        f"{name}={count}"
        for name, count in (
            ("num_attention_heads", spec.num_heads),
            ("num_key_value_heads", spec.num_kv_heads),
        )
        if count % world
    ]
    if bad:
        raise CaptureError(
            f"{spec.model_class}: tensor_parallel={world} splits attention heads across ranks, but "
            f"{' and '.join(bad)} {'does' if len(bad) == 1 else 'do'} not divide by {world}; "
            f"choose a tensor_parallel that divides both "
            f"({spec.num_heads} query heads, {spec.num_kv_heads} KV heads)"
        )


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """The spec one rank's graph and KV store have: ``H/N`` query heads and ``Hkv/N`` KV heads."""
    check_divisible(spec, world)
    return replace(spec, num_heads=spec.num_heads // world, num_kv_heads=spec.num_kv_heads // world)


class ShardTensorParallel(GraphPass):
    """The pass for one rank; ``ValueError`` for a rank outside the group, ``CaptureError`` as above."""

    name = "shard_tensor_parallel"
    requires = frozenset({NO_RUNTIME_CHECKS, FLAT_SIGNATURE})
    guarantees = frozenset({TENSOR_PARALLEL})

    def __init__(self, spec: ModelSpec, shard: Shard):
        if not 0 <= shard.rank < shard.world:
            raise ValueError(f"rank {shard.rank} is not in a tensor-parallel group of {shard.world} ranks")
        self.spec, self.shard = spec, shard
        self.local_spec = local_spec(spec, shard.world)  # checks the head counts divide

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return shard_tensor_parallel(gm, self.spec, self.shard)


def shard_tensor_parallel(gm: torch.fx.GraphModule, spec: ModelSpec, shard: Shard) -> torch.fx.GraphModule:
    """Slice ``gm``'s projection parameters to ``shard.rank``'s part and insert the all-reduces."""
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR]
    lm_head = linears[-1] if linears else None  # the logits' projection: replicated
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in MATMUL_OPS:
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        path = _param_path(weight)
        found = _PARAM.search(path) if path else None
        if found is None:
            if node is lm_head or not _reads_matrix_param(gm, node):
                continue
            raise PassError(
                f"shard_tensor_parallel: node {node.name} ({node.target}) multiplies by the parameter "
                f"{path or '?'}, which the pass cannot place (it splits "
                f"{', '.join(PROJECTIONS)}); this model cannot run tensor-parallel"
            )
        if node.target is not LINEAR:
            raise PassError(
                f"shard_tensor_parallel: node {node.name} uses {path} through {node.target}, not aten.linear"
            )
        role, unit = PROJECTIONS[found.group(1)]
        dim = 0 if role == "column" else 1  # weight [out, in]: column-parallel splits out, row-parallel in
        parts = _parts(spec, unit, get_attribute(gm, weight.target).shape[dim], node, shard.world)
        _slice(gm, weight, role, parts, shard, dim)
        bias = node.args[2] if len(node.args) > 2 else None
        if role == "column" and bias is not None:
            _slice(gm, bias, role, parts, shard, dim=0)
        if role == "row":
            rows.append(node)
    for node in rows:
        _all_reduce_after(gm, node, shard.group_name)
    gm.graph.lint()
    gm.recompile()
    log.info(
        "shard_tensor_parallel: rank %d of %d, %d row-parallel all-reduces",
        shard.rank,
        shard.world,
        len(rows),
    )
    return gm


def _param_path(node) -> str | None:
    return node.target if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def _reads_matrix_param(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` takes a parameter of two or more dimensions (a matrix the pass should split)."""
    for arg in node.args:
        path = _param_path(arg)
        if path is not None and getattr(get_attribute(gm, path), "ndim", 0) >= 2:
            return True
    return False


def _parts(spec: ModelSpec, unit: str, width: int, node: torch.fx.Node, world: int) -> int:
    """The equal blocks of the split dimension: heads, KV heads or MLP neurons (else ``CaptureError``)."""
    if unit == "heads":
        return spec.num_heads
    if unit == "kv_heads":
        return spec.num_kv_heads
    if width % world:
        raise CaptureError(
            f"{spec.model_class}: tensor_parallel={world} splits the MLP, but its width "
            f"(intermediate_size={width}, node {node.name}) does not divide by {world}"
        )
    return width


def _slice(gm, node: torch.fx.Node, role: str, parts: int, shard: Shard, dim: int) -> None:
    """Replace the parameter ``node`` reads with this rank's contiguous block of ``dim``."""
    full = get_attribute(gm, node.target)
    size = full.shape[dim]
    if size % parts or parts % shard.world:
        raise PassError(
            f"shard_tensor_parallel: {node.target} ({role}-parallel, node {node.name}) has {size} "
            f"along dim {dim}, not a multiple of {parts} blocks for {shard.world} ranks"
        )
    step = size // shard.world
    local = full.narrow(dim, shard.rank * step, step).contiguous().clone()  # owned: the full one can go
    _set(gm, node.target, torch.nn.Parameter(local, requires_grad=False))


def _all_reduce_after(gm: torch.fx.GraphModule, node: torch.fx.Node, group_name: str) -> None:
    """``node`` (a row-parallel ``linear``) followed by a sum over the group, and its bias after that."""
    bias = node.args[2] if len(node.args) > 2 else None
    if bias is not None:
        node.args = node.args[:2]
    users = list(node.users)
    graph = gm.graph
    with graph.inserting_after(node):
        reduced = graph.call_function(ALL_REDUCE, (node, "sum", group_name))
    with graph.inserting_after(reduced):
        result = graph.call_function(WAIT, (reduced,))
    last = result
    if bias is not None:
        with graph.inserting_after(result):
            last = graph.call_function(torch.ops.aten.add.Tensor, (result, bias))
    for new in (reduced, result, last):
        if "val" in node.meta:
            new.meta["val"] = node.meta["val"]
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    for user in users:
        user.replace_input_with(node, last)


def _set(gm: torch.nn.Module, path: str, value) -> None:
    *owners, leaf = path.split(".")
    module = gm
    for part in owners:
        module = getattr(module, part)
    setattr(module, leaf, value)


def count_all_reduces(gm: torch.fx.GraphModule) -> int:
    """The functional all-reduces in ``gm`` (tests, ``saguaro inspect``)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is ALL_REDUCE)
