"""Fallbacks on a speculation-cache miss, neural (the draft decodes now) or fast (a free n-gram
proposal), and :class:`FallbackPolicy`, which picks one for ``fallback="auto"``."""

from __future__ import annotations

from collections import deque

import torch

from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.stats import FALLBACK_KINDS
from saguaro.runtime.draft.decode import draft_decode
from saguaro.tensor_math.verification import one_hot_proposal


def neural_fallback(
    draft: ModelRunner,
    store: KVStore,
    seqs: SequenceBatch,
    rows: torch.Tensor,
    k: int,
    temperature: float,
    generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft decodes ``k`` tokens from ``r'`` for ``rows [M]``: ``(tokens [M, k], probs or None)``, on
    copied rows of the store (nothing is copied back: they write only what the next glue rewrites)."""
    sub = store if rows.numel() == seqs.batch else store.select_rows(rows)
    index = seqs.tail_index(1)[rows]  # [M, 1]: r'
    ids = seqs.tokens[rows].gather(1, index)
    positions = index - seqs.padding[rows][:, None]
    return draft_decode(draft, sub, ids, index, positions, k, temperature, generator)


def fast_fallback(
    seqs: SequenceBatch, rows: torch.Tensor, k: int, vocab_size: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An n-gram proposal from each row's context, what followed the last earlier ``r'`` (else ``r'``
    repeated): ``(tokens [M, k], one-hot probs or None)``. Deterministic, so verification with ``δ_x``
    stays exact when sampling; all rows at once on the device, no host sync."""
    context = seqs.tokens[rows]  # [M, C]
    last_index = (seqs.lengths[rows] - 1)[:, None]  # [M, 1]: r'
    last = context.gather(1, last_index)  # [M, 1]
    steps = torch.arange(context.shape[1], device=context.device)[None, :]  # [1, C]
    earlier = (context == last) & (steps < last_index)  # [M, C]: earlier occurrences of r'
    at = torch.where(earlier, steps, -1).amax(dim=1, keepdim=True)  # [M, 1]: the last one, -1 if none
    follow = at + 1 + steps[:, :k]  # [M, k]: the tokens after the last earlier r'
    valid = (at >= 0) & (follow <= last_index)  # within the context, r' included
    tokens = torch.where(valid, context.gather(1, follow.clamp_max(context.shape[1] - 1)), last)  # [M, k]
    probs = one_hot_proposal(tokens, vocab_size) if temperature > 0 else None
    return tokens, probs


AUTO_NEURAL_MAX_BATCH = 8  # the paper: neural fallback pays at small batch, fast at large
WINDOW = 32  # the running means cover this many of the latest measurements of each kind
EXPLORE_EVERY = 8  # after this many fallback rounds of one kind in a row, the other kind is taken once


class FallbackPolicy:
    """``auto``: per round the fallback with the higher expected tokens per second, exploring the other:
    neural ``acc_neural / (T_verify + T_neural)``, fast ``acc_fast / T_verify``, means of the latest
    :data:`WINDOW`. The first miss takes the batch's kind (neural up to :data:`AUTO_NEURAL_MAX_BATCH` rows),
    the second the other, and every :data:`EXPLORE_EVERY` rounds of one kind the other once. :meth:`choose`
    only reads; the server reports :meth:`took` and :meth:`observe_round`."""

    def __init__(self, kind: str, batch: int, fixed_costs: tuple | None = None, timed: bool = True):
        """``fixed_costs = (T_verify, T_neural)`` replaces measured times; ``timed=False`` without them keeps
        the batch-size choice: either way outcomes alone decide (sampled: a seed fixes the tokens)."""
        self.kind = kind
        self.batch = batch
        self.fixed_costs = fixed_costs
        self.timed = timed
        self.accepted = {name: deque(maxlen=WINDOW) for name in FALLBACK_KINDS}  # tokens decided per row
        self.neural_s: deque = deque(maxlen=WINDOW)
        self.verify_s: deque = deque(maxlen=WINDOW)
        self.streak = (None, 0)  # (the kind the latest fallback rounds took, how many in a row)
        self._neural_pending: list = []  # neural fallbacks' Intervals (runtime.base.timing) not read yet

    def observe_round(self, sources: list, accepted: list, verify_s: float) -> None:
        """A verified round: row ``b``'s speculation came from ``sources[b]`` and accepted ``accepted[b]``
        (None: inactive); fallback rows add ``a + 1`` to their kind's mean. The verify took ``verify_s``."""
        self.verify_s.append(verify_s)
        for kind, a in zip(sources, accepted):
            if a is not None and kind in self.accepted:
                self.accepted[kind].append(a + 1)

    def took(self, kind: str) -> None:
        """A fallback round took ``kind``."""
        last, count = self.streak
        self.streak = (kind, count + 1 if kind == last else 1)

    def mean_accepted(self, kind: str, default: float | None = None) -> float | None:
        lengths = self.accepted[kind]
        return sum(lengths) / len(lengths) if lengths else default

    def time_neural(self, interval) -> list:
        """Queue a neural fallback's device-time ``Interval``; the seconds of those queued that are ready now
        (added to ``neural_s``), oldest first: never a wait for the device."""
        self._neural_pending.append(interval)
        ready = []
        while self._neural_pending and self._neural_pending[0].ready():
            ready.append(self._neural_pending.pop(0).seconds)
        self.neural_s.extend(ready)
        return ready

    def choose(self) -> str:
        """The kind the next miss takes (reads only: the same answer until something is observed)."""
        if self.kind != "auto":
            return self.kind
        tried = {kind for kind, lengths in self.accepted.items() if lengths}
        if not tried or (not self.timed and self.fixed_costs is None):
            return "neural" if self.batch <= AUTO_NEURAL_MAX_BATCH else "fast"
        if len(tried) == 1:  # explore the other kind once
            return "fast" if "neural" in tried else "neural"
        last, count = self.streak
        if count >= EXPLORE_EVERY:  # keep exploring: the other kind's mean may be out of date
            return "fast" if last == "neural" else "neural"
        if self.fixed_costs is not None:
            t_verify, t_neural = self.fixed_costs
        elif self.neural_s and self.verify_s:
            t_verify, t_neural = (
                sum(self.verify_s) / len(self.verify_s),
                sum(self.neural_s) / len(self.neural_s),
            )
        else:
            return "neural"
        # acc_neural / (T_verify + T_neural) >= acc_fast / T_verify, without dividing by a zero cost
        neural_wins = self.mean_accepted("neural") * t_verify >= self.mean_accepted("fast") * (
            t_verify + t_neural
        )
        return "neural" if neural_wins else "fast"
