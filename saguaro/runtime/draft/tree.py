"""The draft lane's work for one round: glue, fork and tree decode into a speculation cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from saguaro.core.schedule import build_steps, round_schedule
from saguaro.core.stages import DRAFT_GLUE, DRAFT_TREE, Stage
from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.sequences import host_to_device
from saguaro.runtime.base.timing import Interval, Stopwatch
from saguaro.runtime.draft.speculation_cache import SpeculationCache
from saguaro.tensor_math.fork import branch_layout

UNUSED_FORK = [2]  # what the glue forks in a round without branches: two candidates at position 0


@dataclass
class GlueRequest:
    """A snapshot of the speculation under verification, taken before the target commits it."""

    ids: torch.Tensor  # [B, K+1]: r, x_1..x_K
    index: torch.Tensor  # [B, K+1]: their slots
    positions: torch.Tensor  # [B, K+1]
    fan_out: list  # F_0..F_K
    temperature: float
    saguaro_c: float
    layouts: dict = field(default_factory=dict)  # fan-out -> its branch layout on the device (the caller's)

    @property
    def draft_tokens(self) -> torch.Tensor:
        return self.ids[:, 1:]  # [B, K]


def build_speculations(
    draft: ModelRunner,
    store: KVStore,
    req: GlueRequest,
    generator: torch.Generator | None,
    nodes: list[dict] | None = None,
) -> SpeculationCache:
    """Glue over ``[r, x_1..x_K]``, fork the top ``F_j`` candidates, decode every branch ``K`` deep, one
    forward per depth over all ``MQ`` branches; branch ``β`` forked at glue row ``j`` sees the shared slots
    up to ``P0 + j`` and its own. ``nodes``: the build nodes of the round schedule in order (default:
    SSD's); ``ValueError`` for a node of another stage."""
    if nodes is None:
        schedule = round_schedule("ssd", req.ids.shape[1] - 1, sampled=req.temperature > 0)
        nodes = [schedule.nodes[n] for n in build_steps(schedule)]
    tree = TreeBuild(draft, store, req, generator)
    for node in nodes:
        stage = node["stage"]
        watch = Stopwatch(tree.device)  # device time on the lane's stream, read after the build
        if stage is DRAFT_GLUE:
            tree.glue()
            tree.glue_s = watch.stop()
        elif stage in DRAFT_TREE:
            if req.fan_out and sum(req.fan_out):  # no branches: no tree depth runs
                tree.depth(node["depth"], stage)
                tree.depth_s.append(watch.stop())
        else:
            raise ValueError(f"schedule node of stage {stage.qualified} is not a draft-lane build step")
    cache = tree.cache()  # reads the build's results: its timings are ready too
    cache.glue_s = tree.glue_s.seconds if isinstance(tree.glue_s, Interval) else tree.glue_s
    cache.depth_s = [interval.seconds for interval in tree.depth_s]
    return cache


class TreeBuild:
    """One round's glue and tree decode, one schedule node at a time."""

    def __init__(self, draft: ModelRunner, store: KVStore, req: GlueRequest, generator):
        self.draft, self.store, self.req, self.generator = draft, store, req, generator
        self.B = req.ids.shape[0]
        self.device = req.ids.device
        self.tokens, self.probs = [], []
        self.glue_s, self.depth_s = 0.0, []  # measured seconds of the glue and of each tree depth

    def glue(self) -> None:
        req, device = self.req, self.device
        self.store.invalidate_from(req.index[:, 0])  # drop last round's glue tail and tree scratch
        self.rows, ranks = self.layout(req.fan_out)  # [MQ], [MQ]
        MQ = self.rows.numel()
        # the glue returns the fork's candidates [B, MQ] and each row's ranked tokens [B, K+1, W]. Without
        # branches (an SD round) it forks UNUSED_FORK, never MQ = 0 (a shape of its own, outside an exported
        # stage's range) nor 1 (a compiler keeps a size of 1 static: one more compile of the glue)
        layout = (self.rows, ranks) if MQ else self.layout(UNUSED_FORK)
        candidates, self.ranked = self.draft.run(
            DRAFT_GLUE, self.store, req.ids, req.positions, req.index, req.draft_tokens, *layout
        )
        self.candidates = candidates[:, :MQ]
        self.branch = (torch.arange(MQ, device=device) + 1).expand(self.B, MQ)  # [B, MQ]
        self.fork_pos = req.positions[:, :1] + self.rows[None, :]  # [B, MQ]: position of x_j, the last shared
        self.first_scratch = req.index[:, -1:] + 1  # [B, 1]
        self.ids = self.candidates
        if req.temperature > 0:  # fills, not copies of host scalars: no sync
            self.inv_t = torch.full((), 1.0 / req.temperature, device=device)
            self.c = torch.full((), float(req.saguaro_c), device=device)

    def layout(self, fan_out: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``branch_layout(fan_out)`` on the device, made once per fan-out (``req.layouts``) and copied
        without a sync."""
        key = tuple(fan_out)
        if key not in self.req.layouts:
            rows, ranks = branch_layout(fan_out, device="cpu")  # [MQ], [MQ] host
            self.req.layouts[key] = (host_to_device(rows, self.device), host_to_device(ranks, self.device))
        return self.req.layouts[key]

    def depth(self, depth: int, stage: Stage) -> None:
        """Tree depth ``depth`` (1-based): one draft forward over every branch with ``stage``."""
        MQ = self.rows.numel()
        if MQ == 0:  # fan-out 0: glue only; every lookup misses
            return
        req, device, d = self.req, self.device, depth - 1
        slots = self.first_scratch + d * MQ + torch.arange(MQ, device=device)[None, :]  # [B, MQ]
        position = self.fork_pos + 1 + d
        if req.temperature == 0.0:
            (token,) = self.draft.run(
                stage,
                self.store,
                self.ids,
                position,
                slots,
                branch=self.branch,
                limit=self.fork_pos,
                depth=depth,
            )
            prob = None
        else:
            # Saguaro sampling: this token is x_{d+1} of the next speculation, whose recovery would be
            # looked up among the top-F_d candidates of the next glue's row d
            top = torch.full((), req.fan_out[d], dtype=torch.long, device=device)
            u = torch.rand(self.B, MQ, generator=self.generator, device=device)
            token, prob = self.draft.run(
                stage,
                self.store,
                self.ids,
                position,
                slots,
                self.inv_t,
                top,
                self.c,
                u,
                branch=self.branch,
                limit=self.fork_pos,
                depth=depth,
            )
        self.tokens.append(token)  # [B, MQ]
        self.probs.append(prob)  # [B, MQ, V]
        self.ids = token

    def cache(self) -> SpeculationCache:
        K = self.req.ids.shape[1] - 1
        if self.rows.numel() == 0:
            V = self.draft.spec.vocab_size
            probs = torch.zeros(self.B, 0, K, V, device=self.device) if self.req.temperature > 0 else None
            return SpeculationCache(
                branch_rows=self.rows,
                candidates=self.candidates,
                tokens=self.candidates.new_zeros(self.B, 0, K),
                probs=probs,
                ranked=self.ranked,
            )
        probs = torch.stack(self.probs, dim=2) if self.probs[0] is not None else None  # [B, MQ, K, V]
        return SpeculationCache(
            branch_rows=self.rows,
            candidates=self.candidates,
            tokens=torch.stack(self.tokens, dim=2),  # [B, MQ, K]
            probs=probs,
            ranked=self.ranked,
        )
