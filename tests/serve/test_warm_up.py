"""``saguaro serve --warm-up`` (``saguaro.serve.warm_up``): before the server says it is ready, each kind of batch
its scheduler makes runs once (greedy and sampled, one row then two; mode ``ssd`` also a sampled batch of SD's
rounds and a seeded sampled request alone), so Inductor compiles every stage shape then. Checked on eager programs with the Inductor test forced
(what each warm-up runs does not depend on the backend); eager alone skips it."""

import pytest

from saguaro.cli.main import build_parser, subcommands
from saguaro.runtime.batching import BatchSession
from saguaro.serve import warm_up as warm
from tests.conftest import tiny_program
from tests.tiny_tokenizer import tiny_tokenizer


def record_runs(monkeypatch, program, given_k=None):
    """``[(temperature, rows, mode) of each round]`` and ``[(temperature, seed) of each stream]`` while warming
    up; ``given_k``: a list that takes ``(temperature, rows, run)`` of each round given its ``k`` (1)."""
    rounds, streams = [], []
    step, stream = BatchSession.step, type(program).stream

    def recording_step(session, k=None):
        rounds.append((session.temperature, session.size, session.mode))
        if k is not None and given_k is not None:
            given_k.append((session.temperature, session.size, session.run, k))
        return step(session, k)

    def recording_stream(self, *args, **kwargs):
        streams.append((kwargs.get("temperature"), kwargs.get("seed")))
        return stream(self, *args, **kwargs)

    monkeypatch.setattr(BatchSession, "step", recording_step)
    monkeypatch.setattr(type(program), "stream", recording_stream)
    monkeypatch.setattr(warm, "needs_warm_up", lambda program: True)
    return rounds, streams


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_warm_up_runs_each_kind_of_batch_the_server_makes(monkeypatch, mode):
    _, _, program = tiny_program("llama", mode=mode)
    rounds, streams = record_runs(monkeypatch, program)
    assert warm.warm_up(program, tiny_tokenizer(), max_batch=8) >= 0
    for temperature in (0.0, warm.SAMPLED_TEMPERATURE):
        sizes = {rows for t, rows, _ in rounds if t == temperature}
        assert {1, 2} <= sizes, (
            temperature,
            sizes,
        )  # batch 1 static, then the batch size Inductor makes dynamic
    seeded_sd = {rows for t, rows, run in rounds if t > 0 and run == "sd"}  # ssd: seeded requests planned SD
    assert seeded_sd >= ({1, 2} if mode in ("sd", "ssd") else set())
    assert {run for _, _, run in rounds} == ({mode, "sd"} if mode == "ssd" else {mode})
    assert streams == (
        [(warm.SAMPLED_TEMPERATURE, 0)] if mode == "ssd" else []
    )  # ssd: a seeded request alone


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_warm_up_runs_sd_rounds_of_a_shorter_speculation_too(monkeypatch, mode):
    """A batch session may draft fewer than ``k`` tokens a round (``runtime/speculation_length.py``): each batch
    of SD's rounds runs again at ``k`` 1, one row then two, so the verify's width is compiled dynamic before
    the server is ready."""
    _, _, program = tiny_program("llama", mode=mode)
    given = []
    record_runs(monkeypatch, program, given)
    warm.warm_up(program, tiny_tokenizer(), max_batch=8)
    assert {k for *_, k in given} <= {1} and {run for _, _, run, _ in given} <= {"sd"}
    temperatures = {"ar": (), "sd": (0.0, warm.SAMPLED_TEMPERATURE), "ssd": (warm.SAMPLED_TEMPERATURE,)}[mode]
    want = {(t, rows) for t in temperatures for rows in (1, 2)}  # ssd: its batches of SD's rounds are sampled
    assert {(t, rows) for t, rows, _, _ in given} >= want and (mode != "ar" or not given)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_warm_up_runs_rows_under_sampling_controls_where_the_rounds_need_their_stage(monkeypatch, mode):
    """SD's and SSD's rounds decide under sampling controls through ``target.verify_logits``: a batch of one row,
    then two, runs it, and another under a grammar (the draft's one-token step under its masks); AR's controls
    decide on the host from the step it has run already."""
    _, _, program = tiny_program("llama", mode=mode)
    controlled = []
    step = BatchSession.step

    def recording_step(session, k=None):
        if session.controls is not None:
            grammar = session.controls.grammar is not None
            controlled.append((session.size, session.controls.top_p, grammar, session.run))
        return step(session, k)

    monkeypatch.setattr(BatchSession, "step", recording_step)
    monkeypatch.setattr(warm, "needs_warm_up", lambda program: True)
    warm.warm_up(program, tiny_tokenizer(), max_batch=8)
    if mode == "ar":
        assert controlled == []
    else:
        plain = [(rows, top_p) for rows, top_p, grammar, _ in controlled if not grammar]
        assert {rows for rows, _ in plain} >= {1, 2} and {top_p for _, top_p in plain} == {warm.WARM_UP_TOP_P}
        under_grammar = [(rows, run) for rows, _, grammar, run in controlled if grammar]
        assert {rows for rows, _ in under_grammar} >= {1, 2} and {run for _, run in under_grammar} == {"sd"}


def test_warm_up_of_a_one_row_server_runs_one_row_batches(monkeypatch):
    _, _, program = tiny_program("llama", mode="sd")
    rounds, _ = record_runs(monkeypatch, program)
    warm.warm_up(program, None, max_batch=1)  # no tokenizer: ids counted from 1
    assert {rows for _, rows, _ in rounds} == {1} and {t for t, _, _ in rounds} == {
        0.0,
        warm.SAMPLED_TEMPERATURE,
    }


def test_eager_has_nothing_to_warm_up_and_the_flag_turns_it_off():
    _, _, program = tiny_program("llama", mode="sd")
    assert program.config.backend == "eager" and not warm.needs_warm_up(program)
    assert warm.warm_up(program, None, max_batch=8) == 0.0
    parser = build_parser(subcommands())
    assert parser.parse_args(["serve"]).warm_up is True
    assert parser.parse_args(["serve", "--no-warm-up"]).warm_up is False


def test_warm_up_prompts_come_from_the_tokenizer_or_count_from_one():
    tok = tiny_tokenizer()
    prompts = warm.warm_up_prompts(tok, 128)
    assert prompts == [list(tok(text)["input_ids"]) for text in warm.WARM_UP_TEXTS] and all(prompts)
    assert warm.warm_up_prompts(None, 128) == [[1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7]]


def test_a_warm_up_batch_runs_its_round_of_two_rows_when_a_row_ends_early():
    class Session:  # BatchSession's part _rounds uses: join, step, size
        def __init__(self, lives):
            self.lives, self.rows, self.sizes = (
                list(lives),
                [],
                [],
            )  # rounds each joined row lives (0: ends at join)

        @property
        def size(self):
            return len(self.rows)

        def join(self, prompt, max_new_tokens):
            if (life := self.lives.pop(0)) > 0:
                self.rows.append([prompt, life])

        def step(self, k=None):
            self.sizes.append(self.size)
            for row in self.rows:
                row[1] -= 1
            self.rows = [row for row in self.rows if row[1] > 0]

    # the first row ends in its round, the next ends as it joins: two more joins make the batch of two
    session = Session([1, 0, 3, 3])
    warm._rounds(session, [[5, 6], [7, 8]], None)
    assert session.sizes[:2] == [1, 2] and session.sizes[-1] > 0 and not session.rows
    assert not session.lives  # every join tried was needed
    with pytest.raises(RuntimeError, match="a batch did not end"):
        warm._rounds(Session([1000, 1000]), [[5, 6], [7, 8]], None)
