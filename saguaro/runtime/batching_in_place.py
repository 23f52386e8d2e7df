"""A joining row takes the place of a row that ended or left since the last round, in place: it is prefilled
into that place's rows of the running batch's stores (``KVStore.emptied_row``: no store of its own to copy) and
its tokens copied in (``put_row``), the other rows and every address untouched. Modes ``ar`` and ``sd``, where the
stores are wide enough; else the session rebuilds the batch (why:
docs/measurements/2026-12-05-serve-batch-in-place.md)."""

from __future__ import annotations

from saguaro.runtime.decode.controlled import grammar_rows


def free_slot(session, capacity: int) -> int | None:
    """The index of a row of ``session`` that ended or left, whose place a joining row of ``capacity``
    slots can take in place; None: none (the session rebuilds the batch)."""
    if session.run == "ssd" or session.state is None or not (session._leaving or session._ended):
        return None
    if session.program.shapes.capacity(capacity) > session.state.target_store.capacity:
        return None
    gone = session._leaving | session._ended
    return next((i for i, r in enumerate(session.rows) if r.id in gone), None)


def replace_row(session, index: int, row, alone) -> None:
    """Put ``alone``'s prefilled row (a one-row ``DecodeState``) in place of ``session``'s row ``index``: its
    stores are that row's already (``KVStore.emptied_row``), or are copied there, the slots past their capacity
    emptied, as in a fresh store."""
    state, gone = session.state, session.rows[index].id
    state.seqs.put_row(index, alone.seqs)
    for mine, theirs in ((state.target_store, alone.target_store), (state.draft_store, alone.draft_store)):
        if mine is not None and theirs.slot_pos.data_ptr() != mine.slot_pos[index].data_ptr():
            mine.put_row(index, theirs)  # else prefilled in place (KVStore.emptied_row)
    if session.temperature > 0:
        state.generator[index] = row.generator
    if state.prompt_ends is not None:
        state.prompt_ends[index] = row.prompt_end
    if state.grammar_rows is not None:  # the joining row's grammar state, its first token decided
        state.grammar_rows[index] = grammar_rows(alone)[0]
    state.draft_feed = 2  # the joining row's draft holds its prompt up to the pending token: feed both
    session.left_early += gone in session._leaving and gone not in session._ended
    session._leaving.discard(gone)
    session._ended.discard(gone)
    session._vacated.discard(gone)
    session.rows[index] = row
    session._launch = None
    session.joined += 1
