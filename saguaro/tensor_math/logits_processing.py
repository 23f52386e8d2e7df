"""Sampling controls: what a request asks of the target's next-token distribution beyond a temperature
(``logit_bias``, repetition / presence / frequency penalties, ``top_k``, ``top_p``, ``min_p``), as plain tensor
functions over logits.

The processed distribution of a position is defined once, here, and every path samples from it: the prefill's
first token, AR's step, and the verification of SD's and SSD's speculations (hits and both fallbacks), whose
acceptance test and residual use the processed ``p`` of each position against the ``q`` the proposal was actually
drawn from, so the output distribution is exactly the target's own processed sampling. The order, as vLLM's:

1. ``logit_bias``: ``logits[t] += bias[t]``;
2. ``repetition_penalty`` ``r`` over every token of the sequence so far (prompt and output), as ``transformers``'
   ``RepetitionPenaltyLogitsProcessor``: a seen token's logit divided by ``r`` where positive, times ``r`` where not;
3. ``presence_penalty`` ``a`` and ``frequency_penalty`` ``f`` over the output's tokens (not the prompt's), as
   OpenAI's: ``logits[t] -= f * count[t] + a * (count[t] > 0)``;
4. the temperature ``T``: ``logits / T`` (greedy, ``T = 0``, takes the argmax of step 3's logits: the filters below
   keep the argmax);
5. ``top_k`` ``K`` (0: off): the tokens whose logit is below the ``K``-th largest are removed (ties at the ``K``-th
   kept);
6. ``top_p`` ``P`` (1: off): over the probabilities sorted descending (ties by token id), a token is kept while the
   mass before it is below ``P`` (the most probable always kept);
7. ``min_p`` ``M`` (0: off): tokens whose probability is below ``M`` times the largest are removed.

Removed tokens get probability exactly 0. "The sequence so far" of a speculated position includes the draft tokens
before it on its path: position ``i`` of a verify over ``[r, x_1..x_k]`` counts ``x_1..x_i``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100..100
FIELDS = ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


class ControlError(ValueError):
    """A control outside its range: ``field`` names it (``"top_p"``, ``"logit_bias"``, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingControls:
    """One request's controls (the defaults leave the distribution as the temperature makes it).

    ``logit_bias`` maps token ids to a bias in -100..100. :meth:`check` raises :class:`ControlError` (a
    ``ValueError``) naming the field and what is allowed."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = field(default_factory=tuple)  # ((token id, bias), ...), sorted: hashable

    @staticmethod
    def of(top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
           logit_bias=None) -> "SamplingControls":
        """The controls from plain values (``logit_bias`` a ``{token id: bias}`` mapping, keys ints or digit
        strings, as JSON sends them), checked by :meth:`check` (without a vocabulary)."""
        if logit_bias is not None and not isinstance(logit_bias, dict):
            raise ControlError("logit_bias", f"logit_bias={logit_bias!r} is not allowed: give an object of token id "
                               "to bias")
        bias = []
        for key, value in (logit_bias or {}).items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ControlError("logit_bias", f"logit_bias key {key!r} is not allowed: keys are token ids") from None
            bias.append((token, value))
        controls = SamplingControls(top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty,
                                    tuple(sorted(bias)))
        controls.check()
        return controls

    def check(self, vocab_size: int | None = None) -> None:
        """Raise :class:`ControlError` naming the first field outside its range (``vocab_size``: token ids below it)."""
        def number(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ControlError("top_k", f"top_k={self.top_k!r} is not allowed: it must be an integer >= 0 (0 or -1: off)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise ControlError("top_p", f"top_p={self.top_p!r} is not allowed: it must be a number in (0, 1]")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ControlError("min_p", f"min_p={self.min_p!r} is not allowed: it must be a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2 <= value <= 2:
                raise ControlError(name, f"{name}={value!r} is not allowed: it must be a number in [-2, 2]")
        if not number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ControlError("repetition_penalty", f"repetition_penalty={self.repetition_penalty!r} is not allowed: it must be a number "
                             "in (0, 10]")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                    (vocab_size is not None and token >= vocab_size):
                allowed = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative"
                raise ControlError("logit_bias", f"logit_bias token id {token!r} is not allowed: ids are {allowed}")
            if not number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ControlError("logit_bias", f"logit_bias[{token}]={bias!r} is not allowed: it must be a number in -100..100")

    @property
    def active(self) -> bool:
        """Whether the controls change any distribution (False: the temperature alone decides)."""
        return self != SamplingControls()

    @property
    def changes_argmax(self) -> bool:
        """Whether greedy decoding under the controls may pick another token than the logits' argmax (bias and
        penalties move logits; the filters keep the argmax)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 or \
            self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def token_counts(tokens: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``counts [B, V]`` float32: how often each token id occurs in ``tokens [B, L]`` where ``valid [B, L]``."""
    counts = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens, valid.to(torch.float32))


def path_counts(counts: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``counts [B, V]`` of the committed sequence, extended along a speculation ``draft_tokens [B, K]``:
    ``[B, K+1, V]`` whose row ``i`` adds ``x_1..x_i`` (row 0: the committed counts)."""
    B, K = draft_tokens.shape
    V = counts.shape[-1]
    steps = torch.zeros(B, K + 1, V, dtype=counts.dtype, device=counts.device)
    if K:
        steps[:, 1:].scatter_(2, draft_tokens[:, :, None], 1.0)
    return counts[:, None, :] + steps.cumsum(dim=1)


def penalized(logits: torch.Tensor, controls: SamplingControls, seen: torch.Tensor | None,
              output_counts: torch.Tensor | None) -> torch.Tensor:
    """Steps 1-3: ``logits [..., V]`` float32 with the bias and the penalties; ``seen [..., V]`` the counts of
    every token of the sequence so far, ``output_counts [..., V]`` those of the output's (both None when the
    controls need no history)."""
    out = logits.float().clone()
    if controls.logit_bias:
        ids = torch.tensor([t for t, _ in controls.logit_bias], device=out.device)
        values = torch.tensor([b for _, b in controls.logit_bias], dtype=out.dtype, device=out.device)
        out[..., ids] += values
    if controls.repetition_penalty != 1:
        r = controls.repetition_penalty
        out = torch.where(seen > 0, torch.where(out > 0, out / r, out * r), out)
    if controls.frequency_penalty != 0 or controls.presence_penalty != 0:
        out = out - controls.frequency_penalty * output_counts - controls.presence_penalty * (output_counts > 0)
    return out


def filtered_probabilities(logits: torch.Tensor, temperature: float, controls: SamplingControls) -> torch.Tensor:
    """Steps 4-7 over penalized ``logits [..., V]``: the processed distribution ``[..., V]`` float32 (rows sum
    to 1; removed tokens exactly 0). ``temperature`` > 0."""
    scaled = logits / temperature
    if controls.top_k > 0 and controls.top_k < scaled.shape[-1]:
        kth = scaled.topk(controls.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if controls.top_p < 1:
        order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = order.values.cumsum(dim=-1) - order.values  # the mass ahead of each token
        keep_sorted = before < controls.top_p
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order.indices, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    if controls.min_p > 0:
        probs = torch.where(probs >= controls.min_p * probs.amax(dim=-1, keepdim=True), probs, 0.0)
    if controls.top_p < 1 or controls.min_p > 0:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def processed_probabilities(logits: torch.Tensor, temperature: float, controls: SamplingControls,
                            seen: torch.Tensor | None = None,
                            output_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-7: the distribution a position samples from, ``[..., V]`` float32."""
    return filtered_probabilities(penalized(logits, controls, seen, output_counts), temperature, controls)


def processed_choice(logits: torch.Tensor, controls: SamplingControls, seen: torch.Tensor | None = None,
                     output_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy under the controls: the argmax of steps 1-3, ``[...]``."""
    return penalized(logits, controls, seen, output_counts).argmax(dim=-1)
