"""Sampling controls over logits: the one processed distribution every path samples from and verifies against.

Steps in vLLM's order, each defined at its line: 0-3 :func:`penalized` (0: a grammar's mask, ``allowed``),
4-7 :func:`filtered_probabilities`; removed tokens get probability exactly 0. A speculated position's history (its
counts, its grammar state) includes its path's draft tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100..100
MASK_FLOOR = 1e-30  # added to each allowed token's draft mass (a normal float32): no allowed row sums to 0
FIELDS = (
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "grammar",
)


class ControlError(ValueError):
    """A control outside its range: ``field`` names it (``"top_p"``, ``"logit_bias"``, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingControls:
    """One request's controls; the defaults leave the distribution as the temperature makes it."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = field(default_factory=tuple)  # ((token id, bias in ±MAX_LOGIT_BIAS), ...), sorted
    # a tensor_math.grammar.Grammar (compared by identity) the output must spell, or None
    grammar: object = None

    @staticmethod
    def of(
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
        grammar=None,
    ) -> SamplingControls:
        """Checked controls from plain values (``logit_bias``: ``{id: bias}``, ids ints or digit strings)."""
        if logit_bias is not None and not isinstance(logit_bias, dict):
            raise ControlError(
                "logit_bias", f"logit_bias={logit_bias!r} is not allowed: give an object of token id to bias"
            )
        bias = []
        for key, value in (logit_bias or {}).items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ControlError(
                    "logit_bias", f"logit_bias key {key!r} is not allowed: keys are token ids"
                ) from None
            bias.append((token, value))
        controls = SamplingControls(
            top_k,
            top_p,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            tuple(sorted(bias)),
            grammar,
        )
        controls.check()
        return controls

    def check(self, vocab_size: int | None = None) -> None:
        """Raise :class:`ControlError` naming the first field out of range (``vocab_size``: ids below it)."""

        def number(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ControlError(
                "top_k", f"top_k={self.top_k!r} is not allowed: it must be an integer >= 0 (0: off)"
            )
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise ControlError("top_p", f"top_p={self.top_p!r} is not allowed: it must be a number in (0, 1]")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ControlError("min_p", f"min_p={self.min_p!r} is not allowed: it must be a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2 <= value <= 2:
                raise ControlError(name, f"{name}={value!r} is not allowed: it must be a number in [-2, 2]")
        if not number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ControlError(
                "repetition_penalty",
                f"repetition_penalty={self.repetition_penalty!r} is not allowed: it must be a number "
                "in (0, 10]",
            )
        for token, bias in self.logit_bias:
            if (
                isinstance(token, bool)
                or not isinstance(token, int)
                or token < 0
                or (vocab_size is not None and token >= vocab_size)
            ):
                allowed = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative"
                raise ControlError(
                    "logit_bias", f"logit_bias token id {token!r} is not allowed: ids are {allowed}"
                )
            if not number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ControlError(
                    "logit_bias",
                    f"logit_bias[{token}]={bias!r} is not allowed: it must be a number in -100..100",
                )
        if self.grammar is not None and not callable(getattr(self.grammar, "start", None)):
            raise ControlError(
                "grammar", f"grammar={self.grammar!r} is not allowed: give a saguaro.Grammar (or None)"
            )
        if self.grammar is not None and vocab_size is not None and self.grammar.vocab_size != vocab_size:
            raise ControlError(
                "grammar",
                f"the grammar was built for {self.grammar.vocab_size} token ids; this model has {vocab_size}: "
                f"build it with vocab_size={vocab_size}",
            )

    @property
    def active(self) -> bool:
        """Whether the controls change any distribution (False: the temperature alone decides)."""
        return self != SamplingControls()

    @property
    def changes_argmax(self) -> bool:
        """Whether greedy decoding may pick another token than the argmax (a grammar, bias, penalties; not
        filters)."""
        return (
            self.grammar is not None
            or bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def needs_history(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def token_counts(tokens: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``counts [B, V]`` float32: how often each id occurs in ``tokens [B, L]`` where ``valid [B, L]``."""
    counts = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens, valid.to(torch.float32))


def path_counts(counts: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``counts [B, V]`` along ``draft_tokens [B, K]``: ``[B, K+1, V]``, row ``i`` adding ``x_1..x_i``."""
    B, K = draft_tokens.shape
    V = counts.shape[-1]
    steps = torch.zeros(B, K + 1, V, dtype=counts.dtype, device=counts.device)
    if K:
        steps[:, 1:].scatter_(2, draft_tokens[:, :, None], 1.0)
    return counts[:, None, :] + steps.cumsum(dim=1)


def penalized(
    logits: torch.Tensor,
    controls: SamplingControls,
    seen: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 0-3: ``logits [..., V]`` float32 with the grammar's mask, bias and penalties; ``seen`` /
    ``output_counts [..., V]``: token counts of the whole sequence / of the output (None where the controls need no
    history); ``allowed [..., V]`` bool: the tokens the grammar allows (None: no grammar; never all False)."""
    out = logits.float().clone()
    if allowed is not None:  # 0. tokens the grammar refuses: -inf, before any other step (as vLLM's bitmask)
        out = out.masked_fill(~allowed, -math.inf)
    if controls.logit_bias:  # 1. logits[t] += bias[t]
        ids = torch.tensor([t for t, _ in controls.logit_bias], device=out.device)
        values = torch.tensor([b for _, b in controls.logit_bias], dtype=out.dtype, device=out.device)
        out[..., ids] += values
    if controls.repetition_penalty != 1:  # 2. as transformers' RepetitionPenaltyLogitsProcessor, over the
        # prompt and output: a seen token's logit divided by r where positive, times r where not
        r = controls.repetition_penalty
        out = torch.where(seen > 0, torch.where(out > 0, out / r, out * r), out)
    if controls.frequency_penalty != 0 or controls.presence_penalty != 0:
        # 3. OpenAI's frequency f and presence a, over the output only:
        # logits[t] -= f * count[t] + a * (count[t] > 0)
        out = (
            out - controls.frequency_penalty * output_counts - controls.presence_penalty * (output_counts > 0)
        )
    return out


def filtered_probabilities(
    logits: torch.Tensor, temperature: float, controls: SamplingControls
) -> torch.Tensor:
    """Steps 4-7 over penalized ``logits [..., V]`` at ``temperature`` > 0: rows of float32 summing to 1."""
    scaled = logits / temperature  # 4. (greedy takes step 3's argmax: the filters below keep it)
    # 5. top_k K (0: off): logits below the K-th largest removed, ties at the K-th kept
    if controls.top_k > 0 and controls.top_k < scaled.shape[-1]:
        kth = scaled.topk(controls.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if controls.top_p < 1:  # 6. sorted descending (ties by id), kept while the mass before is below P: the
        # most probable always
        probs = torch.where(nucleus(probs, controls.top_p), probs, 0.0)
    if controls.min_p > 0:  # 7. below min_p times the largest probability removed
        probs = torch.where(probs >= controls.min_p * probs.amax(dim=-1, keepdim=True), probs, 0.0)
    if controls.top_p < 1 or controls.min_p > 0:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


TOP_P_CANDIDATES = 128  # the most probable tokens a row's nucleus is first looked for among
TOP_P_MARGIN = 1e-5  # the mass ahead of the last candidate must pass P by this: the tokens after it are out


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Step 6's kept tokens, bool ``[..., V]``: in ``probs``' descending order (a stable sort: ties by id), each
    token whose mass before it is below ``top_p``. A row whose nucleus ends among its :data:`TOP_P_CANDIDATES` most
    probable tokens is found there (the same sums, so the same tokens as the full sort); the others by the full
    sort."""
    shape, V = probs.shape, probs.shape[-1]
    rows = probs.reshape(-1, V)  # [N, V]
    m = min(TOP_P_CANDIDATES, V)
    if m == V:
        return sorted_nucleus(rows, top_p).reshape(shape)
    values = rows.topk(m, dim=-1, sorted=True).values  # [N, m] descending
    before = values.cumsum(dim=-1) - values  # as the full sort's first m
    kept = before < top_p  # [N, m]
    count = kept.sum(dim=-1, keepdim=True)  # [N, 1], at least 1
    prefix = torch.arange(m, device=probs.device) < count
    found = (kept == prefix).all(dim=-1) & (before[:, -1] >= top_p + TOP_P_MARGIN)  # [N]
    boundary = values.gather(-1, count - 1)  # [N, 1] the least probable kept
    above, tied = rows > boundary, rows == boundary
    room = count - above.sum(dim=-1, keepdim=True)  # tied tokens kept, the lowest ids
    keep = above | (tied & (tied.cumsum(dim=-1) <= room))  # [N, V]
    if not bool(found.all()):
        rest = (~found).nonzero().squeeze(-1)  # [R]
        keep[rest] = sorted_nucleus(rows[rest], top_p)
    return keep.reshape(shape)


def sorted_nucleus(rows: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`nucleus` of ``rows [N, V]`` by a full stable sort."""
    order = torch.sort(rows, dim=-1, descending=True, stable=True)
    keep_sorted = order.values.cumsum(dim=-1) - order.values < top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order.indices, keep_sorted)


def processed_probabilities(
    logits: torch.Tensor,
    temperature: float,
    controls: SamplingControls,
    seen: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 0-7: the distribution a position samples from, ``[..., V]`` float32."""
    return filtered_probabilities(
        penalized(logits, controls, seen, output_counts, allowed), temperature, controls
    )


def processed_choice(
    logits: torch.Tensor,
    controls: SamplingControls,
    seen: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy under the controls: the argmax of steps 0-3, ``[...]``."""
    return penalized(logits, controls, seen, output_counts, allowed).argmax(dim=-1)


def masked_distribution(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``probs [..., V]`` float32 restricted to ``allowed [..., V]`` (never all False) and renormalised, each allowed
    token's mass raised by :data:`MASK_FLOOR` first (a row that gives the allowed tokens no mass: uniform over them):
    the distribution a draft proposes from under a grammar, and so the ``q`` its tokens are verified against."""
    kept = (probs.float() + MASK_FLOOR) * allowed
    return kept / kept.sum(dim=-1, keepdim=True)
