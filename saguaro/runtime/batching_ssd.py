"""Mode ``ssd`` in a :class:`~saguaro.runtime.batching.BatchSession`: the draft lane a session holds between
rounds, and the speculation its next round verifies.

The first row is planned as ``generate`` plans it alone and opens the lane; later rows join it
(``join_rows``) and leaving rows are dropped (``keep_rows``) between rounds, while the lane is idle. A round
is :func:`~saguaro.runtime.decode.ssd.ssd_round`. Where the lane fails or another call takes it, the rows go
on exactly with SD (:func:`rows_to_sd`). Design: docs/design.md, ``runtime/batching_ssd.py``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.base.sequences import host_to_device
from saguaro.runtime.decode.ssd import catch_up_draft, ssd_round
from saguaro.runtime.draft.records import Speculation
from saguaro.runtime.generation_plan import GenerationPlan, plan_call


class SessionLane:
    """The SSD side of one session: the lane it holds (``lane``, a ``DraftClient``) and ``speculation``,
    the next round's (rows in the session's order)."""

    def __init__(self, program, session):
        self.program = program
        self.session = session
        self.lane = None
        self.speculation: Speculation | None = None
        self.plan: GenerationPlan | None = None
        self.solo_rounds: list = []  # seconds of the SSD rounds run with one row (what the verdict takes)
        self.pending: list = []  # (spec, first token) of rows joined since the last round, not on the lane

    def plan_first(self, call: tuple, base: int | None) -> GenerationPlan:
        """The plan of the session's first row: ``call``, ``plan_call``'s of that row alone; ``base``, its
        seed (sampled)."""
        program = self.program
        self.release()
        client = program.lanes.started()
        if client is not None and client.holder is not None:  # another session's rows are in the server
            alone = program.without_lane
            self.plan = GenerationPlan(
                "ssd",
                alone,
                f"ssd asked, but the draft lane serves another batch: {alone.upper()} gives the same tokens",
            )
        else:
            self.plan = plan_call(program, "ssd", call, base)
        return self.plan

    def holds(self) -> bool:
        """Whether the server still holds this session's rows (no generate opened it, no lane restarted)."""
        return (
            self.lane is not None
            and self.lane.holder is self.session
            and self.program.lanes.started() is self.lane
        )

    def usable(self) -> bool:
        """Whether a row may join: the session holds the lane, or (none joined) the planned one runs."""
        if self.lane is None:
            return self.plan.lane is not None and self.program.lanes.started() is self.plan.lane
        return self.holds()

    def join(self, spec, first: torch.Tensor) -> None:
        """A row joins (``spec``: its draft-side spec, batch 1; ``first [1]``: its first token); the first
        opens the lane, as ``generate`` does. Raises ``DraftLaneError``."""
        if self.lane is None:
            plan = self.plan
            plan.lane.open(replace(spec, plan_costs=plan.calibrated[1]))  # as generate opens it alone
            self.lane = plan.lane
            plan.lane.holder = self.session
            self.speculation = self.lane.start(first)
            return
        one = self.lane.join_rows(spec, first)
        s = self.speculation
        self.speculation = Speculation(
            torch.cat([s.tokens, one.tokens.to(s.tokens.device)]),
            None if s.probs is None else torch.cat([s.probs, one.probs.to(s.probs.device)]),
            list(s.source) + list(one.source),
        )

    def keep(self, rows: list) -> None:
        """Only ``rows`` (increasing indices, at least one) go on. Raises ``DraftLaneError``."""
        self.lane.keep_rows(rows)
        s = self.speculation
        rows_on_host = torch.tensor(rows, dtype=torch.long, device="cpu")
        index = host_to_device(rows_on_host, s.tokens.device)  # [M], no sync
        self.speculation = Speculation(
            s.tokens.index_select(0, index),
            None if s.probs is None else s.probs.index_select(0, index),
            [s.source[b] for b in rows],
        )

    def round(self, state) -> None:
        """One SSD round of every row; the lane is idle once it returns. Raises ``DraftLaneError``."""
        try:
            self.speculation = ssd_round(self.program.target, state, self.lane, self.speculation)
        finally:
            self.lane.settle()  # a round whose rows all ended leaves its build posted: it ends here
        if state.seqs.batch == 1:
            self.solo_rounds += state.counters.round_s

    def finish(self) -> None:
        """No row runs: record the one-row SSD rounds for the verdict (as ``generate`` does); let go."""
        plan = self.plan
        if self.holds() and plan.spec is not None and plan.spec.input_ids.shape[0] == 1:
            calibration = self.program.calibration
            calibration.record_ssd(
                calibration.verdict_key(plan.lane, plan.spec), self.solo_rounds, plan.sd_round_s
            )
        self.release()

    def release(self) -> None:
        """The session no longer holds the lane (no row runs, or its rows went on with SD)."""
        if self.lane is not None and self.lane.holder is self.session:
            self.lane.holder = None
        self.lane = None
        self.speculation = None
        self.solo_rounds = []
        self.pending = []


def rows_to_sd(session, exc: Exception | None) -> None:
    """``session``'s lane failed (``exc``; the lane is dropped) or no longer holds its rows (None): they go
    on exactly with SD (AR where the only draft is remote) until none runs."""
    program = session.program
    alone = program.without_lane
    if exc is not None:
        warn_at_caller(
            f"saguaro: {exc}; finishing this batch's rows with {alone.upper()} (output stays exact)"
        )
        session.lanes_failed += 1
        program.lanes.drop()
    session.ssd.release()
    session.run = alone
    if exc is not None:
        session.why = f"the draft lane failed: {exc}"
    else:
        session.why = "the draft lane was taken by another generation"
    program.prepare(alone, session.temperature)
    if session.state is not None:
        if alone == "sd":
            catch_up_draft(program.draft, session.state)
        else:  # the last round's rejected slots
            session.state.target_store.invalidate_from(session.state.seqs.tail_index(1)[:, 0])
        session._launch = None
