"""Continuous batching at round granularity: a :class:`BatchSession` lets rows join and leave a running
batch between rounds; ``saguaro serve``'s scheduler runs one per temperature.

Invariant: each row gets the tokens ``generate`` gives its request alone. ``join`` prefills it alone as
``generate`` would; ``step`` runs the decoders' own round functions, each sampled row drawing from its own
generator. Mode ``ssd`` (:mod:`saguaro.runtime.batching_ssd`) takes greedy and unseeded sampled rows only.
Design: docs/design.md, ``runtime/batching.py``.
"""

from __future__ import annotations

import collections
import itertools
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from saguaro.core.stages import TARGET_ROUND, TARGET_VERIFY_LOGITS
from saguaro.runtime.base.inputs import checked_controls, validate_call
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import Counters, seconds_since
from saguaro.runtime.batching_in_place import free_slot, replace_row
from saguaro.runtime.batching_ssd import SessionLane, rows_to_sd
from saguaro.runtime.decode.ar import round_by_step, round_in_graph
from saguaro.runtime.decode.controlled import grammar_rows, in_effect
from saguaro.runtime.decode.prefill import prefill
from saguaro.runtime.decode.sd import draft_speculation, verify_and_commit
from saguaro.runtime.lanes.protocol import DraftLaneError
from saguaro.runtime.speculation_length import SpeculationLength

SESSION_MODES = ("ar", "sd", "ssd")
K_CHOICES = ("measured", "fixed")  # how an SD round's k is chosen: runtime/speculation_length.py, or config.k


@dataclass(frozen=True)
class RowTokens:
    """What one row gained: ``row`` (the id :meth:`BatchSession.join` gave), its ``new_tokens`` (cut at
    its ``max_new_tokens``), and ``finished`` (EOS or budget: it leaves before the next round); from
    :meth:`BatchSession.join`, ``prefix_cached``: the prompt tokens whose KV came from the prefix cache."""

    row: int
    new_tokens: list
    finished: bool
    prefix_cached: int = 0


@dataclass
class _Row:
    id: int
    budget: int  # max_new_tokens
    emitted: int  # tokens of its buffer row handed out (the padded prompt's included)
    generated: int  # new tokens handed out
    capacity: int  # the store slots its generation needs, counted from its row's first column
    generator: torch.Generator | None
    prompt_end: int = 0  # its buffer row's first output column (the padded prompt's width)
    seeded: bool = False  # sampled with a caller's seed: its tokens are generate's at the program's k


class BatchSession:
    """The running batch of one ``temperature`` in ``mode`` ``ar``, ``sd`` or ``ssd`` (default: the
    program's) over a :class:`~saguaro.runtime.program.Program`. Each call holds the Program's lock, so
    other threads' ``generate`` calls run between rounds. One thread drives a session.

    ``k_choice``: ``"measured"`` (default) lets SD's rounds draft the ``k`` in ``1..config.k`` that measured the
    most tokens a second at the batch's size (:mod:`saguaro.runtime.speculation_length`; one choice per kind of
    session, kept by the program), except while a seeded sampled row runs; ``"fixed"``: ``config.k`` always."""

    def __init__(
        self,
        program,
        temperature: float = 0.0,
        mode: str | None = None,
        controls=None,
        k_choice: str = "measured",
    ):
        mode = mode or program.config.mode
        if mode not in SESSION_MODES:
            raise ValueError(
                f"mode={mode!r} is not allowed for a batch session: choose one of {', '.join(SESSION_MODES)}"
            )
        if mode == "sd" and program.draft is None:
            raise ValueError("mode='sd' needs a local draft model; compile with draft=... or use mode='ar'")
        if mode == "ssd" and program.lanes is None:
            raise ValueError(
                "mode='ssd' needs a draft model (local or a draft server); compile with draft=..."
            )
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} is not allowed: it must be a finite number >= 0")
        if k_choice not in K_CHOICES:
            raise ValueError(f"k_choice={k_choice!r} is not allowed: choose one of {', '.join(K_CHOICES)}")
        self.controls = checked_controls(controls, program.target.spec.vocab_size)
        self.lengths = None  # the program's measured choice for this kind of round; None: config.k
        if k_choice == "measured":  # kept by the program: a later session starts from what this one measured
            controlled = None if self.controls is None else self.controls.grammar is not None
            kind = (temperature > 0, controlled)  # sampled; no controls / controls / a grammar: bounded
            self.lengths = program.speculation_lengths.setdefault(kind, SpeculationLength(program.config.k))
        if self.controls is not None and mode != "ar" and not program.can_control:
            raise ValueError(
                "controls: this program's target has no target.verify_logits stage (a loaded artifact); "
                "use mode='ar' or compile the models with saguaro.compile"
            )
        self.program = program
        self.mode = mode
        self.temperature = float(temperature)
        self.run = mode  # the rounds run (ssd: as planned at the first row), and why
        self.why = f"mode {mode} asked"
        if mode == "ssd" and getattr(self.controls, "grammar", None) is not None:
            self.run, self.why = "sd", "a grammar: SSD's draft lane cannot carry its state, SD's rounds run"
        self.lanes_failed = 0  # ssd: lanes that failed under this session (its rows went on with SD)
        self.ssd = SessionLane(program, self) if mode == "ssd" else None
        self.counters = Counters(program.config.k)  # the last round's only: bounded memory
        self.rows: list[_Row] = []
        self.state: DecodeState | None = None
        self.joined = self.left_early = 0  # rows spliced in; rows dropped before their end (leave)
        self._leaving: set = set()  # ids of rows gone from the batch: left early (leave) ...
        self._ended: set = set()  # ... or ended (EOS, budget); their places held until taken or narrowed
        self._vacated: set = set()  # ids of gone rows whose device rows are marked finished
        self._ids = itertools.count()
        self._launch = None  # AR's round over the current rows (rebuilt when they change)
        # after an SSD round: its rows' (active on the device after it, speculation sources), read before a batch
        # left with none running is released; None before one
        self.ssd_round_rows: tuple | None = None
        self.ks_run = collections.Counter()  # SD's rounds at each k

    @property
    def size(self) -> int:
        """Rows running: not those that ended or left, whose places the batch may hold a while (see
        :meth:`_drop_leaving`)."""
        gone = self._leaving | self._ended
        return sum(r.id not in gone for r in self.rows) if gone else len(self.rows)

    def join(self, prompt_ids, max_new_tokens: int, seed: int | None = None) -> RowTokens:
        """Prefill ``prompt_ids`` (a list, ``[T]`` or ``[1, T]``) alone and decide its first token; unless
        that ends it, the row runs in the next round. ``seed``: as ``generate``'s (mode ``ssd`` sampled takes
        none). Raises ``ValueError`` as ``generate`` would."""
        program = self.program
        ids = prompt_ids
        if not isinstance(ids, torch.Tensor):  # as a caller of generate gives it
            ids = torch.tensor([list(prompt_ids)], device="cpu")
        with program._lock, torch.inference_mode():
            _, ids, mask, eos_ids = validate_call(
                program, ids, max_new_tokens, self.temperature, "default", seed, None, self.mode
            )
            if ids.shape[0] != 1:
                raise ValueError(f"join takes one prompt (input_ids [1, T]); got a batch of {ids.shape[0]}")
            # a grammar's batch runs SD's rounds, where a seeded row's tokens are generate's
            grammar = getattr(self.controls, "grammar", None)
            if self.mode == "ssd" and self.temperature > 0 and seed is not None and grammar is None:
                raise ValueError(
                    f"seed={seed!r}: a batch session in mode 'ssd' takes no seed at temperature > 0 "
                    "(the draft lane draws from one generator per batch); run a seeded request alone "
                    "with generate"
                )
            padded_ids, padded_mask = program.shapes.pad_prompt(ids, mask, program.pad_token_id)
            generator = base = None
            if self.temperature > 0:  # as generate seeds its generator
                base = (
                    seed
                    if seed is not None
                    else int(torch.randint(2**62, (), dtype=torch.long, device="cpu"))
                )
                generator = torch.Generator(device=program.target.spec.device).manual_seed(base)
            T = padded_ids.shape[1]
            capacity = program._store_capacity(T, max_new_tokens)
            slot = free_slot(self, capacity)  # a gone row's place, taken in place; else the batch is rebuilt
            if slot is None:
                self._drop_leaving(narrow=True)
            if self.mode == "ssd" and not self.rows and grammar is None:  # planned as generate plans it alone
                plan = self.ssd.plan_first(
                    (padded_ids, padded_mask, max_new_tokens, eos_ids, self.temperature), base
                )
                self.run, self.why = plan.run, plan.why
            program.prepare(self.run, self.temperature)
            if self.controls is not None and self.run != "ar":
                program.target.stage(TARGET_VERIFY_LOGITS)  # built here, before a lane runs beside the rounds
            seqs = SequenceBatch(
                padded_ids, padded_mask, max_new_tokens, capacity, eos_ids, program.pad_token_id
            )
            draft = program.draft if self.run == "sd" else None
            if slot is not None:  # prefilled where it will run: the place's rows of the batch's stores
                target_store = self.state.target_store.emptied_row(slot)
                draft_store = self.state.draft_store.emptied_row(slot) if draft is not None else None
            else:
                target_store = program.target.new_store(1, capacity)
                draft_store = draft.new_store(1, capacity) if draft is not None else None
            alone = DecodeState(
                seqs,
                target_store,
                draft_store,
                self.temperature,
                generator,
                program.config.k,
                controls=self.controls,
                prefix_cache=program.prefix_cache,
            )
            with self._lanes_context():
                first = prefill(program.target, draft, alone)
                for runner in filter(None, (program.target, draft)):
                    runner.first_tokens_out()  # a background compiler held until the first text starts
                row = _Row(
                    next(self._ids),
                    max_new_tokens,
                    T + 1,
                    1,
                    capacity,
                    generator,
                    T,
                    seeded=self.temperature > 0 and seed is not None,
                )
                finished = not seqs.host_active[0]  # EOS, or a budget of one token
                if not finished and slot is not None:
                    replace_row(self, slot, row, alone)
                elif not finished:
                    self._splice(row, alone)
                    # the lane takes it before the next round: its first token goes out now
                    if self.run == "ssd":
                        self.ssd.pending.append(
                            (
                                program._draft_spec(
                                    padded_ids, padded_mask, max_new_tokens, eos_ids, self.temperature, base
                                ),
                                first,
                            )
                        )
        return RowTokens(row.id, [int(first[0])], finished, alone.counters.prefix_reused)

    def leave(self, row: int) -> None:
        """Drop ``row`` (a :meth:`join` id) before the next round; a row not running is ignored."""
        if any(r.id == row for r in self.rows) and row not in self._ended:
            self._leaving.add(row)

    def step(self, k: int | None = None) -> list[RowTokens]:
        """One round of every running row (after dropping those that left): what each row gained, in the
        order of the rows. Empty when no row runs. ``k``: SD's speculation length for this round (``1..config.k``;
        None: the session's ``k_choice``); AR's and SSD's rounds take none."""
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.program.config.k
        ):
            raise ValueError(f"k={k!r} is not allowed: it must be an integer in 1..{self.program.config.k}")
        program = self.program
        with program._lock, torch.inference_mode():
            self._drop_leaving()
            if not self.rows:
                return []
            state, seqs = self.state, self.state.seqs
            self.counters = state.counters = Counters(program.config.k)  # a server's session may run for days
            started = time.perf_counter()
            if self.run == "ssd":
                with self._lanes_context():
                    self._flush_lane()
                    if self.run == "ssd" and not self.ssd.holds():
                        # a generate call took the lane: this round and the next are SD's
                        self._lane_lost(None)
                    if self.run == "ssd":
                        self._on_lane(self.ssd.round, state)
                        return self._hand_out(state.seqs)
            if self.run == "ar":
                if self._launch is None:
                    greedy = (
                        self.temperature == 0
                        and program.target.provides(TARGET_ROUND)
                        and in_effect(state) is None
                    )
                    self._launch = (round_in_graph if greedy else round_by_step)(program.target, state)
                self._launch()
                seqs = state.seqs
                seqs.read()
                decided = [1] * len(self.rows)
                self.counters.accepted_lengths.extend(decided)
                self.counters.rounds += 1
            else:
                self._set_k(k)
                draft_tokens, draft_probs = draft_speculation(program.draft, state)
                self.counters.draft_s += seconds_since(started)
                decided = verify_and_commit(program.target, state, draft_tokens, draft_probs).decided
            self.counters.end_round(seconds_since(started), decided)
            out = self._hand_out(seqs)
            if self.run == "sd" and self.lengths is not None:  # the round's whole cost, its hand-out included
                # what each row handed out: a row that ended inside the round gained less than it decided
                gained = [len(row.new_tokens) for row in out]
                self.lengths.observe(len(self.rows), state.k, seconds_since(started), gained)
            return out

    def _set_k(self, k: int | None) -> None:
        """This SD round's ``k``: ``k``, else measured (:attr:`lengths`) unless a seeded sampled row runs."""
        state = self.state
        if k is None:
            measured = self.lengths is not None and not any(r.seeded for r in self.rows)
            k = self.lengths.choose(len(self.rows)) if measured else self.program.config.k
        if k != state.k:  # the last round's stage made the verify's next slots and positions for its own k
            made = state.seqs.next_inputs
            if made is not None:  # consecutive from the pending token's: the first column, counted on
                steps = torch.arange(k + 1, device=made[3].device)
                made = (*made[:3], made[3][:, :1] + steps, made[4][:, :1] + steps, *made[5:])
            state.k, state.seqs.next_inputs = k, made
        self.ks_run[k] += 1

    def _hand_out(self, seqs: SequenceBatch) -> list[RowTokens]:
        """Each running row's new tokens (one device→host copy of ``[B, most gained]``), cut at its budget; rows
        that ended are marked gone (a batch left with none running is released)."""
        lengths, active = seqs.host_lengths, seqs.host_active
        gone = self._leaving | self._ended
        width = max(length - row.emitted for length, row in zip(lengths, self.rows))  # k + 1 at most
        window = [[] for _ in self.rows]
        if width > 0:
            device = seqs.tokens.device
            index = (
                torch.tensor([row.emitted for row in self.rows], device=device)[:, None]
                + torch.arange(width, device=device)[None, :]
            )  # [B, width]
            window = seqs.tokens.gather(1, index.clamp_max(seqs.tokens.shape[1] - 1)).tolist()
        out = []
        for row, tokens, length, on in zip(self.rows, window, lengths, active):
            if row.id in gone:  # a place held: its row handed out its end already, or left
                continue
            new = tokens[: length - row.emitted][: row.budget - row.generated]
            row.emitted = length
            row.generated += len(new)
            finished = not on or row.generated >= row.budget
            if finished:
                self._ended.add(row.id)
            out.append(RowTokens(row.id, new, finished))
        if self.run == "ssd":
            speculation = self.ssd.speculation if self.ssd is not None else None
            self.ssd_round_rows = (list(active), None if speculation is None else list(speculation.source))
        if not self.size:
            self._drop_leaving()
        return out

    def _splice(self, row: _Row, alone: DecodeState) -> None:
        """Put ``alone``'s prefilled row after the running rows (one copy of the running batch's tensors)."""
        parts = ([(self.state, None)] if self.state is not None else []) + [(alone, None)]
        self._set(self.rows + [row], parts, max(r.capacity for r in self.rows + [row]))
        self.joined += 1

    def _drop_leaving(self, narrow: bool = False) -> None:
        """Before a round (or a join that found no place): the rows that ended or left stop decoding. In modes
        ``ar`` and ``sd`` their places are held, their device rows marked finished, for joining rows to take in
        place (``batching_in_place``), until half the batch or more is gone (or ``narrow``): then the running
        rows are copied into a batch of their size, one copy for many rows gone instead of one a row. Mode
        ``ssd`` (the lane's batch mirrors this one) narrows at once."""
        if not self._leaving and not self._ended:
            return
        gone = self._leaving | self._ended
        keep = [i for i, r in enumerate(self.rows) if r.id not in gone]
        before = len(self.rows)
        if keep and not narrow and self.run != "ssd" and 2 * len(keep) > len(self.rows):
            vacate = [i for i, r in enumerate(self.rows) if r.id in gone and r.id not in self._vacated]
            if vacate:  # they stop decoding; their slots stay theirs until a row takes the place
                seqs = self.state.seqs
                seqs.finished.index_fill_(0, torch.tensor(vacate, device=seqs.finished.device), True)
                seqs.changed()
                self._vacated.update(self.rows[i].id for i in vacate)
            return
        if not keep:
            self.rows, self.state, self._launch = [], None, None
        elif len(keep) < len(self.rows):
            rows = [self.rows[i] for i in keep]
            # where this raises, the rows stay marked
            self._set(rows, [(self.state, keep)], max(r.capacity for r in rows))
        self.left_early += len(self._leaving - self._ended)
        self._leaving, self._ended, self._vacated = set(), set(), set()
        if self.run == "ssd" and len(keep) < before:
            self._ssd_keep(keep)

    def _set(self, rows: list, parts: list, capacity: int) -> None:
        """Make ``rows`` the running batch: the rows of ``parts`` (``(DecodeState, row indices or None)``)
        gathered into pooled buffers and stores of ``capacity`` slots (a size met again: its addresses)."""
        program = self.program
        capacity = program.shapes.capacity(capacity)
        seqs = SequenceBatch.gathered(
            [(state.seqs, keep) for state, keep in parts], capacity, capacity, program.target.seq_pool
        )
        device = seqs.tokens.device
        indexed = [
            (state, None if keep is None else torch.tensor(keep, dtype=torch.long, device=device))
            for state, keep in parts
        ]
        target = program.target.new_store(len(rows), capacity).take_rows(
            [(state.target_store, keep) for state, keep in indexed]
        )
        draft = None
        if self.run == "sd":
            draft = program.draft.new_store(len(rows), capacity).take_rows(
                [
                    (state.draft_store, None if keep is None else keep.to(state.draft_store.slot_pos.device))
                    for state, keep in indexed
                ]
            )
        generators = [r.generator for r in rows] if self.temperature > 0 else None
        self.state = DecodeState(
            seqs, target, draft, self.temperature, generators, program.config.k, controls=self.controls
        )
        self.state.grammar_rows = gathered_grammar_rows(parts)
        if self.controls is not None:  # the rows' prompts end at their own columns (output penalties)
            self.state.prompt_ends = torch.tensor([r.prompt_end for r in rows], device=device)
        self.rows, self._launch = rows, None

    # --- mode ssd (runtime/batching_ssd.py) ---------------------------------------------------------------

    def _lanes_context(self):
        """Where SSD's work runs (``LaneOwner.ssd_context``, as in ``generate``); else a null context."""
        return (
            self.program.lanes.ssd_context(self.program.target.spec.device)
            if self.run == "ssd"
            else nullcontext()
        )

    def _flush_lane(self) -> None:
        """The rows that joined since the last round join the lane's batch, in order (the first opens it)."""
        pending, self.ssd.pending = self.ssd.pending, []
        for spec, first in pending:
            if self.run == "ssd" and not self.ssd.usable():
                self._lane_lost(None)
            if self.run != "ssd":
                return  # catch_up_draft covered every row
            self._on_lane(self.ssd.join, spec, first)

    def _ssd_keep(self, keep: list) -> None:
        if not keep:
            return self.ssd.finish()
        self._flush_lane()  # the kept indices count the rows still to join the lane
        if self.run == "ssd" and not self.ssd.holds():
            self._lane_lost(None)
        elif self.run == "ssd":
            self._on_lane(self.ssd.keep, keep)

    def _on_lane(self, work, *args) -> None:
        """``work(*args)`` on the lane; a lane failure leaves the rows to SD (committed rounds stay)."""
        try:
            work(*args)
        except DraftLaneError as exc:
            self._lane_lost(exc)

    def _lane_lost(self, exc: Exception | None) -> None:
        rows_to_sd(self, exc)


def gathered_grammar_rows(parts: list) -> list | None:
    """The grammar states of the rows ``parts`` (``(DecodeState, row indices or None)``, all under the session's
    controls) gather, in order (``controlled.grammar_rows``: at the grammar's start where none decided yet); None
    without a grammar."""
    rows = []
    for state, keep in parts:
        held = grammar_rows(state)
        if held is None:
            return None
        rows += held if keep is None else [held[i] for i in keep]
    return rows
