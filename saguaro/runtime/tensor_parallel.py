"""Tensor-parallel programs under ``torch.distributed``: ranks ``0..N-1`` run the target's shards, rank
``N`` holds the draft (``tensor_parallel=N``, launched with ``torchrun --nproc-per-node N+1``).

Every rank runs the same script and calls ``generate`` with the same arguments; on CUDA each holds its model
on ``cuda:LOCAL_RANK`` before ``compile``. Each target rank decides every token itself from the replicated
logits (one seed, agreed by rank 0), so the ranks stay in step without exchanging tokens; rank 0's sequences
are broadcast at the end, and a rank whose own differ raises ``SaguaroError``. SD drafts on the target ranks;
SSD's lane is the draft rank (:mod:`saguaro.runtime.lanes.rank`) and its rounds are always SSD's. Written
for NCCL, run only with gloo on CPU so far.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from saguaro.core.errors import ConfigError, SaguaroError
from saguaro.runtime.base.wire import Channel
from saguaro.runtime.lanes import rank as rank_lane
from saguaro.runtime.lanes.owner import register_lane
from saguaro.runtime.program import GenerateOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a tensor-parallel job: ``rank`` of ``N + 1``, the target group (ranks
    ``0..N-1``; None on the draft rank), the pair groups ``{r, N}`` of the rank lane (index ``r``; a
    target rank holds only its own) and the device collectives of this rank run on."""

    rank: int
    tensor_parallel: int
    target_group: object
    pairs: tuple
    device: torch.device

    @property
    def draft_rank(self) -> int:
        return self.tensor_parallel

    @property
    def is_draft(self) -> bool:
        return self.rank == self.tensor_parallel


def join_ranks(tensor_parallel: int, device: torch.device) -> Ranks:
    """This rank's :class:`Ranks`, the process group initialised from ``torchrun``'s environment when it
    is not yet; every rank must call it (it makes the target group, a collective)."""
    if not dist.is_available():
        raise ConfigError(
            f"tensor_parallel={tensor_parallel} needs torch.distributed, which this torch lacks"
        )
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                f"tensor_parallel={tensor_parallel} needs torch.distributed with "
                f"{tensor_parallel + 1} ranks: launch with torchrun --nproc-per-node "
                f"{tensor_parallel + 1} (or call torch.distributed.init_process_group first)"
            )
        dist.init_process_group()  # the default backends: gloo for CPU tensors, NCCL for CUDA ones
    world = dist.get_world_size()
    if world != tensor_parallel + 1:
        raise ConfigError(
            f"tensor_parallel={tensor_parallel} is not allowed here: the job has {world} ranks, and "
            f"it needs {tensor_parallel + 1} ({tensor_parallel} target ranks and one draft rank)"
        )
    rank = dist.get_rank()
    group = dist.new_group(list(range(tensor_parallel)))  # every rank takes part in making each group
    pairs = tuple(dist.new_group([r, tensor_parallel]) for r in range(tensor_parallel))
    log.info(
        "tensor parallel: rank %d of %d (%s)", rank, world, "draft" if rank == tensor_parallel else "target"
    )
    return Ranks(
        rank, tensor_parallel, group if rank < tensor_parallel else None, pairs, torch.device(device)
    )


def agree_seed(ranks: Ranks, temperature: float, seed: int | None) -> int | None:
    """The seed every rank samples with: rank 0's (drawn there from torch's generator when None)."""
    if temperature <= 0:
        return seed
    if seed is None:
        seed = int(torch.randint(2**62, (), dtype=torch.long, device="cpu")) if ranks.rank == 0 else -1
    value = torch.tensor([seed], dtype=torch.long, device=ranks.device)
    dist.broadcast(value, src=0)
    return int(value.item())


def share_sequences(ranks: Ranks, sequences: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's ``sequences [B, L]`` on every rank (``None`` on the draft rank); a target rank whose own
    differ raises ``SaguaroError``."""
    shape = torch.tensor(
        list(sequences.shape) if sequences is not None else [0, 0], dtype=torch.long, device=ranks.device
    )
    dist.broadcast(shape, src=0)
    received = torch.empty(tuple(shape.tolist()), dtype=torch.long, device=ranks.device)
    if ranks.rank == 0:
        received.copy_(sequences)
    dist.broadcast(received, src=0)
    if sequences is not None and not torch.equal(received.to(sequences.device), sequences):
        raise SaguaroError(
            f"tensor parallel: rank {ranks.rank}'s tokens differ from rank 0's (the target ranks diverged)"
        )
    return received


class TensorParallelProgram:
    """A target rank's program: its shard's :class:`~saguaro.runtime.program.Program`, the seed agreed and
    the sequences shared around each ``generate``; other attributes are the Program's."""

    def __init__(self, program, ranks: Ranks):
        self.program = program
        self.ranks = ranks
        self.link = None
        if program.lanes is not None:  # SSD's lane: the draft rank, over this rank's pair group
            spec = program.target.spec
            self.link = rank_lane.RankLink(
                ranks.rank, ranks.pairs[ranks.rank], ranks.device, spec.vocab_size, program.config.k
            )
            register_lane(
                rank_lane.KIND,
                lambda owner: rank_lane.RankLane(owner.remote_draft),
                falls_back_to=None,
                shares_host=False,
            )
            program.lanes.remote_draft = self.link  # what the rank lane starts from
            program.lanes.configured_kind = program.lanes.kind = rank_lane.KIND

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        eos_token_id="default",
        seed: int | None = None,
        attention_mask=None,
        mode: str | None = None,
        trace=None,
    ):
        """``Program.generate`` on every target rank, the same tokens everywhere; ``stats["rank"]``: ours."""
        ssd = (mode or self.program.config.mode) == "ssd"
        seed = agree_seed(self.ranks, temperature, seed)
        try:
            out = self.program.generate(
                input_ids, max_new_tokens, temperature, eos_token_id, seed, attention_mask, mode, trace
            )
        finally:
            if ssd and self.link is not None:
                try:
                    self.link.bye()  # the draft rank stops serving this call
                except SaguaroError as exc:  # a dead draft rank: the tokens (finished with SD) still stand
                    log.warning("tensor parallel: the draft rank did not take the end of the call: %s", exc)
        share_sequences(self.ranks, out.sequences)
        out.stats["rank"] = self.ranks.rank
        out.stats["tensor_parallel"] = self.ranks.tensor_parallel
        return out

    def export(self, path, **options):
        raise SaguaroError(
            "a tensor-parallel program cannot be exported yet: export a program compiled "
            "without tensor_parallel"
        )

    def stream(self, input_ids, **options):
        # not the Program's: its worker would generate on this rank alone (no agreed seed, no end of call)
        raise SaguaroError(
            "program.stream is not built for tensor_parallel=N yet (nor generate(streamer=)): use generate"
        )

    def __getattr__(self, name):
        return getattr(self.program, name)


class DraftRankProgram:
    """Rank ``N``'s program: it holds the draft (``make_server()`` builds its speculation server on first
    SSD use), serves SSD calls, and returns the sequences the target ranks decided."""

    def __init__(self, config, ranks: Ranks, make_server, vocab_size: int):
        self.config = config
        self.ranks = ranks
        self.make_server = make_server
        self.vocab_size = vocab_size
        self.server = None
        self.seq = 0  # the last rank-lane message number (counted across calls)
        self.channels = [Channel(pair, peer=0, device=ranks.device) for pair in ranks.pairs]

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        eos_token_id="default",
        seed: int | None = None,
        attention_mask=None,
        mode: str | None = None,
        trace=None,
    ):
        """Take part in the call the target ranks run with the same arguments; their sequences."""
        mode = mode or self.config.mode
        agree_seed(self.ranks, temperature, seed)
        stats = {"rank": self.ranks.rank, "mode": mode, "tensor_parallel": self.ranks.tensor_parallel}
        if mode == "ssd":
            if self.server is None:
                self.server = self.make_server()
            last = rank_lane.serve_generation(
                self.server, self.channels, self.vocab_size, self.config.k, self.seq
            )
            stats["requests"] = last - self.seq - 1  # BYE not counted
            self.seq = last
        return GenerateOutput(sequences=share_sequences(self.ranks, None), stats=stats)

    def close(self) -> None:
        """Nothing runs between calls on the draft rank."""
