"""A row joining a :class:`~saguaro.runtime.batching.BatchSession` where a row ended or left since the last round
takes that row's place in place: one row's tokens and slots copied into the running batch's buffers and stores
(``SequenceBatch.put_row``, ``KVStore.put_row``), the other rows and every tensor's address untouched. Without
it each join and each leave rebuilt the whole batch (``SequenceBatch.gathered``, ``KVStore.take_rows``: every
row's caches copied); a batch of 16 served eager spent about a tenth of its time so. Modes ``ar`` and ``sd``
(mode ``ssd``'s draft lane keeps a mirror of the rows in order: it rebuilds), and only where the batch's stores
are as wide as the joining row needs (else the rebuild, which widens them)."""

from __future__ import annotations


def free_slot(session, capacity: int) -> int | None:
    """The index of a row of ``session`` that ended or left, whose place a joining row of ``capacity`` slots can
    take in place; None: none (the session rebuilds the batch)."""
    if session.run == "ssd" or session.state is None or not (session._leaving or session._ended):
        return None
    if session.program.shapes.capacity(capacity) > session.state.target_store.capacity:
        return None
    gone = session._leaving | session._ended
    return next((i for i, r in enumerate(session.rows) if r.id in gone), None)


def replace_row(session, index: int, row, alone) -> None:
    """Put ``alone``'s prefilled row (a ``DecodeState`` of one row) in place of ``session``'s row ``index``; the
    row's slots past ``alone``'s capacity are emptied, as in a fresh store."""
    state, gone = session.state, session.rows[index].id
    state.seqs.put_row(index, alone.seqs)
    state.target_store.put_row(index, alone.target_store)
    if state.draft_store is not None:
        state.draft_store.put_row(index, alone.draft_store)
    if session.temperature > 0:
        state.generator[index] = row.generator
    state.draft_feed = 2  # the joining row's draft holds its prompt up to the pending token: feed both
    session.left_early += gone in session._leaving and gone not in session._ended
    session._leaving.discard(gone)
    session._ended.discard(gone)
    session.rows[index], session._launch = row, None
    session.joined += 1
