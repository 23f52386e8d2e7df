"""The stage table: every stage graph Saguaro derives from a captured model, defined once.

A *stage* is one graph a model runs per call: its attention mask kind, the epilogue spliced after its
logits (so it returns small tensors), and the extra inputs that epilogue takes. The pass pipeline
builds stage graphs from this table, the runtime calls them by these objects, the schedule costs its
nodes with them, and inspection and export walk :data:`STAGES`. Stage names are spelled here only:
elsewhere code reads ``stage.name`` / ``stage.qualified``.

Shapes for batch ``B``: ``prefill [B, T]``, ``verify [B, K+1]``, ``step [B, 1]`` (``[B, n]`` for
the first draft call of a round), ``glue [B, K+1]``, ``tree [B, MQ]`` (one call per depth).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

MODELS = ("target", "draft")
VARIANTS = ("greedy", "sampled")


@dataclass(frozen=True)
class Stage:
    """One stage of one model.

    ``model``: whose captured graph it is derived from, and so the lane it runs on in SSD.
    ``family``: what it does (``prefill``, ``step``, ``verify``, ``glue``, ``tree``).
    ``variant``: ``"greedy"`` / ``"sampled"`` for the stages whose epilogue depends on the
    temperature, ``None`` for the others. ``mask``: ``"causal"`` or ``"tree"`` (the
    ``specialize_attention`` pass). ``epilogue_pass`` names the pass that splices ``epilogue`` (a
    :mod:`saguaro.tensor_math` function of the logits, named ``"module.function"`` and looked up when the
    stage is built) after the logits; ``inputs`` are the extra
    graph inputs it appends, in call order; ``ranked`` marks epilogues that take the rank width
    (``fork`` and Saguaro sampling: top-``W`` tokens) as a constant.
    """

    model: str
    family: str
    variant: str | None
    mask: str
    epilogue_pass: str
    epilogue: str
    inputs: tuple = ()
    ranked: bool = False

    @property
    def name(self) -> str:
        """The name within its model: ``verify_greedy``, ``glue``, ..."""
        return self.family if self.variant is None else f"{self.family}_{self.variant}"

    @property
    def qualified(self) -> str:
        """``model.name``: how logs, costs and traces name the stage."""
        return f"{self.model}.{self.name}"

    @property
    def epilogue_function(self) -> Callable:
        """The :mod:`saguaro.tensor_math` function ``epilogue`` names."""
        module, function = self.epilogue.split(".")
        return getattr(importlib.import_module(f"saguaro.tensor_math.{module}"), function)

    @property
    def lane(self) -> str:
        """The lane the stage runs on in SSD: each model's stages run on that model's lane."""
        return self.model


@dataclass(frozen=True)
class Variants:
    """A stage that exists in a greedy and a sampled variant."""

    greedy: Stage
    sampled: Stage

    def at(self, temperature: float) -> Stage:
        return self.greedy if temperature == 0 else self.sampled

    def __iter__(self):
        return iter((self.greedy, self.sampled))


_SAMPLED_VERIFY_INPUTS = ("draft_tokens", "draft_probs", "inv_temperature", "accept_u", "resample_u")

TARGET_PREFILL = Stage("target", "prefill", None, "causal", "fuse_sampling", "sampling.last_logits")
TARGET_STEP = Stage("target", "step", None, "causal", "fuse_sampling", "sampling.last_logits")
TARGET_VERIFY = Variants(
    Stage("target", "verify", "greedy", "causal", "fuse_verification", "verification.verify_greedy",
          ("draft_tokens",)),
    Stage("target", "verify", "sampled", "causal", "fuse_verification", "verification.verify_sampled",
          _SAMPLED_VERIFY_INPUTS),
)
DRAFT_PREFILL = Stage("draft", "prefill", None, "causal", "fuse_sampling", "sampling.last_logits")
DRAFT_STEP = Variants(
    Stage("draft", "step", "greedy", "causal", "fuse_sampling", "sampling.step_greedy"),
    Stage("draft", "step", "sampled", "causal", "fuse_sampling", "sampling.step_sampled", ("inv_temperature", "u")),
)
DRAFT_GLUE = Stage("draft", "glue", None, "causal", "fuse_fork", "fork.fork_with_ranks",
                   ("draft_tokens", "branch_rows", "branch_ranks"), ranked=True)
DRAFT_TREE = Variants(
    Stage("draft", "tree", "greedy", "tree", "fuse_sampling", "sampling.tree_greedy"),
    Stage("draft", "tree", "sampled", "tree", "fuse_sampling", "sampling.tree_sampled",
          ("inv_temperature", "top", "saguaro_c", "u"), ranked=True),
)

STAGES: tuple[Stage, ...] = (
    TARGET_PREFILL, TARGET_STEP, *TARGET_VERIFY, DRAFT_PREFILL, *DRAFT_STEP, DRAFT_GLUE, *DRAFT_TREE)
BY_QUALIFIED_NAME = {stage.qualified: stage for stage in STAGES}


def stage_named(qualified: str) -> Stage:
    """The stage called ``qualified`` (``"target.verify_greedy"``); a ``ValueError`` names the allowed ones."""
    try:
        return BY_QUALIFIED_NAME[qualified]
    except KeyError:
        raise ValueError(f"stage {qualified!r} does not exist: choose one of {', '.join(BY_QUALIFIED_NAME)}") from None


def stages_for(mode: str, temperature: float) -> tuple[Stage, ...]:
    """The stages a generation in ``mode`` calls at ``temperature``, target's first."""
    if mode == "ar":
        return (TARGET_PREFILL, TARGET_STEP)
    drafting = (TARGET_PREFILL, TARGET_VERIFY.at(temperature), DRAFT_PREFILL, DRAFT_STEP.at(temperature))
    if mode == "sd":
        return drafting
    if mode == "ssd":
        return drafting + (DRAFT_GLUE, DRAFT_TREE.at(temperature))
    raise ValueError(f"mode={mode!r} is not allowed: choose one of ar, sd, ssd")
