"""Sampling controls (``top_k``, ``top_p``, ``min_p``, repetition / presence / frequency penalties, ``logit_bias``)
are exact under speculation: greedy AR, SD and SSD equal ``transformers``' ``generate`` with its own processors;
sampled SD and SSD (cache hits, neural and fast fallbacks) draw from the target's own processed distribution,
computed here with ``transformers``' logits processors (and OpenAI's presence / frequency formula, which
``transformers`` lacks), checked by chi-square on many seeded samples; a verifier that ignores the controls is
caught; bad controls are refused by name."""

import functools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import saguaro
from saguaro.runtime.decode import controlled
from saguaro.tensor_math import logits_processing as lp
from tests.models import tiny_target, truncated_draft
from tests.stats_util import chi_square_pvalue

VOCAB = 16
SAMPLES = 6000
PROMPT = torch.tensor([[3, 7, 11, 4]])
FILTERS = dict(top_k=6, top_p=0.8, min_p=0.05)  # history-free: a filter of each position's distribution
PENALTIES = dict(
    repetition_penalty=1.5,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logit_bias={3: 1.5, 7: -2.0},
    top_p=0.9,
)  # history-dependent: along a speculation, each position counts the drafts before it


def hf_processors(controls: dict, temperature: float) -> LogitsProcessorList:
    """``transformers``' processors for ``controls``, in the order ``logits_processing`` documents."""
    chain = []
    if controls.get("logit_bias"):
        chain.append(SequenceBiasLogitsProcessor({(t,): b for t, b in controls["logit_bias"].items()}))
    if controls.get("repetition_penalty", 1.0) != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"]))
    if temperature > 0:
        chain.append(TemperatureLogitsWarper(temperature))
        if controls.get("top_k"):
            chain.append(TopKLogitsWarper(controls["top_k"]))
        if controls.get("top_p", 1.0) < 1.0:
            chain.append(TopPLogitsWarper(controls["top_p"]))
        if controls.get("min_p"):
            chain.append(MinPLogitsWarper(controls["min_p"]))
    return LogitsProcessorList(chain)


def reference_probs(
    logits: torch.Tensor, history: torch.Tensor, prompt_len: int, controls: dict, temperature: float = 1.0
) -> torch.Tensor:
    """The processed distribution ``[N, V]`` after ``history [N, L]`` (its first ``prompt_len`` the prompt) from
    ``logits [N, V]``: presence / frequency as OpenAI states them (applied after the repetition penalty, before
    the temperature: split around transformers' chain), the rest by transformers' processors."""
    before = {k: v for k, v in controls.items() if k in ("logit_bias", "repetition_penalty")}
    scores = hf_processors(before, 0.0)(history, logits.float().clone())
    output = torch.nn.functional.one_hot(history[:, prompt_len:], VOCAB).sum(1).float()  # [N, V]
    scores = (
        scores
        - controls.get("frequency_penalty", 0.0) * output
        - controls.get("presence_penalty", 0.0) * (output > 0).float()
    )
    after = {k: v for k, v in controls.items() if k in ("top_k", "top_p", "min_p")}
    return torch.softmax(hf_processors(after, temperature)(history, scores), dim=-1)


@functools.cache
def models():
    target = tiny_target("llama", vocab_size=VOCAB, logit_scale=12.0, seed=5)
    return target, truncated_draft(target, noise=0.8)


@functools.cache
def exact_late_joint(name: str) -> torch.Tensor:
    """``P(t3, t4)`` under the controls ``name`` names at temperature 1, summed over ``t1, t2``: ``[V, V]``."""
    target, _ = models()
    controls = {"filters": FILTERS, "penalties": PENALTIES}[name]
    V, T = VOCAB, PROMPT.shape[1]
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V), torch.arange(V))  # [V^3, 3]
    seqs = torch.cat([PROMPT.expand(V**3, T), grid], dim=1)  # [V^3, T+3]
    with torch.no_grad():
        logits = target(seqs).logits.float()  # [V^3, T+3, V]
    joint = torch.ones(V**3, 1)
    for j in range(3):  # p(t1), p(t2 | t1), p(t3 | t1 t2), each processed with its history
        probs = reference_probs(logits[:, T - 1 + j], seqs[:, : T + j], T, controls)
        joint = joint * probs.gather(1, grid[:, j : j + 1])
    last = reference_probs(logits[:, T + 2], seqs, T, controls)  # p(t4 | t1 t2 t3)
    return (joint * last).reshape(V, V, V, V).sum(dim=(0, 1))


@functools.cache
def programs():
    target, draft = models()
    sd = saguaro.compile(target, draft, k=2, mode="sd", backend="eager", sd_when_faster=False)
    ssd = saguaro.compile(
        target, draft, k=1, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )
    return sd, ssd


def late_joint(program, controls: dict, mode: str):
    out = program.generate(
        PROMPT.expand(SAMPLES, -1),
        max_new_tokens=4,
        temperature=1.0,
        seed=0,
        mode=mode,
        eos_token_id=None,
        controls=controls,
    )
    t3, t4 = out.sequences[:, -2], out.sequences[:, -1]
    return torch.bincount(t3 * VOCAB + t4, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB), out.stats


SSD_PATHS = {
    "hits_only": dict(fan_out=[VOCAB - 1, VOCAB], fallback="neural"),
    "neural_misses": dict(fan_out=0, fallback="neural"),
    "fast_misses": dict(fan_out=0, fallback="fast"),
}


def test_processing_equals_transformers_processors_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=gen) * 3
    history = torch.randint(0, VOCAB, (64, 9), generator=gen)
    for controls in (FILTERS, PENALTIES, dict(top_k=1), dict(top_p=0.3, repetition_penalty=0.7)):
        c = lp.SamplingControls.of(**controls)
        seen = lp.token_counts(history, torch.ones_like(history, dtype=torch.bool), VOCAB)
        output = lp.token_counts(history[:, 4:], torch.ones_like(history[:, 4:], dtype=torch.bool), VOCAB)
        ours = lp.processed_probabilities(logits, 0.7, c, seen, output)
        assert torch.allclose(ours, reference_probs(logits, history, 4, controls, 0.7), atol=1e-6), controls
        assert torch.equal(
            ours > 0, reference_probs(logits, history, 4, controls, 0.7) > 0
        )  # the same support


def test_path_counts_add_the_drafts_before_each_position():
    counts = torch.tensor([[1.0, 0, 2, 0]])
    rows = lp.path_counts(counts, torch.tensor([[3, 3, 0]]))  # [1, 4, 4]
    assert rows[0].tolist() == [[1, 0, 2, 0], [1, 0, 2, 1], [1, 0, 2, 2], [2, 0, 2, 2]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_under_penalties_and_bias_equals_transformers_generate(family):
    target = tiny_target(family, logit_scale=4.0)
    draft = truncated_draft(target)
    program = saguaro.compile(
        target, draft, k=3, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )
    prompt = torch.tensor([[5, 9, 17, 5, 9]])
    controls = dict(
        repetition_penalty=1.8, logit_bias={11: 3.0, 40: -5.0}, top_k=3
    )  # top_k: no effect greedy
    with torch.no_grad():
        want = target.generate(
            prompt,
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            sequence_bias={(11,): 3.0, (40,): -5.0},
            pad_token_id=0,
        )
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert not torch.equal(want, plain)  # the controls change the greedy text
    for mode in ("ar", "sd", "ssd"):
        got = program.generate(prompt, max_new_tokens=12, mode=mode, eos_token_id=None, controls=controls)
        assert torch.equal(got.sequences, want), mode


def test_greedy_under_presence_and_frequency_equals_the_formula():
    target, draft = models()
    sd, ssd = programs()
    controls = dict(presence_penalty=1.5, frequency_penalty=1.0)
    seq = PROMPT.clone()
    with torch.no_grad():
        for _ in range(10):  # the reference: one forward per token, the penalties on the output so far
            scores = target(seq).logits[:, -1].float()
            output = torch.nn.functional.one_hot(seq[:, PROMPT.shape[1] :], VOCAB).sum(1).float()
            scores = scores - 1.0 * output - 1.5 * (output > 0).float()
            seq = torch.cat([seq, scores.argmax(-1, keepdim=True)], dim=1)
    assert not torch.equal(seq, target.generate(PROMPT, max_new_tokens=10, do_sample=False, pad_token_id=0))
    for program, mode in ((sd, "ar"), (sd, "sd"), (ssd, "ssd")):
        got = program.generate(PROMPT, max_new_tokens=10, mode=mode, eos_token_id=None, controls=controls)
        assert torch.equal(got.sequences, seq), mode


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["filters", "penalties"])
def test_sd_sampling_under_controls_matches_the_processed_distribution(name):
    sd, _ = programs()
    counts, stats = late_joint(sd, {"filters": FILTERS, "penalties": PENALTIES}[name], "sd")
    assert 1.0 < stats["mean_accepted_len"]  # the draft's tokens are accepted in some rounds
    assert chi_square_pvalue(counts, exact_late_joint(name)) > 1e-3


@pytest.mark.heavy
@pytest.mark.parametrize(
    "path, name",
    [
        ("hits_only", "penalties"),
        ("neural_misses", "penalties"),
        ("fast_misses", "penalties"),
        ("hits_only", "filters"),
    ],
)
def test_ssd_sampling_under_controls_matches_the_processed_distribution(path, name):
    _, ssd = programs()
    counts, stats = late_joint(
        ssd.reconfigure(**SSD_PATHS[path]), {"filters": FILTERS, "penalties": PENALTIES}[name], "ssd"
    )
    if path == "hits_only":
        assert stats["cache_hit_rate"] == 1.0
    else:
        assert stats["cache_hit_rate"] == 0.0 and stats["fallbacks"][path.split("_")[0]] > 0
    assert chi_square_pvalue(counts, exact_late_joint(name)) > 1e-3


@pytest.mark.heavy
def test_a_verifier_that_ignores_the_controls_is_caught(monkeypatch):
    sd, _ = programs()
    ignoring = lambda logits, temperature, controls, seen=None, output=None, allowed=None: torch.softmax(
        logits / temperature, -1
    )
    monkeypatch.setattr(controlled.lp, "processed_probabilities", ignoring)
    counts, _ = late_joint(sd, PENALTIES, "sd")
    assert chi_square_pvalue(counts, exact_late_joint("penalties")) < 1e-6


@pytest.mark.parametrize(
    "controls, message",
    [
        (dict(top_p=0.0), "top_p=0.0 is not allowed: it must be a number in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-2), "top_k=-2 is not allowed"),
        (dict(min_p=2), "min_p=2"),
        (dict(presence_penalty=3), "presence_penalty=3"),
        (dict(repetition_penalty=0), "repetition_penalty=0"),
        (
            dict(logit_bias={VOCAB: 1.0}),
            f"logit_bias token id {VOCAB} is not allowed: ids are 0..{VOCAB - 1}",
        ),
        (dict(logit_bias={"x": 1.0}), "logit_bias key 'x'"),
        (dict(logit_bias={2: 101}), "logit_bias[2]=101"),
    ],
)
def test_bad_controls_are_refused_by_name(controls, message):
    sd, _ = programs()
    with pytest.raises(ValueError) as caught:
        sd.generate(PROMPT, max_new_tokens=2, controls=controls)
    assert message in str(caught.value)


def test_unknown_control_and_wrong_type_are_refused():
    sd, _ = programs()
    with pytest.raises(TypeError, match=r"\['top_q'\] are not sampling controls"):
        sd.generate(PROMPT, max_new_tokens=2, controls={"top_q": 0.5})
    with pytest.raises(TypeError, match="give a SamplingControls"):
        sd.generate(PROMPT, max_new_tokens=2, controls=0.5)
