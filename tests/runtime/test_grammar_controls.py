"""A grammar is one more sampling control, exact under speculation: each verify position is masked by the row's
grammar state after its path's draft tokens, and SD's draft proposes from its own distribution masked the same way
(the ``q`` of the ratio test). Greedy AR, SD and SSD (run as SD: its lane cannot carry the grammar) equal the masked
target's own argmax decoding, token for token; sampled, they draw from the target's masked (and processed)
distribution, checked by chi-square on many seeded samples against an exact enumeration whose masks come from a
fresh grammar state advanced along each history; a verifier that ignores the grammar is caught."""

import functools
import json

import pytest
import torch

import saguaro
from saguaro import Grammar, GrammarError
from saguaro.runtime.decode import controlled
from saguaro.runtime.decode import sd as sd_decode
from saguaro.tensor_math import logits_processing as lp
from tests.models import EOS, tiny_target, truncated_draft
from tests.runtime.test_sampling_controls import PROMPT, VOCAB, models, reference_probs
from tests.stats_util import chi_square_pvalue
from tests.tiny_tokenizer import tiny_tokenizer

SAMPLES = 4000
# over the 16-token tiny vocabulary ("!" 7, '"' 8, "#" 9, "$" 10, ... ")" 15): which tokens may come next depends on
# the path, so every verify position's mask is the state after the draft tokens before it
PATTERN = r"""(![ "#]|#[$%&']|[()])+"""
PENALTIES = dict(repetition_penalty=1.5, presence_penalty=0.5, logit_bias={9: 1.5, 14: -1.0}, top_p=0.9)
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "tag": {"type": "string", "maxLength": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "kind", "tag", "ok"],
    "additionalProperties": False,
}


@functools.cache
def small_grammar() -> Grammar:
    return Grammar.regex(PATTERN, tiny_tokenizer(VOCAB))


@functools.cache
def mask_after(history: tuple) -> torch.Tensor:
    """``[V]``: the grammar's mask after ``history`` (generated tokens), from a fresh state advanced along it; all
    False where the grammar refuses the history (its probability is 0 anyway)."""
    if history and not mask_after(history[:-1])[history[-1]]:
        return torch.zeros(VOCAB, dtype=torch.bool)
    state = small_grammar().start()
    assert all(state.advance(t) for t in history)
    return state.allowed()


def masks_of(histories: torch.Tensor) -> torch.Tensor:
    """``[N, V]``: :func:`mask_after` each history ``[N, L]``."""
    return torch.stack([mask_after(tuple(row)) for row in histories.tolist()])


@functools.cache
def exact_late_joint(name: str) -> torch.Tensor:
    """``P(t3, t4)`` of the target's masked (and, ``penalties``, processed) sampling at temperature 1: ``[V, V]``."""
    target, _ = models()
    controls = {"grammar": {}, "penalties": PENALTIES}[name]
    V, T = VOCAB, PROMPT.shape[1]
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V), torch.arange(V))  # [V^3, 3]
    seqs = torch.cat([PROMPT.expand(V**3, T), grid], dim=1)  # [V^3, T+3]
    with torch.no_grad():
        logits = target(seqs).logits.float()  # [V^3, T+3, V]
    joint = torch.ones(V**3, 1)
    for j in range(4):  # p(t1), p(t2 | t1), p(t3 | t1 t2), p(t4 | t1 t2 t3): each masked, then processed
        masked = logits[:, T - 1 + j].masked_fill(~masks_of(grid[:, :j]), -torch.inf)
        probs = torch.nan_to_num(reference_probs(masked, seqs[:, : T + j], T, controls))  # refused: all 0
        joint = joint * (probs.gather(1, grid[:, j : j + 1]) if j < 3 else probs)
    return joint.reshape(V, V, V, V).sum(dim=(0, 1))


@functools.cache
def programs():
    target, draft = models()
    sd = saguaro.compile(target, draft, k=2, mode="sd", backend="eager", sd_when_faster=False)
    ssd = saguaro.compile(
        target, draft, k=2, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )
    return sd, ssd


def late_joint(program, name: str):
    controls = {"grammar": small_grammar(), **({"grammar": {}, "penalties": PENALTIES}[name])}
    out = program.generate(
        PROMPT.expand(SAMPLES, -1),
        max_new_tokens=4,
        temperature=1.0,
        seed=0,
        eos_token_id=None,
        controls=controls,
    )
    t3, t4 = out.sequences[:, -2], out.sequences[:, -1]
    return torch.bincount(t3 * VOCAB + t4, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB), out.stats


def test_masks_along_a_speculation_are_the_states_after_each_draft_token_and_roll_back():
    tok = tiny_tokenizer(128)
    grammar = Grammar.regex(r"(a[bc]|d)+", tok)
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abcdx"}
    state = grammar.start()
    along = state.allowed_along([ids["a"], ids["b"], ids["d"]])  # [4, V]
    allowed = [set(row.nonzero().flatten().tolist()) for row in along]
    assert allowed[0] == {ids["a"], ids["d"]} and allowed[1] == {ids["b"], ids["c"]}
    assert allowed[2] == allowed[3] == {ids["a"], ids["d"], EOS}  # whole: the end-of-sequence token too
    assert set(state.allowed().nonzero().flatten().tolist()) == allowed[0]  # rolled back
    refused = state.allowed_along([ids["x"], ids["a"]])  # a refused draft token: later rows decide nothing
    assert refused[1:].all() and not state.ended
    assert state.advance(ids["d"]) and state.advance(EOS) and state.ended
    assert state.allowed().nonzero().flatten().tolist() == [EOS] and not state.advance(ids["a"])
    state.rollback(1)
    assert not state.ended and EOS in state.allowed().nonzero().flatten().tolist()


def test_a_token_its_mask_allows_and_its_matcher_refuses_is_never_accepted_and_ends_the_row(caplog):
    tok = tiny_tokenizer(128)
    grammar = Grammar.regex(r"(a[bc]|d)+", tok)
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abd"}
    state = grammar.start()
    advance = state.advance
    # llguidance#366: the matcher refuses a token its own mask allowed
    state.advance = lambda t: t != ids["a"] and advance(t)
    along = state.allowed_along([ids["a"], ids["b"]])
    assert not along[0, ids["a"]] and along[0, ids["d"]] and along[1:].all()  # a verify cannot accept "a"
    assert not state.ended and state.allowed()[ids["a"]]  # rolled back: the state itself is unchanged
    with caplog.at_level("WARNING", logger="saguaro.runtime.decode.controlled"):
        controlled.advance_rows([state], [[ids["d"], ids["a"], ids["b"]]])
    assert "refused by its matcher" in caplog.text and state.ended
    assert state.allowed().nonzero().flatten().tolist() == [EOS] and state.advance(EOS)


def test_masked_distribution_renormalises_and_falls_back_to_uniform():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.3, 0.5, 0.0]])
    allowed = torch.tensor([[False, False, True, True], [True, False, True, False]])
    out = lp.masked_distribution(probs, allowed)
    assert torch.allclose(out, torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.2 / 0.7, 0.0, 0.5 / 0.7, 0.0]]))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_under_a_json_schema_is_the_masked_targets_own_decoding_in_every_mode(family):
    tok = tiny_tokenizer(128)
    target = tiny_target(family, logit_scale=4.0)
    program = saguaro.compile(
        target, truncated_draft(target), k=3, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )
    grammar = Grammar.json_schema(SCHEMA, tok)
    prompt = torch.tensor([[5, 9, 17, 5, 9]])
    want, state = prompt.clone(), grammar.start()
    with (
        torch.no_grad()
    ):  # the reference: one forward per token, the argmax among the tokens the grammar allows
        for _ in range(60):
            logits = target(want).logits[:, -1].float().masked_fill(~state.allowed(), -torch.inf)
            token = int(logits.argmax(-1))
            assert state.advance(token)
            want = torch.cat([want, torch.tensor([[token]])], dim=1)
            if token == EOS:
                break
    text = tok.decode(want[0, prompt.shape[1] :], skip_special_tokens=True)
    assert json.loads(text).keys() == SCHEMA["properties"].keys()  # a whole document, ended by EOS
    for mode in ("ar", "sd", "ssd"):
        got = program.generate(prompt, max_new_tokens=60, mode=mode, controls={"grammar": grammar})
        assert torch.equal(got.sequences[:, : want.shape[1]], want), mode
        assert got.sequences.shape[1] == want.shape[1] or (got.sequences[0, want.shape[1] :] == EOS).all()
        if mode != "ar":
            assert got.stats["ran_as"] == "sd" and got.stats["mean_accepted_len"] > 1.5  # speculation pays
    assert "grammar" in got.stats["plan"]  # mode ssd says why it ran SD's rounds


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["grammar", "penalties"])
def test_sd_sampling_under_a_grammar_matches_the_masked_distribution(name):
    sd, _ = programs()
    counts, stats = late_joint(sd, name)
    assert 1.0 < stats["mean_accepted_len"]
    assert chi_square_pvalue(counts, exact_late_joint(name)) > 1e-3
    assert (counts[exact_late_joint(name) == 0] == 0).all()  # nothing the grammar refuses


@pytest.mark.heavy
def test_ssd_mode_under_a_grammar_samples_the_masked_distribution():
    _, ssd = programs()
    counts, stats = late_joint(ssd, "grammar")
    assert stats["ran_as"] == "sd"
    assert chi_square_pvalue(counts, exact_late_joint("grammar")) > 1e-3


@pytest.mark.heavy
def test_a_ratio_test_against_the_unmasked_draft_distribution_is_caught(monkeypatch):
    """The draft's tokens drawn from its masked distribution but verified against its unmasked one (a ``q`` that is
    not the one sampled from): every token still obeys the grammar, and the distribution is off."""
    sd, _ = programs()
    raw, mask, draft = [], lp.masked_distribution, controlled.draft_under_grammar

    def recording(probs, allowed):
        raw.append(probs)
        return mask(probs, allowed)

    def unmasked_q(*args):
        raw.clear()
        tokens, _ = draft(*args)
        return tokens, torch.stack(raw, dim=1)

    monkeypatch.setattr(controlled.lp, "masked_distribution", recording)
    monkeypatch.setattr(sd_decode, "draft_under_grammar", unmasked_q)
    counts, _ = late_joint(sd, "grammar")
    assert (counts[exact_late_joint("grammar") == 0] == 0).all()
    assert chi_square_pvalue(counts, exact_late_joint("grammar")) < 1e-6


def test_bad_grammars_are_refused():
    tok = tiny_tokenizer(128)
    with pytest.raises(GrammarError, match="Invalid type: foo"):
        Grammar.json_schema({"type": "foo"}, tok)
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema('{"type": ', tok)
    sd, _ = programs()
    with pytest.raises(saguaro.ControlError, match="built for 128 token ids; this model has 16"):
        sd.generate(PROMPT, max_new_tokens=2, controls={"grammar": Grammar.json_schema(None, tok)})
    with pytest.raises(saguaro.ControlError, match="give a saguaro.Grammar"):
        sd.generate(PROMPT, max_new_tokens=2, controls={"grammar": "json"})
