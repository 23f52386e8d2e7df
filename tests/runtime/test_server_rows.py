"""The draft server's row changes (``SpeculationServer.join_rows`` / ``keep_rows``, ``runtime/draft/rows.py``): a
row that joins a running batch speculates exactly as it does in a generation of its own (its first speculation,
then the tree built over the spliced store and mirror, hit and looked up), before and after its batch mates
leave; bad row lists are refused."""

import pytest
import torch

from saguaro.runtime.draft.server import SpeculationServer
from tests.conftest import tiny_program
from tests.models import prompts

FAN_OUT = [2, 2, 1, 1]  # k = 3: a fixed tree, the same for both servers


def spec(program, rows: list, budget: int):
    """The draft-side spec of a greedy generation of ``rows`` (left-padded), as ``generate`` makes it."""
    T = max(len(r) for r in rows)
    ids = torch.tensor([[program.pad_token_id] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    padded, padded_mask = program.shapes.pad_prompt(ids, mask, program.pad_token_id)
    return program._draft_spec(padded, padded_mask, budget, [], 0.0, None)


def round_on(server, rows: list, hit_row: int) -> list:
    """Build the fixed tree, then an outcome that hits the cache on ``hit_row`` (its first candidate after no
    accepted token) and misses on the others (neural fallback). Returns each row's next speculation tokens."""
    server.build(FAN_OUT)
    candidates = server.cache.candidates.tolist()  # [B, MQ]: the first branches fork from glue row 0
    accepted = [0] * len(rows)
    outcome = [
        candidates[b][0] if b == hit_row else int(server.current.tokens[b, 0]) for b in range(len(rows))
    ]
    lookup = server.match(accepted, outcome, 0.0)
    assert lookup.hit[hit_row]
    missed = [not h for h in lookup.hit]
    speculation = server.fallback(missed) if any(missed) else lookup.speculation
    return speculation.tokens.tolist()


def test_a_joined_row_speculates_as_it_does_alone_before_and_after_its_mates_leave():
    _, _, program = tiny_program("llama", k=3, mode="ssd", fallback="neural")
    ids, _ = prompts(3, 9, seed=41)
    a, b, c = ids[0, :9].tolist(), ids[1, :4].tolist(), ids[2, :6].tolist()
    first = torch.tensor([7, 8, 9])
    alone, batch = (
        SpeculationServer(program.draft, program.config),
        SpeculationServer(program.draft, program.config),
    )
    with torch.inference_mode():
        alone.open(spec(program, [c], 30))
        solo = alone.start(first[2:]).tokens.tolist()
        batch.open(spec(program, [a, b], 12))
        batch.start(first[:2])
        joined = batch.join_rows(spec(program, [c], 30), first[2:])
        assert (
            joined.tokens.tolist() == solo
            and batch.seqs.batch == 3
            and batch.current.tokens[2].tolist() == solo[0]
        )
        assert batch.store.capacity == max(alone.store.capacity, batch.row_capacity[0])
        assert round_on(batch, [a, b, c], 2)[2] == round_on(alone, [c], 0)[0]
        batch.keep_rows([2])
        assert batch.seqs.batch == 1 and batch.policy.batch == 1
        assert (
            batch.seqs.tokens[0, : alone.seqs.host_lengths[0]].tolist()
            == alone.seqs.tokens[0, : alone.seqs.host_lengths[0]].tolist()
        )
        assert round_on(batch, [c], 0) == round_on(alone, [c], 0)
        for bad in ([], [1], [0, 0]):
            with pytest.raises(ValueError, match="keep_rows"):
                batch.keep_rows(bad)
