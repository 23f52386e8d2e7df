"""Pass: choose how each ``saguaro::attention`` node runs on the stage's backend.

Requires: a stage graph (attention mask already specialised, epilogue spliced: no dead-code
elimination runs after this pass, which matters because the inlined KV writes have no users).
Guarantees, by ``implementation``:

* ``"op"``: the nodes stay the ``saguaro::attention`` custom op (the eager backend: one opaque,
  mutating node per layer that the reference kernel runs).
* ``"inline"``: each node becomes the op's own math as plain tensor code: the KV write as an
  ``index_put_`` into the store's caches, then the masked attention of
  :func:`~saguaro.capture.attention_op.attention_reference`. A compiler sees through it: Inductor
  fuses the KV write and the cast into its kernels, writes the caches in place (its re-inplacing of
  ``index_put``), and drops the Python custom-op dispatch that costs more per layer than the
  attention itself on a small model. Outputs and cache contents equal the op's.
"""

from __future__ import annotations

import logging

import torch

from saguaro.capture.attention_op import ATTENTION_OP, attention_reference
from saguaro.passes.graph_splice import PassError

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("op", "inline")


def attention_inline(
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    v_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    write_slots: torch.Tensor,  # [B, T]
    bias: torch.Tensor,  # [B, 1, G*T, S]
    scale: float,
) -> torch.Tensor:
    """The ``saguaro::attention`` op as traceable tensor code; returns ``[B, H, T, D]``."""
    B, Hkv = key.shape[0], key.shape[1]
    rows = torch.arange(B, device=key.device)[:, None, None]  # [B, 1, 1]
    heads = torch.arange(Hkv, device=key.device)[None, :, None]  # [1, Hkv, 1]
    index = (rows, heads, write_slots[:, None, :])  # broadcast to [B, Hkv, T]
    k_cache.index_put_(index, key.to(k_cache.dtype))
    v_cache.index_put_(index, value.to(v_cache.dtype))
    return attention_reference(query, k_cache, v_cache, bias, scale)


def lower_attention(gm: torch.fx.GraphModule, implementation: str) -> torch.fx.GraphModule:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not allowed: choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ATTENTION_OP]
    if not nodes:
        raise PassError("lower_attention: no saguaro::attention node in the graph (already lowered?)")
    if implementation == "op":
        log.info("lower_attention(op): kept %d attention node(s)", len(nodes))
        return gm
    for node in nodes:
        if len(node.args) != 8 or node.kwargs:
            raise PassError(f"lower_attention: FX node {node.name!r} has {len(node.args)} positional and "
                            f"{len(node.kwargs)} keyword arguments, expected 8 and 0")
        node.target = attention_inline  # same arguments, same result, same cache writes
    gm.graph.lint()
    gm.recompile()
    log.info("lower_attention(inline): rewrote %d attention node(s)", len(nodes))
    return gm
