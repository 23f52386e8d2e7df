"""A stage's input signature for export: which dimensions are dynamic (batch ``B``, tokens ``T``, KV
slots ``S``, tree branches ``MQ``) and within which ranges, the example inputs torch.export traces
with, and the check of a call's inputs against the recorded ranges (AOTInductor does not check them
at run time, so the loaded stage does).

Every stage graph takes ``input_ids, positions, write_slots, query_branch, query_limit [B, T]``,
``slot_pos, slot_branch [B, S]``, the per-layer ``k_caches, v_caches [B, Hkv, S, D]``, then the
extra inputs of its stage (:mod:`saguaro.core.stages`), whose dimensions are listed in
:data:`EXTRA_DIMS` (``None``: a static dimension, the recorded size).
"""

from __future__ import annotations

import torch

from saguaro.core.errors import ArtifactError
from saguaro.core.stages import DRAFT_GLUE, DRAFT_TREE, TARGET_VERIFY, TARGET_VERIFY_ROUND, Stage

QUERY_INPUTS = ("input_ids", "positions", "write_slots", "query_branch", "query_limit")
SLOT_INPUTS = ("slot_pos", "slot_branch")

# the extra inputs' dimensions; "u" is [B] for a step and [B, MQ] for the tree (TREE_U)
EXTRA_DIMS = {
    "draft_tokens": ("B", None),  # [B, K]
    "draft_probs": ("B", None, None),  # [B, K, V]
    "inv_temperature": (),
    "accept_u": ("B", None),  # [B, K]
    "resample_u": ("B",),
    "branch_rows": ("MQ",),
    "branch_ranks": ("MQ",),
    "top": (),
    "saguaro_c": (),
    "u": ("B",),
    "tokens": ("B", "S"),  # the round stages: the sequence buffers, a token's index being its slot
    "lengths": ("B",),
    "finished": ("B",),
    "padding": ("B",),
    "eos_table": (None,),  # [V]
    "end": (),
}
TREE_U = ("B", "MQ")


def tokens_dim(stage: Stage):
    """The symbol of the query length: verify and glue run ``K+1`` tokens (static), the tree ``MQ``."""
    if stage is DRAFT_GLUE or stage is TARGET_VERIFY_ROUND or stage in TARGET_VERIFY:
        return None
    return "MQ" if stage in DRAFT_TREE else "T"


def input_layout(stage: Stage, num_layers: int) -> list[tuple[str, tuple]]:
    """``[(input name, dims)]`` of the stage's flat inputs, ``dims`` a tuple of symbols or ``None``."""
    t = tokens_dim(stage)
    layout = [(name, ("B", t)) for name in QUERY_INPUTS]
    layout += [(name, ("B", "S")) for name in SLOT_INPUTS]
    layout += [(f"{kind}_caches.{i}", ("B", None, "S", None)) for kind in "kv" for i in range(num_layers)]
    for name in stage.inputs:
        dims = TREE_U if name == "u" and stage in DRAFT_TREE else EXTRA_DIMS.get(name)
        if dims is None:
            raise ArtifactError(
                f"stage {stage.qualified}: extra input {name!r} has no export signature; add its "
                "dimensions to saguaro.artifact.signature.EXTRA_DIMS"
            )
        layout.append((name, dims))
    return layout


# the dimensions whose sizes change from call to call of one program: the query length (a prompt's, a
# tree's) and the KV slots (prompt + new tokens, and SSD's tree slots); batch and static sizes do not
VARYING = ("T", "S", "MQ")


def varying_dims(stage: Stage, input_count: int) -> dict[int, tuple[int, ...]]:
    """``{input position: (dimension, ...)}`` of the :data:`VARYING` dimensions of a stage graph with
    ``input_count`` flat inputs (their number tells the layers: two caches per layer)."""
    fixed = len(QUERY_INPUTS) + len(SLOT_INPUTS) + len(stage.inputs)
    layers, odd = divmod(input_count - fixed, 2)
    if odd or layers < 0:
        raise ArtifactError(
            f"stage {stage.qualified}: {input_count} inputs do not fit its layout ({fixed} "
            "besides two KV caches per layer)"
        )
    layout = input_layout(stage, layers)
    return {
        i: dims
        for i, (_, symbols) in enumerate(layout)
        if (dims := tuple(d for d, symbol in enumerate(symbols) if symbol in VARYING))
    }


def describe(stage: Stage, recorded: list[torch.Tensor], num_layers: int, ranges: dict) -> list[dict]:
    """The manifest's description of each input: name, dtype and per dimension a symbol or a size."""
    layout = input_layout(stage, num_layers)
    if len(layout) != len(recorded):
        raise ArtifactError(
            f"stage {stage.qualified}: expected {len(layout)} inputs, the runtime passed {len(recorded)}"
        )
    described = []
    for (name, dims), tensor in zip(layout, recorded):
        if tensor.dim() != len(dims):
            raise ArtifactError(
                f"stage {stage.qualified}: input {name!r} expected {len(dims)} dimensions, found "
                f"shape {tuple(tensor.shape)}"
            )
        shape = [d if d is not None else int(s) for d, s in zip(dims, tensor.shape)]
        described.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": shape})
    used = {d for entry in described for d in entry["shape"] if isinstance(d, str)}
    missing = used - set(ranges)
    if missing:
        raise ArtifactError(f"stage {stage.qualified}: no range for dimensions {sorted(missing)}")
    return described


def example_sizes(described: list[dict]) -> dict:
    """One example size per symbol, each different from every static size and from the others
    (torch.export would otherwise assume that equal sizes are equal dimensions)."""
    taken = {s for entry in described for s in entry["shape"] if isinstance(s, int)} | {0, 1}
    sizes, candidate = {}, 2
    for symbol in sorted({s for entry in described for s in entry["shape"] if isinstance(s, str)}):
        while candidate in taken:
            candidate += 1
        sizes[symbol] = candidate
        taken.add(candidate)
    return sizes


def examples(described: list[dict], device: torch.device) -> tuple:
    """Example inputs (zeros: traced values do not matter to the stage graphs, only shapes and dtypes)."""
    sizes = example_sizes(described)
    return tuple(
        torch.zeros(
            [sizes.get(d, d) for d in entry["shape"]], dtype=getattr(torch, entry["dtype"]), device=device
        )
        for entry in described
    )


def dynamic_shapes(described: list[dict], ranges: dict) -> tuple:
    """torch.export's ``dynamic_shapes``: each symbol's dimensions dynamic within its range."""
    dynamic = torch.export.Dim.DYNAMIC
    return tuple(
        {
            i: dynamic(min=ranges[d][0], max=ranges[d][1])
            for i, d in enumerate(entry["shape"])
            if isinstance(d, str)
        }
        or None
        for entry in described
    )


class InputCheck:
    """Checks a call's inputs against the stage's recorded signature: dtypes, static sizes, and each
    symbol's size within its range and equal across inputs. The KV caches of one store share one shape,
    so only the first cache is checked."""

    def __init__(self, qualified: str, described: list[dict], ranges: dict):
        self.qualified, self.ranges = qualified, {k: tuple(v) for k, v in ranges.items()}
        self.count = len(described)
        self.entries = [
            (i, e["name"], getattr(torch, e["dtype"]), tuple(e["shape"]))
            for i, e in enumerate(described)
            if not (e["name"].startswith(("k_caches.", "v_caches.")) and not e["name"].endswith(".0"))
        ]

    def __call__(self, args) -> None:
        if len(args) != self.count:
            raise ValueError(f"stage {self.qualified}: expected {self.count} inputs, got {len(args)}")
        seen = {}
        for i, name, dtype, shape in self.entries:
            tensor = args[i]
            if tensor.dtype != dtype or tensor.dim() != len(shape):
                raise ValueError(
                    f"stage {self.qualified}: input {name} expected {dtype} with {len(shape)} "
                    f"dimensions, got {tensor.dtype} of shape {tuple(tensor.shape)}"
                )
            if name.endswith("_caches.0") and not tensor.is_contiguous():
                raise ValueError(
                    f"stage {self.qualified}: input {name} must be contiguous (it is written in place)"
                )
            for dim, size in zip(shape, tensor.shape):
                if isinstance(dim, int):
                    if size != dim:
                        raise ValueError(
                            f"stage {self.qualified}: input {name} shape {tuple(tensor.shape)}: "
                            f"expected size {dim} where the artifact has a static dimension"
                        )
                    continue
                low, high = self.ranges[dim]
                if not low <= size <= high:
                    raise ValueError(
                        f"stage {self.qualified}: input {name}: dimension {dim}={size} is outside "
                        f"the exported range {low}..{high}; export again with a larger range"
                    )
                if seen.setdefault(dim, size) != size:
                    raise ValueError(
                        f"stage {self.qualified}: input {name}: dimension {dim}={size} differs from "
                        f"{seen[dim]} in an earlier input"
                    )
