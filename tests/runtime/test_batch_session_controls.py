"""Sampling controls in a batch session (``BatchSession(..., controls=...)``, what ``saguaro serve`` batches
requests of equal controls in): rows that join at different rounds each get what ``program.generate`` gives their
request alone with the same controls: greedy token for token in AR, SD and SSD, a grammar's rows each with their
own grammar state (SSD's session runs SD's rounds then), and a seeded sampled row the same tokens as alone."""

import pytest
import torch

import saguaro
from saguaro import Grammar, SamplingControls
from saguaro.runtime.batching import BatchSession
from tests.conftest import tiny_program
from tests.models import EOS, prompts, tiny_target, truncated_draft
from tests.runtime.test_batch_session import drive
from tests.tiny_tokenizer import tiny_tokenizer

PENALTIES = SamplingControls.of(repetition_penalty=1.4, frequency_penalty=0.3, logit_bias={9: 2.0, 14: -1.5})
SAMPLED = SamplingControls.of(top_p=0.8, top_k=20, presence_penalty=0.4)


def solo(program, prompt, budget, controls, temperature=0.0, seed=None, mode=None):
    """The new tokens ``generate`` gives ``prompt`` alone under ``controls``, up to and with the first EOS."""
    out = program.generate(
        torch.tensor([prompt]),
        max_new_tokens=budget,
        temperature=temperature,
        seed=seed,
        mode=mode,
        controls=controls,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t == program.eos_token_id), tokens)


def joining_requests(seeds=(None, None, None, None)):
    ids, _ = prompts(4, 10, seed=33)
    return [
        (0, ids[0, :5].tolist(), 24, seeds[0]),
        (0, ids[1, :8].tolist(), 12, seeds[1]),
        (2, ids[2, :3].tolist(), 30, seeds[2]),  # joins a running batch
        (5, ids[3, :9].tolist(), 9, seeds[3]),  # joins after the second row ended: its place, in place
    ]


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_greedy_rows_under_penalties_equal_their_solo_output(mode):
    _, _, program = tiny_program("llama", mode=mode)
    requests = joining_requests()
    got, sizes = drive(BatchSession(program, 0.0, mode, controls=PENALTIES), requests)
    assert max(sizes) >= 2
    for i, (_, prompt, budget, _) in enumerate(requests):
        assert got[i] == solo(program, prompt, budget, PENALTIES, mode=mode), i
    plain = {i: solo(program, p, b, None, mode=mode) for i, (_, p, b, _) in enumerate(requests)}
    assert plain != got  # the controls changed what the rows decided


def test_sampled_seeded_rows_under_controls_equal_their_solo_output():
    _, _, program = tiny_program("llama", mode="sd")
    requests = joining_requests(seeds=(11, 12, 13, 14))
    got, _ = drive(BatchSession(program, 0.8, "sd", controls=SAMPLED), requests)
    for i, (_, prompt, budget, seed) in enumerate(requests):
        assert got[i] == solo(program, prompt, budget, SAMPLED, temperature=0.8, seed=seed, mode="sd"), i


def test_greedy_rows_under_penalties_in_mode_ssd_equal_their_solo_output():
    target = tiny_target("llama")
    program = saguaro.compile(
        target, truncated_draft(target), k=3, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )
    requests = joining_requests()
    session = BatchSession(program, 0.0, "ssd", controls=PENALTIES)
    got, _ = drive(session, requests)
    for i, (_, prompt, budget, _) in enumerate(requests):
        assert got[i] == solo(program, prompt, budget, PENALTIES, mode="ssd"), i


def test_grammar_rows_each_keep_their_own_state_and_ssd_runs_sd():
    tok = tiny_tokenizer(128)
    target = tiny_target("llama", logit_scale=4.0)
    program = saguaro.compile(
        target, truncated_draft(target), k=3, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )
    grammar = Grammar.regex(r"(a[bc]|d)+", tok)
    controls = SamplingControls.of(grammar=grammar)
    requests = joining_requests()
    session = BatchSession(program, 0.0, "ssd", controls=controls)
    got, _ = drive(session, requests)
    assert session.run == "sd" and "grammar" in session.why
    for i, (_, prompt, budget, _) in enumerate(requests):
        alone = solo(program, prompt, budget, controls, mode="sd")
        assert got[i] == alone, i
        text = tok.decode([t for t in got[i] if t != EOS])
        assert text and set(text) <= set("abcd"), text


def test_a_program_without_the_verify_logits_stage_refuses_controls(monkeypatch):
    _, _, program = tiny_program("llama", mode="sd")
    monkeypatch.setattr(type(program), "can_control", property(lambda self: False))
    with pytest.raises(ValueError, match="verify_logits"):
        BatchSession(program, 0.0, "sd", controls=PENALTIES)
    assert BatchSession(program, 0.0, "ar", controls=PENALTIES).controls == PENALTIES
