"""Pass ``flatten_signature``: the captured graph called with flat positional inputs, returning a tuple.

``ExportedProgram.module()``'s pytree specs, pre-hooks and input guards are removed (a flat graph is left
as it is): called as ``gm(input_ids, positions, write_slots, query_branch, query_limit, slot_pos,
slot_branch, *k_caches, *v_caches)``. Requires nothing; guarantees ``flat_signature``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from saguaro.passes.base.graph_pass import FLAT_SIGNATURE, GraphPass

log = logging.getLogger(__name__)


def flatten_signature(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    if type(gm.graph._codegen) is torch.fx.graph.CodeGen:
        return gm
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()  # export's pre-hooks check inputs against the pytree spec
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not isinstance(out.args[0], (tuple, list)):
        out.args = ((out.args[0],),)
    guards = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    for node in guards:  # export's input guards check the pytree signature this pass removes
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    log.info(
        "flatten_signature: %d placeholders, %d guard calls removed",
        sum(n.op == "placeholder" for n in gm.graph.nodes),
        len(guards),
    )
    return gm


class FlattenSignature(GraphPass):
    name = "flatten_signature"
    requires = frozenset()
    requires_nothing_because = (
        "any GraphModule: export's pytree signature is replaced, a flat one is left as is"
    )
    guarantees = frozenset({FLAT_SIGNATURE})

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return flatten_signature(gm)
