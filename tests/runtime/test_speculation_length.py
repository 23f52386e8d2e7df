"""A batch session's SD rounds draft a measured ``k`` (``runtime/speculation_length.py``): the choice follows the
rounds' measured tokens a second per batch-size bucket, and any ``k`` keeps the output exact: greedy rows get
``generate``'s tokens, sampled rows the target's distribution, seeded rows ``generate``'s tokens at the program's
``k``."""

import itertools
import random

import pytest
import torch

from saguaro.runtime.batching import BatchSession
from saguaro.runtime.speculation_length import EXPLORE_EVERY, FIRST_ROUNDS, SpeculationLength
from saguaro.serve.scheduler import WithoutEos
from tests.conftest import tiny_program
from tests.models import SHARP_VOCAB, prompts, sharp_sd_pair
from tests.runtime.test_batch_session import drive, solo
from tests.stats_util import chi_square_pvalue


def feed(
    lengths: SpeculationLength, batch: int, seconds_of, alpha: float, rounds: int, seed: int = 0
) -> list:
    """``rounds`` rounds of ``batch`` rows, each row accepting each draft token with probability ``alpha``, a round
    at ``k`` taking ``seconds_of(k)``; the ks chosen."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = lengths.choose(batch)
        chosen.append(k)
        decided = []
        for _ in range(batch):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            decided.append(accepted + 1)
        lengths.observe(batch, k, seconds_of(k), decided)
    return chosen


def best_k(batch: int, seconds_of, alpha: float, k_max: int) -> int:
    """The k of the most expected tokens a second."""
    return max(
        range(1, k_max + 1), key=lambda k: batch * (1 - alpha ** (k + 1)) / (1 - alpha) / seconds_of(k)
    )


def compute_bound(batch: int):
    """A verify of ``batch (k + 1)`` tokens at a tenth of a unit each beside a fixed cost, a draft step 0.2."""
    return lambda k: 1.0 + 0.1 * batch * (k + 1) + 0.2 * k


def test_every_k_is_measured_first_then_the_fastest_runs_and_the_others_are_remeasured():
    lengths = SpeculationLength(5)
    first = feed(lengths, 16, compute_bound(16), 0.7, 5 * FIRST_ROUNDS)
    assert first == [k for k in (5, 4, 3, 2, 1) for _ in range(FIRST_ROUNDS)]
    later = feed(lengths, 16, compute_bound(16), 0.7, 3 * EXPLORE_EVERY)
    best = best_k(16, compute_bound(16), 0.7, 5)
    assert best == 1 and later.count(best) == len(later) - 3  # another k once each EXPLORE_EVERY, in turn
    assert [k for k in later if k != best] == [2, 3, 4]
    assert lengths.acceptance()[:2] == pytest.approx([0.7, 0.7], abs=0.06)  # positions 3-5: measured less
    # one row: a verify of a few tokens costs about one of one token, and a long k wins
    latency_bound = lambda k: 1.0 + 0.01 * (k + 1) + 0.02 * k
    assert (
        feed(lengths, 1, latency_bound, 0.8, 200)[-10:] == [5] * 10 and best_k(1, latency_bound, 0.8, 5) == 5
    )


def test_the_choice_follows_the_rounds_times_and_the_acceptance():
    lengths = SpeculationLength(5)
    feed(lengths, 16, compute_bound(16), 0.7, 200)
    assert lengths.choose(16) == 1
    cheap = lambda k: 1.0 + 0.01 * (k + 1)  # the verify became cheap (a quiet machine, a GPU)
    chosen = feed(lengths, 16, cheap, 0.9, 40 * EXPLORE_EVERY, seed=1)
    assert chosen[-EXPLORE_EVERY:].count(5) >= EXPLORE_EVERY - 1 and best_k(16, cheap, 0.9, 5) == 5
    # a poor draft (alpha 0.1) whose steps cost something makes the shortest speculation the best again
    drafting = lambda k: cheap(k) + 0.1 * k
    chosen = feed(lengths, 16, drafting, 0.1, 10 * EXPLORE_EVERY, seed=2)
    assert chosen[-EXPLORE_EVERY:].count(1) >= EXPLORE_EVERY - 1 and best_k(16, drafting, 0.1, 5) == 1


def test_batch_sizes_are_measured_apart_and_a_stall_counts_as_little():
    lengths = SpeculationLength(3)
    feed(lengths, 16, compute_bound(16), 0.7, 3 * FIRST_ROUNDS)
    assert lengths.choose(16) == 1 and lengths.choose(9) == 1  # 9-16 rows: one bucket
    assert lengths.choose(2) == 3  # 2 rows: a bucket not measured yet, k_max first
    before = lengths.rates(16)[1]
    lengths.observe(
        16, 1, 1000.0, [2] * 16
    )  # one round stalled: counted as OUTLIER times the average at most
    assert lengths.rates(16)[1] > before / 2


def test_k_max_is_checked():
    with pytest.raises(ValueError, match="k_max=0"):
        SpeculationLength(0)


def test_greedy_rows_equal_their_solo_output_at_any_k_and_a_round_can_be_given_its_k():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(4, 12, seed=31)
    requests = [(0, ids[i, : 4 + 2 * i].tolist(), 24, None) for i in range(3)] + [
        (3, ids[3].tolist(), 20, None)
    ]
    session = BatchSession(program)
    tokens, _ = drive(session, requests)
    for i, (_, prompt, budget, _) in enumerate(requests):
        assert tokens[i] == solo(program, prompt, budget), i
    assert len(session.lengths.rates(3)) > 1  # the session did run several ks
    forced = BatchSession(program, k_choice="fixed")
    first = forced.join(requests[0][1], 24)
    got, ks = list(first.new_tokens), []
    while forced.size:
        ks.append(1 + len(ks) % program.config.k)
        for out in forced.step(k=ks[-1]):  # empty once the ended row is dropped
            got += out.new_tokens
    assert got == solo(program, requests[0][1], 24) and forced.lengths is None and len(set(ks)) > 1
    with pytest.raises(ValueError, match="k=0 is not allowed"):
        forced.step(k=0)
    with pytest.raises(ValueError, match="k_choice='often'"):
        BatchSession(program, k_choice="often")


def test_seeded_sampled_rows_run_the_programs_k():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(2, 10, seed=32)
    requests = [(0, ids[0].tolist(), 20, 3), (1, ids[1, :6].tolist(), 16, 4)]
    session = BatchSession(program, temperature=0.8)
    tokens, _ = drive(session, requests)
    for i, (_, prompt, budget, seed) in enumerate(requests):
        assert tokens[i] == solo(program, prompt, budget, 0.8, seed), i
    assert {*session.lengths.rates(1), *session.lengths.rates(2)} == {
        program.config.k
    }  # measured, not chosen


VOCAB = SHARP_VOCAB
PROMPT = [3, 7, 11, 4]
ROWS, SESSIONS = 150, 16


def sampling_setup():
    return sharp_sd_pair(k=3)


def joint_of_second_and_third(model) -> torch.Tensor:
    """``P(t2, t3)`` of the second and third generated tokens at temperature 1, ``[V, V]``."""
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1].float(), -1)  # [V]
        one = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # [V, T+1]
        p2 = torch.softmax(model(one).logits[:, -1].float(), -1)  # [V(t1), V(t2)]
        two = torch.cat([one.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], dim=1)
        p3 = torch.softmax(model(two).logits[:, -1].float(), -1).reshape(VOCAB, VOCAB, VOCAB)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [V(t2), V(t3)]


def test_sampled_rows_keep_the_targets_distribution_while_k_changes_round_by_round():
    target, draft, program = sampling_setup()
    torch.manual_seed(0)  # the unseeded rows' generators are seeded from torch's
    counts = torch.zeros(VOCAB, VOCAB)
    ks = []
    for s in range(SESSIONS):
        session = BatchSession(WithoutEos(program), temperature=1.0)  # each row decodes its 3 tokens
        tokens = {}
        for _ in range(ROWS):
            first = session.join(PROMPT, 3)
            tokens[first.row] = list(first.new_tokens)
        for r in itertools.count():  # each round its own k: 1, 2, 3, 1, ... from the session's own start
            if not session.size:
                break
            ks.append(1 + (s + r) % 3)
            for got in session.step(k=ks[-1]):
                tokens[got.row] += got.new_tokens
        for row in tokens.values():
            counts[row[1], row[2]] += 1
    assert set(ks) == {1, 2, 3}
    want = joint_of_second_and_third(target)
    assert chi_square_pvalue(counts, want) > 1e-3
    assert chi_square_pvalue(counts, joint_of_second_and_third(draft)) < 1e-6  # the check can fail


def test_a_row_that_ends_inside_a_round_counts_as_failing_where_it_ended():
    lengths = SpeculationLength(5)
    lengths.observe(2, 5, 1.0, [6, 3])  # one row took all 5 and the bonus; one ended at its 3rd token
    assert lengths.passed == [2, 2, 1, 1, 1] and lengths.failed == [0, 0, 1, 0, 0]
    # short answers: tokens past a row's end are not counted, so their rounds are worth less at a long k
    short, long_ = SpeculationLength(5), SpeculationLength(5)
    for lengths, ending in ((short, 2), (long_, None)):
        for _ in range(60):
            lengths.observe(16, 5, 1.0, [6] * 12 + [ending or 6] * 4)
    assert short.expected_tokens(5) < long_.expected_tokens(5) and long_.expected_tokens(5) > 5.5


def test_a_session_tells_the_choice_the_tokens_its_rows_handed_out():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(3, 12, seed=33)
    session = BatchSession(program)
    seen = []
    observe = session.lengths.observe
    session.lengths.observe = lambda batch, k, seconds, gained: (
        seen.append(gained),
        observe(batch, k, seconds, gained),
    )
    budgets = [3, 7, 11]  # rows whose budgets end inside a round
    for row, budget in zip(ids.tolist(), budgets):
        session.join(row, budget)
    handed, decided = [], []
    while session.size:
        handed.append([len(got.new_tokens) for got in session.step()])
        decided.append(list(session.counters.accepted_lengths))  # the round's accepted + 1 per active row
    assert seen == [h for h in handed if h] and sum(map(sum, handed)) == sum(budgets) - len(budgets)
    assert any(h != d for h, d in zip(handed, decided) if h)  # a row decided tokens past its budget
