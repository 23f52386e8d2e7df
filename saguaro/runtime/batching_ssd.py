"""Mode ``ssd`` in a :class:`~saguaro.runtime.batching.BatchSession`: the draft lane a session holds between its
rounds, and the speculation its next round verifies.

- A session's first row (no row running) is planned as a ``generate`` call of that row alone is
  (:func:`~saguaro.runtime.generation_plan.plan_call`: the lane started, warmed up and measured for batch 1 and
  the row's store capacity, once per shape; then the verdict ``sd_when_faster``): the session's rounds run
  SSD, or SD (AR where the only draft is remote) until no row runs. Later rows join without a warm-up: a
  running batch of any size and capacity reuses what the first row's plan measured.
- The first row opens the lane (``open``, ``start``: its first speculation), as ``generate`` does; each later
  row joins it (``join_rows``) and a row that ends or leaves is dropped from it (``keep_rows``), between rounds,
  while the lane is idle. A row joins the lane just before the next round (or a row change), not in
  ``join``: its first token goes out after the target's prefill alone, as ``generate`` streams it. A round is
  :func:`~saguaro.runtime.decode.ssd.ssd_round`, the function ``generate``'s rounds call.
- The lane serves one batch at a time: a ``generate`` call (or a calibration) between two rounds opens the
  server for itself, and a session of another temperature finds the lane taken; either way the session's
  rows go on exactly with SD (:func:`rows_to_sd`), as they do after a lane failure (which also
  drops the lane, so the next session starts a fresh one).
- The verdict learns from the session as from a ``generate`` call: once no row runs, the SSD rounds it ran
  with one row (the batch its first row was planned at) are recorded against an SD round of that shape
  (``Calibration.record_ssd``), so where SSD measured slower the next sessions run SD, and SSD again now and
  then to measure it anew.
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
    """The SSD side of one session: the lane it holds (``lane``, a ``DraftClient``) and ``speculation``, the
    next round's (rows in the session's order)."""

    def __init__(self, program, session):
        self.program, self.session = program, session
        self.lane = None
        self.speculation: Speculation | None = None
        self.plan: GenerationPlan | None = None
        self.solo_rounds: list = []  # seconds of the SSD rounds run with one row (what the verdict compares)
        self.pending: list = []  # (spec, first token) of rows joined since the last round, not yet on the lane

    def plan_first(self, call: tuple, base: int | None) -> GenerationPlan:
        """The plan of the session's first row: ``call`` = ``(padded_ids, padded_mask, max_new_tokens, eos_ids,
        temperature)`` of that row alone, ``base`` its seed (sampled)."""
        program = self.program
        self.release()
        client = program.lanes.started()
        if client is not None and client.holder is not None:  # another session's rows are in the server
            alone = program.without_lane
            self.plan = GenerationPlan("ssd", alone, f"ssd asked, but the draft lane serves another batch: "
                                                     f"{alone.upper()} gives the same tokens")
        else:
            self.plan = plan_call(program, "ssd", call, base)
        return self.plan

    def holds(self) -> bool:
        """Whether the server still holds this session's rows (no generate opened it since, no lane restarted)."""
        return self.lane is not None and self.lane.holder is self.session and \
            self.program.lanes.started() is self.lane

    def usable(self) -> bool:
        """Whether a row may join: the session holds the lane, or (none joined yet) the planned lane still runs."""
        if self.lane is None:
            return self.plan.lane is not None and self.program.lanes.started() is self.plan.lane
        return self.holds()

    def join(self, spec, first: torch.Tensor) -> None:
        """A row joins (``spec`` its draft-side spec, batch 1; ``first [1]`` its first token): the first one opens
        the lane, as ``generate`` does; a later one joins the open batch. Raises ``DraftLaneError``."""
        if self.lane is None:
            plan = self.plan
            plan.lane.open(replace(spec, plan_costs=plan.calibrated[1]))  # as generate opens it alone
            self.lane, plan.lane.holder = plan.lane, self.session
            self.speculation = self.lane.start(first)
            return
        one = self.lane.join_rows(spec, first)
        s = self.speculation
        self.speculation = Speculation(torch.cat([s.tokens, one.tokens.to(s.tokens.device)]),
                                       None if s.probs is None else torch.cat([s.probs, one.probs.to(s.probs.device)]),
                                       list(s.source) + list(one.source))

    def keep(self, rows: list) -> None:
        """Only ``rows`` (increasing indices, at least one) go on. Raises ``DraftLaneError``."""
        self.lane.keep_rows(rows)
        s = self.speculation
        index = host_to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), s.tokens.device)  # [M], no sync
        self.speculation = Speculation(s.tokens.index_select(0, index),
                                       None if s.probs is None else s.probs.index_select(0, index),
                                       [s.source[b] for b in rows])

    def round(self, state) -> None:
        """One SSD round of every row (``ssd_round``); the lane is idle once it returns. Raises ``DraftLaneError``."""
        try:
            self.speculation = ssd_round(self.program.target, state, self.lane, self.speculation)
        finally:
            self.lane.settle()  # a round whose rows all ended leaves its build posted: it ends here
        if state.seqs.batch == 1:
            self.solo_rounds += state.counters.round_s

    def finish(self) -> None:
        """No row runs: the SSD rounds run with one row go to the verdict (as ``generate`` records its rounds);
        the lane is let go."""
        plan = self.plan
        if self.holds() and plan.spec is not None and plan.spec.input_ids.shape[0] == 1:
            calibration = self.program.calibration
            calibration.record_ssd(calibration.verdict_key(plan.lane, plan.spec), self.solo_rounds, plan.sd_round_s)
        self.release()

    def release(self) -> None:
        """The session no longer holds the lane (no row runs, or its rows went on with SD)."""
        if self.lane is not None and self.lane.holder is self.session:
            self.lane.holder = None
        self.lane, self.speculation, self.solo_rounds, self.pending = None, None, [], []


def rows_to_sd(session, exc: Exception | None) -> None:
    """``session``'s lane failed (``exc``; dropped: the next session starts a fresh one) or no longer holds its
    rows (None): they go on exactly with SD (AR with a remote draft only), as in ``decode_ssd``, until none runs."""
    program = session.program
    alone = program.without_lane
    if exc is not None:
        warn_at_caller(f"saguaro: {exc}; finishing this batch's rows with {alone.upper()} (output stays exact)")
        session.lanes_failed += 1
        program.lanes.drop()
    session.ssd.release()
    session.run, session.why = alone, (f"the draft lane failed: {exc}" if exc is not None else
                                       "the draft lane was taken by another generation")
    program.prepare(alone, session.temperature)
    if session.state is not None:
        if alone == "sd":
            catch_up_draft(program.draft, session.state)
        else:  # the last round's rejected slots
            session.state.target_store.invalidate_from(session.state.seqs.tail_index(1)[:, 0])
        session._launch = None
