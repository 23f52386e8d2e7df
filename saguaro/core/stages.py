"""The stage table: every stage graph derived from a captured model, defined once; names spelled only here.

Query rows per call, batch ``B``: prefill and score ``[B, T]``, verify, verify_round and glue ``[B, K+1]``,
step ``[B, 1]`` (``[B, n]`` a round's first draft call), round and chain ``[B, 1]``, tree ``[B, MQ]`` a depth.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

MODELS = ("target", "draft")
VARIANTS = ("greedy", "sampled")


@dataclass(frozen=True)
class Stage:
    """One graph a model runs per call: its mask, and the epilogue spliced after its logits."""

    model: str  # "target" or "draft": whose captured graph, and so its lane in SSD (``lane``)
    # prefill, step, round (AR's step and commit), verify, verify_round (the verify and commit), chain (the
    # draft's greedy step and next query), glue, tree, score (a whole sequence's logits)
    family: str
    variant: str | None  # "greedy" / "sampled" where the epilogue depends on the temperature, else None
    mask: str  # "causal" or "tree" (the specialize_attention pass)
    epilogue: str  # "module.function" of saguaro.tensor_math (epilogue_function), spliced after the logits
    inputs: tuple = ()  # the epilogue's extra graph inputs, appended in call order
    outputs: tuple = ()  # what the epilogue, and so the stage graph, returns, in order
    ranked: bool = False  # the epilogue takes the rank width W (fork, Saguaro sampling) as a constant
    reads: tuple = ()  # stage graph inputs the epilogue also takes, after the logits, before ``inputs``

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
        module, function = self.epilogue.split(".")
        return getattr(importlib.import_module(f"saguaro.tensor_math.{module}"), function)

    @property
    def lane(self) -> str:
        return self.model


@dataclass(frozen=True)
class Variants:
    """A stage in a greedy and a sampled variant; ``for_temperature(t)`` picks one (greedy at 0)."""

    greedy: Stage
    sampled: Stage

    def for_temperature(self, temperature: float) -> Stage:
        return self.greedy if temperature == 0 else self.sampled

    def __iter__(self):
        return iter((self.greedy, self.sampled))


_SAMPLED_VERIFY_INPUTS = ("draft_tokens", "draft_probs", "inv_temperature", "accept_u", "resample_u")

_LOGITS = ("logits",)  # [B, V]: the last row's
TARGET_PREFILL = Stage("target", "prefill", None, "causal", "sampling.last_logits", outputs=_LOGITS)
TARGET_STEP = Stage("target", "step", None, "causal", "sampling.last_logits", outputs=_LOGITS)
# AR's greedy round in one call: the step, the argmax appended to the sequences (tokens written in place, the
# new lengths and finished returned) and the next round's query claimed in the store; returns that query too
TARGET_ROUND = Stage(
    "target",
    "round",
    "greedy",
    "causal",
    "ar_round.round_greedy",
    ("tokens", "lengths", "finished", "padding", "eos_table", "end"),
    # [B, 1] x 3, [B] x 2, []
    ("input_ids", "positions", "write_slots", "lengths", "finished", "active"),
    reads=("slot_pos", "slot_branch"),
)
TARGET_VERIFY = Variants(
    Stage(
        "target",
        "verify",
        "greedy",
        "causal",
        "verification.verify_greedy",
        ("draft_tokens",),
        ("accepted", "next_token"),
    ),  # [B], [B]
    Stage(
        "target",
        "verify",
        "sampled",
        "causal",
        "verification.verify_sampled",
        _SAMPLED_VERIFY_INPUTS,
        ("accepted", "next_token"),
    ),
)
# the verify's logits themselves, every position's ([B, K+1, V]): what a generation with sampling controls
# processes and verifies on the host side (runtime/decode/controlled.py); built only when such a call runs
TARGET_VERIFY_LOGITS = Stage(
    "target", "verify", "logits", "causal", "sampling.all_logits", outputs=("logits",)
)
# SD's and SSD's greedy verify and commit in one call: x_1..x_a, r' appended (tokens in place, new lengths and
# finished returned), the outcome packed for the round's one read, the next round's draft and verify inputs
TARGET_VERIFY_ROUND = Stage(
    "target",
    "verify_round",
    "greedy",
    "causal",
    "verify_round.verify_round_greedy",
    ("draft_tokens", "tokens", "lengths", "finished", "padding", "eos_table", "end"),
    # [4, B], [B] x 2, [B, 2] x 3, [B, K+1] x 2
    (
        "outcome",
        "lengths",
        "finished",
        "draft_ids",
        "draft_index",
        "draft_positions",
        "verify_index",
        "verify_positions",
    ),
)
# a whole sequence's logits at every position ([B, T, V]): what Program.score turns into the target's
# log-probabilities (serve's logprobs); T rows, so not a few-row family; built on its first use only
TARGET_SCORE = Stage("target", "score", None, "causal", "sampling.all_logits", outputs=("logits",))
DRAFT_PREFILL = Stage("draft", "prefill", None, "causal", "sampling.last_logits", outputs=_LOGITS)
DRAFT_STEP = Variants(
    Stage("draft", "step", "greedy", "causal", "sampling.step_greedy", outputs=("tokens",)),  # [B]
    Stage(
        "draft",
        "step",
        "sampled",
        "causal",
        "sampling.step_sampled",
        ("inv_temperature", "u"),
        ("tokens", "q"),
    ),  # [B], [B, V]
)
# the draft's greedy step chained to the next: its token and the next step's query ([B, 1] x 3), that slot
# claimed in the store inside the graph, so k draft steps are k calls with nothing on the host between them
DRAFT_CHAIN = Stage(
    "draft",
    "chain",
    "greedy",
    "causal",
    "draft_chain.chain_greedy",
    outputs=("tokens", "input_ids", "positions", "write_slots"),  # [B], [B, 1] x 3
    reads=("positions", "write_slots", "slot_pos", "slot_branch"),
)
DRAFT_GLUE = Stage(
    "draft",
    "glue",
    None,
    "causal",
    "fork.fork_with_ranks",
    ("draft_tokens", "branch_rows", "branch_ranks"),
    ("candidates", "ranked"),  # [B, MQ], [B, K+1, W]
    ranked=True,
)
DRAFT_TREE = Variants(
    Stage("draft", "tree", "greedy", "tree", "sampling.tree_greedy", outputs=("tokens",)),  # [B, MQ]
    Stage(
        "draft",
        "tree",
        "sampled",
        "tree",
        "sampling.tree_sampled",
        ("inv_temperature", "top", "saguaro_c", "u"),
        ("tokens", "q_saguaro"),
        ranked=True,
    ),  # [B, MQ], [B, MQ, V]
)

STAGES: tuple[Stage, ...] = (
    TARGET_PREFILL,
    TARGET_STEP,
    TARGET_ROUND,
    *TARGET_VERIFY,
    TARGET_VERIFY_LOGITS,
    TARGET_VERIFY_ROUND,
    TARGET_SCORE,
    DRAFT_PREFILL,
    *DRAFT_STEP,
    DRAFT_CHAIN,
    DRAFT_GLUE,
    *DRAFT_TREE,
)
BY_QUALIFIED_NAME = {stage.qualified: stage for stage in STAGES}
# The families of few query rows, whose linears pack_linears (linear_as_reduction on request) rewrites on CPU.
# A prefill's T rows go to the packed kernel or a GEMM, never reductions (lower/kernel_choice.py); a score's
# to a GEMM.
FEW_ROW_FAMILIES = ("step", "round", "chain", "verify", "verify_round", "glue", "tree")
# Of those, the families of several rows per sequence, whose GEMMs linears="template" hands to Inductor's C++
# GEMM template.
MULTI_ROW_FAMILIES = ("verify", "verify_round", "glue", "tree")
# Each round stage (and the draft's chained step) and what a runner whose builder does not offer it
# (``ModelRunner.provides``: CUDA graphs, an artifact exported without it) runs instead, finishing on the host
ROUND_STAGES = {
    TARGET_ROUND: TARGET_STEP,
    TARGET_VERIFY_ROUND: TARGET_VERIFY.greedy,
    DRAFT_CHAIN: DRAFT_STEP.greedy,
}


def stage_named(qualified: str) -> Stage:
    """The stage called ``qualified`` (``"target.verify_greedy"``); else a ``ValueError`` naming them all."""
    try:
        return BY_QUALIFIED_NAME[qualified]
    except KeyError:
        raise ValueError(
            f"stage {qualified!r} does not exist: choose one of {', '.join(BY_QUALIFIED_NAME)}"
        ) from None


def stages_for(mode: str, temperature: float) -> tuple[Stage, ...]:
    """The stages a generation in ``mode`` calls at ``temperature``, target's first (else ``ValueError``)."""
    if mode == "ar":
        return (TARGET_PREFILL, TARGET_ROUND if temperature == 0 else TARGET_STEP)
    verify = TARGET_VERIFY_ROUND if temperature == 0 else TARGET_VERIFY.sampled
    drafting = (
        TARGET_PREFILL,
        verify,
        DRAFT_PREFILL,
        DRAFT_CHAIN if temperature == 0 else DRAFT_STEP.sampled,
    )
    if mode == "sd":
        return drafting
    if mode == "ssd":
        return drafting + (DRAFT_GLUE, DRAFT_TREE.for_temperature(temperature))
    raise ValueError(f"mode={mode!r} is not allowed: choose one of ar, sd, ssd")
