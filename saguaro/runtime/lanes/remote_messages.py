"""The remote lane's messages: each :class:`Method`'s arguments and result as fixed-layout tensors.

Codes: ``POST + i`` runs method ``i`` of :data:`METHODS`, ``CALL + i`` runs it and replies ``REPLY + i``
or ``ERROR``, ``BYE`` ends the connection. Receivers check every value against :class:`Bounds`
(``WireError``); text travels only as trace events (:func:`check_trace_part`) and error messages."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import torch

from saguaro.runtime.base.stats import FALLBACK_KINDS, SOURCES
from saguaro.runtime.base.wire import WireError
from saguaro.runtime.draft.planner import StageCosts
from saguaro.runtime.draft.server import GenerateSpec, Lookup, Speculation
from saguaro.runtime.lanes.protocol import Method

METHODS = tuple(Method)  # a method's index is its number on the wire
POST, CALL, REPLY = 16, 32, 48
ERROR, BYE = 64, 65
REQUESTS = frozenset(range(POST, POST + len(METHODS))) | frozenset(range(CALL, CALL + len(METHODS))) | {BYE}
MAX_BATCH = 1024
MAX_EOS = 64
MAX_TEXT = 1 << 26  # bytes of a trace's JSON or an error message
I64, F64 = torch.long, torch.float64


@dataclass
class Bounds:
    """What a receiver accepts: the draft's ``vocab``, ``k``, ``max_capacity`` (KV slots) and, once a
    generation is open, its ``batch``."""

    vocab: int
    k: int
    max_capacity: int
    batch: int | None = None


def _tensor(message_tensors: list, i: int, dtypes, ndim: int, what: str) -> torch.Tensor:
    t = message_tensors[i] if i < len(message_tensors) else None
    if t is None or t.dtype not in dtypes or t.dim() != ndim:
        raise WireError(
            f"{what}: expected a {ndim}-d tensor of {dtypes}, got "
            f"{None if t is None else (t.dtype, tuple(t.shape))}"
        )
    return t


def _ids(t: torch.Tensor, vocab: int, what: str) -> torch.Tensor:
    if t.numel() and not bool(((t >= 0) & (t < vocab)).all()):
        raise WireError(f"{what}: token ids outside [0, {vocab})")
    return t


def _count(expected: int, message_tensors: list, what: str) -> None:
    if len(message_tensors) != expected:
        raise WireError(f"{what}: expected {expected} tensors, got {len(message_tensors)}")


# --- requests: client -> server -------------------------------------------------------------------


def encode_costs(costs: StageCosts | None) -> torch.Tensor:
    """``[N, 3]`` float64 rows ``(kind, branches, seconds)``: 0 glue, 1 step, 2 tree depth, 3 verify."""
    rows = [(0, 0, costs.glue_s), (1, 0, costs.step_s)] if costs is not None else []
    if costs is not None:
        rows += [(2, m, s) for m, s in costs.tree_s.items()] + [(3, m, s) for m, s in costs.verify_s.items()]
    return torch.tensor([r for r in rows if r[2] is not None], dtype=F64, device="cpu").reshape(-1, 3)


def decode_costs(t: torch.Tensor) -> StageCosts:
    if t.dim() != 2 or t.shape[1] != 3 or t.shape[0] > 1024 or not bool(torch.isfinite(t).all()):
        raise WireError(f"stage costs: expected [N <= 1024, 3] finite numbers, got {tuple(t.shape)}")
    costs = StageCosts()
    for kind, m, s in t.tolist():
        if kind not in (0, 1, 2, 3) or m != int(m) or not 0 <= m <= 1 << 16 or s < 0:
            raise WireError(f"stage costs: bad row ({kind}, {m}, {s})")
        if kind == 0:
            costs.glue_s = s
        elif kind == 1:
            costs.step_s = s
        else:
            (costs.tree_s if kind == 2 else costs.verify_s)[int(m)] = s
    return costs


def encode_spec(spec: GenerateSpec) -> list:
    seed = spec.seed if spec.seed is not None else 0
    ints = torch.tensor(
        [
            spec.max_new_tokens,
            spec.capacity,
            spec.pad_token_id,
            seed,
            spec.seed is not None,
            spec.plan_costs is not None,
        ],
        dtype=I64,
        device="cpu",
    )  # [6]
    return [
        spec.input_ids.long().cpu(),
        spec.attention_mask.long().cpu(),
        ints,
        torch.tensor(list(spec.eos_token_ids), dtype=I64, device="cpu"),
        torch.tensor([spec.temperature], dtype=F64, device="cpu"),
        encode_costs(spec.plan_costs),
    ]


def decode_spec(ts: list, bounds: Bounds) -> GenerateSpec:
    ids = _tensor(ts, 0, (I64,), 2, "input_ids")
    mask = _tensor(ts, 1, (I64,), 2, "attention_mask")
    ints = _tensor(ts, 2, (I64,), 1, "spec numbers")
    eos = _tensor(ts, 3, (I64,), 1, "eos ids")
    temperature = _tensor(ts, 4, (F64,), 1, "temperature")
    B, T = ids.shape
    if (
        mask.shape != ids.shape
        or not 1 <= B <= MAX_BATCH
        or T < 1
        or ints.numel() != 6
        or eos.numel() > MAX_EOS
        or temperature.numel() != 1
    ):
        raise WireError(
            f"generate spec: bad sizes (ids {tuple(ids.shape)}, mask {tuple(mask.shape)}, "
            f"{ints.numel()} numbers, {eos.numel()} eos ids; batch at most {MAX_BATCH})"
        )
    _ids(ids, bounds.vocab, "input_ids")
    _ids(eos, bounds.vocab, "eos ids")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise WireError("attention_mask holds values other than 0 and 1")
    max_new, capacity, pad, seed, has_seed, has_costs = ints.tolist()
    t = float(temperature[0])
    if not (
        1 <= max_new <= capacity
        and T + max_new <= capacity <= bounds.max_capacity
        and 0 <= pad < bounds.vocab
        and seed >= 0
        and has_seed in (0, 1)
        and has_costs in (0, 1)
        and math.isfinite(t)
        and 0 <= t <= 1e3
    ):
        raise WireError(
            f"generate spec: a number out of range (max_new_tokens {max_new}, capacity {capacity} of "
            f"at most {bounds.max_capacity}, pad {pad}, seed {seed}, temperature {t})"
        )
    if has_seed != (t > 0):
        raise WireError("generate spec: a seed is sent exactly when sampling")
    costs = decode_costs(_tensor(ts, 5, (F64,), 2, "stage costs")) if has_costs else None
    return GenerateSpec(ids, mask, max_new, capacity, eos.tolist(), pad, t, seed if has_seed else None, costs)


def sent_batch(bounds: Bounds, method: Method, args: tuple) -> None:
    """The caller's side of the batch a message changes (the receiver's changes in :func:`decode_args`)."""
    if method in (Method.OPEN, Method.WARM_UP):
        bounds.batch = args[0].input_ids.shape[0]
    elif method is Method.JOIN_ROWS and bounds.batch is not None:
        bounds.batch += 1
    elif method is Method.KEEP_ROWS:
        bounds.batch = len(args[0])


def encode_args(method: Method, args: tuple) -> list:
    if method is Method.OPEN:
        return encode_spec(args[0])
    if method is Method.KEEP_ROWS:
        return [torch.tensor(list(args[0]), dtype=I64, device="cpu")]
    if method in (Method.WARM_UP, Method.JOIN_ROWS):
        return encode_spec(args[0]) + [args[1].long().cpu()]
    if method is Method.START:
        return [args[0].long().cpu()]
    if method is Method.MATCH:
        accepted, outcome, verify_s = args
        return [
            torch.tensor(
                [[-1 if a is None else a for a in accepted], list(outcome)], dtype=I64, device="cpu"
            ),
            torch.tensor([verify_s], dtype=F64, device="cpu"),
        ]
    if method is Method.FALLBACK:
        return [torch.tensor([bool(m) for m in args[0]], dtype=I64, device="cpu")]
    if method is Method.BUILD_BUDGET:
        return [torch.tensor([-1 if args[0] is None else args[0]], dtype=I64, device="cpu")]
    return []  # BUILD, FINISHED, TRACE_START, TRACE_TAKE, PLAN_COSTS: no arguments


def decode_args(method: Method, ts: list, bounds: Bounds) -> tuple:
    """The arguments of ``method`` from a request's tensors, checked (``bounds.batch`` is set by OPEN
    and WARM_UP, grows by one with JOIN_ROWS and is the rows kept after KEEP_ROWS)."""
    if method in (Method.OPEN, Method.WARM_UP):
        _count(6 if method is Method.OPEN else 7, ts, method.value)
        spec = decode_spec(ts, bounds)
        bounds.batch = spec.input_ids.shape[0]
        if method is Method.OPEN:
            return (spec,)
        first = _ids(_tensor(ts, 6, (I64,), 1, "first tokens"), bounds.vocab, "first tokens")
        if first.numel() != bounds.batch:
            raise WireError(f"warm_up: {first.numel()} first tokens for a batch of {bounds.batch}")
        return spec, first
    if method in (Method.BUILD, Method.FINISHED, Method.TRACE_START, Method.TRACE_TAKE, Method.PLAN_COSTS):
        _count(0, ts, method.value)
        return ()
    if bounds.batch is None:
        raise WireError(f"{method.value} before any generation was opened")
    B = bounds.batch
    if method is Method.JOIN_ROWS:
        _count(7, ts, "join_rows")
        spec = decode_spec(ts, bounds)
        first = _ids(_tensor(ts, 6, (I64,), 1, "first tokens"), bounds.vocab, "first tokens")
        if spec.input_ids.shape[0] != 1 or first.numel() != 1 or B + 1 > MAX_BATCH:
            raise WireError(
                f"join_rows: one row and one first token, up to a batch of {MAX_BATCH}; got "
                f"{spec.input_ids.shape[0]} rows and {first.numel()} tokens onto {B}"
            )
        bounds.batch = B + 1
        return spec, first
    if method is Method.KEEP_ROWS:
        _count(1, ts, "keep_rows")
        rows = _tensor(ts, 0, (I64,), 1, "kept rows").tolist()
        if not rows or sorted(set(rows)) != rows or not 0 <= rows[0] <= rows[-1] < B:
            raise WireError(f"keep_rows: expected increasing row indices in [0, {B}), at least one")
        bounds.batch = len(rows)
        return (rows,)
    if method is Method.START:
        _count(1, ts, "start")
        first = _ids(_tensor(ts, 0, (I64,), 1, "first tokens"), bounds.vocab, "first tokens")
        if first.numel() != B:
            raise WireError(f"start: {first.numel()} first tokens for a batch of {B}")
        return (first,)
    if method is Method.MATCH:
        _count(2, ts, "match")
        pair = _tensor(ts, 0, (I64,), 2, "outcome")
        verify_s = _tensor(ts, 1, (F64,), 1, "verify seconds")
        if tuple(pair.shape) != (2, B) or verify_s.numel() != 1 or not 0 <= float(verify_s[0]) < 1e6:
            raise WireError(f"match: outcome {tuple(pair.shape)} for a batch of {B}, or a bad verify time")
        accepted, outcome = pair.tolist()
        if any(not -1 <= a <= bounds.k for a in accepted) or any(not 0 <= r < bounds.vocab for r in outcome):
            raise WireError(f"match: accepted counts outside -1..{bounds.k} or tokens outside the vocabulary")
        return [None if a < 0 else a for a in accepted], outcome, float(verify_s[0])
    if method is Method.FALLBACK:
        _count(1, ts, "fallback")
        missed = _tensor(ts, 0, (I64,), 1, "missed rows").tolist()
        if len(missed) != B or any(m not in (0, 1) for m in missed):
            raise WireError(f"fallback: expected {B} flags of 0 or 1")
        return ([bool(m) for m in missed],)
    _count(1, ts, "build_budget")  # BUILD_BUDGET
    budget = _tensor(ts, 0, (I64,), 1, "budget").tolist()
    if len(budget) != 1 or not -1 <= budget[0] <= 1 << 16:
        raise WireError(f"build_budget: bad budget {budget}")
    return (None if budget[0] < 0 else budget[0],)


# --- results: server -> client --------------------------------------------------------------------


def _encode_speculation(s: Speculation) -> list:
    kind = -1 if s.fallback_kind is None else FALLBACK_KINDS.index(s.fallback_kind)
    return [s.tokens, s.probs, torch.tensor(list(s.source) + [kind], dtype=I64, device="cpu")]


def _decode_speculation(ts: list, bounds: Bounds, device: torch.device) -> Speculation:
    B, k = bounds.batch, bounds.k
    tokens = _ids(_tensor(ts, 0, (I64,), 2, "speculation tokens"), bounds.vocab, "speculation tokens")
    probs = ts[1]
    meta = _tensor(ts, 2, (I64,), 1, "speculation sources").tolist()
    if tuple(tokens.shape) != (B, k) or len(meta) != B + 1:
        raise WireError(
            f"speculation: tokens {tuple(tokens.shape)} / {len(meta) - 1} sources, expected ({B}, {k})"
        )
    if probs is not None and (not probs.is_floating_point() or tuple(probs.shape) != (B, k, bounds.vocab)):
        raise WireError(
            f"speculation: probabilities {probs.dtype} {tuple(probs.shape)}, expected [{B}, {k}, "
            f"{bounds.vocab}] floats"
        )
    if any(not 0 <= c < len(SOURCES) for c in meta[:-1]) or not -1 <= meta[-1] < len(FALLBACK_KINDS):
        raise WireError(f"speculation: bad source codes {meta}")
    kind = None if meta[-1] < 0 else FALLBACK_KINDS[meta[-1]]
    return Speculation(tokens.to(device), None if probs is None else probs.to(device), meta[:-1], kind)


def encode_result(method: Method, result) -> list:
    if method in (Method.START, Method.FALLBACK, Method.JOIN_ROWS):
        return _encode_speculation(result)
    if method is Method.MATCH:
        hit = torch.tensor([bool(h) for h in result.hit], dtype=I64, device="cpu")  # [B]
        return _encode_speculation(result.speculation) + [hit]
    if method in (Method.WARM_UP, Method.PLAN_COSTS):
        return [] if result is None else [encode_costs(result)]
    if method is Method.FINISHED:
        return [torch.tensor([bool(result)], dtype=I64, device="cpu")]
    if method is Method.TRACE_TAKE:
        return [] if result is None else [encode_text(json.dumps(result, default=float))]
    return []


def decode_result(method: Method, ts: list, bounds: Bounds, device: torch.device):
    """The result of ``method`` from a reply's tensors, checked; tensors moved to ``device``."""
    if method in (Method.START, Method.FALLBACK):
        _count(3, ts, method.value)
        return _decode_speculation(ts, bounds, device)
    if method is Method.JOIN_ROWS:  # the joining row's speculation alone
        _count(3, ts, method.value)
        return _decode_speculation(ts, replace(bounds, batch=1), device)
    if method is Method.MATCH:
        _count(4, ts, "match")
        hit = _tensor(ts, 3, (I64,), 1, "hits").tolist()
        if len(hit) != bounds.batch or any(h not in (0, 1) for h in hit):
            raise WireError(f"match: expected {bounds.batch} hit flags of 0 or 1")
        return Lookup([bool(h) for h in hit], _decode_speculation(ts, bounds, device))
    if method in (Method.WARM_UP, Method.PLAN_COSTS):
        return decode_costs(_tensor(ts, 0, (F64,), 2, "stage costs")) if ts else None
    if method is Method.FINISHED:
        _count(1, ts, "finished")
        flag = _tensor(ts, 0, (I64,), 1, "finished").tolist()
        if flag not in ([0], [1]):
            raise WireError(f"finished: bad flag {flag}")
        return bool(flag[0])
    if method is Method.TRACE_TAKE:
        return check_trace_part(json.loads(decode_text(ts[0], "trace"))) if ts else None
    _count(0, ts, method.value)
    return None


def encode_text(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")[:MAX_TEXT]), dtype=torch.uint8)  # [bytes]


def decode_text(t, what: str) -> str:
    if t is None or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_TEXT:
        raise WireError(f"{what}: expected a 1-d uint8 text of at most {MAX_TEXT} bytes")
    return bytes(t.cpu().tolist()).decode("utf-8", errors="replace")


TRACE_PHASES = frozenset("BECi")


def check_trace_part(part) -> dict:
    """A draft server's trace events (``TraceRecorder.take``'s dict) with every field checked, plain
    numbers and short strings only; ``WireError`` otherwise."""

    def short(s):
        return isinstance(s, str) and len(s) <= 256

    ok = (
        isinstance(part, dict)
        and set(part) == {"pid", "process", "events"}
        and isinstance(part["pid"], int)
        and short(part["process"])
        and isinstance(part["events"], list)
    )
    for event in part["events"] if ok else ():
        args = event[4] if isinstance(event, list) and len(event) == 5 else None
        ok = (
            isinstance(event, list)
            and len(event) == 5
            and event[0] in TRACE_PHASES
            and short(event[1])
            and short(event[2])
            and isinstance(event[3], int)
            and (
                args is None
                or (
                    isinstance(args, dict)
                    and len(args) <= 64
                    and all(
                        short(key) and (isinstance(v, (int, float)) or short(v)) for key, v in args.items()
                    )
                )
            )
        )
        if not ok:
            break
    if not ok:
        raise WireError("the draft server's trace events do not have the expected form")
    part["events"] = [tuple(e) for e in part["events"]]
    return part
