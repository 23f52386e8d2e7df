"""Pass ``strip_runtime_checks``: export's metadata assertions and no-op dtype conversions removed.

Unused ``aten._assert_tensor_metadata`` nodes are erased; each ``aten.to.dtype`` whose input already has the
dtype (its ``val`` metadata) is bypassed. Same outputs bit for bit.
Requires nothing; guarantees ``no_runtime_checks``.
"""

from __future__ import annotations

import logging

import torch

from saguaro.passes.base.graph_pass import NO_RUNTIME_CHECKS, GraphPass

log = logging.getLogger(__name__)

ASSERT_OPS = {torch.ops.aten._assert_tensor_metadata.default}
TO_DTYPE = torch.ops.aten.to.dtype


def _is_noop_conversion(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not TO_DTYPE:
        return False
    source = node.args[0]
    want = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if value is None or want is None or set(node.kwargs) - {"dtype"} or len(node.args) > 2:
        return False
    return value.dtype == want


def strip_runtime_checks(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    removed_asserts = removed_conversions = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
            removed_asserts += 1
        elif _is_noop_conversion(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed_conversions += 1
    gm.graph.lint()
    gm.recompile()
    log.info(
        "strip_runtime_checks: removed %d metadata assertions and %d no-op conversions",
        removed_asserts,
        removed_conversions,
    )
    return gm


class StripRuntimeChecks(GraphPass):
    name = "strip_runtime_checks"
    requires = frozenset()
    requires_nothing_because = "it removes only what each node's own dtype metadata proves redundant"
    guarantees = frozenset({NO_RUNTIME_CHECKS})

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return strip_runtime_checks(gm)
