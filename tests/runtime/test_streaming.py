"""Streaming (``saguaro.runtime.streaming``): ``program.stream`` hands out each round's tokens before the
next round runs, and they add up to ``generate``'s sequences token for token; ``generate(streamer=)``
feeds ``transformers`` streamers the same tokens; errors surface from the iterator and closing early
leaves no thread behind and the lane usable. Tiny pair, eager, thread lane."""

import threading

import pytest
import torch

from saguaro.core.errors import SaguaroError
from saguaro.runtime.base.state import DecodeState
from tests.conftest import tiny_program
from tests.models import prompts
from tests.tiny_tokenizer import tiny_tokenizer

NEW = 12


def counting_rounds(monkeypatch) -> list:
    """Patch the decoders' round hook to count its calls (made before the round is handed out)."""
    calls, real = [0], DecodeState.round_committed

    def counted(self):
        calls[0] += 1
        real(self)

    monkeypatch.setattr(DecodeState, "round_committed", counted)
    return calls


def stream_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "saguaro-stream"]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("batch", [1, 2])
def test_stream_yields_each_round_before_the_next_and_adds_up_to_generate(mode, batch, monkeypatch):
    # a fixed tree and SSD's own rounds: the planner's trees and its SD-or-SSD verdict follow measured
    # times, so two SSD calls could run different rounds and the counts below would compare unlike calls
    target, draft, program = tiny_program(
        "llama", mode=mode, lane="thread", fan_out="geometric", sd_when_faster=False
    )
    ids, mask = prompts(batch, 8, seed=3, pad_rows={1: 3} if batch == 2 else None)
    try:
        plain = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        # an EOS that row 0 meets from its 4th new token on and row 1 never: rows end in different rounds
        rows = [plain.sequences[b, ids.shape[1] :].tolist() for b in range(batch)]
        eos = next(t for t in rows[0][3:] if all(t not in r for r in rows[1:]))
        expected = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
        calls = counting_rounds(monkeypatch)
        stream = program.stream(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
        chunks = []
        for chunk in stream:
            # strict turns: the round hook has run once per round handed out, the next round has not run
            assert calls[0] == chunk.round + 1 == len(chunks) + 1
            chunks.append(chunk)
    finally:
        program.close()
    assert len(chunks) == expected.stats["rounds"] + 1 > 2  # the prefill's token, then one chunk per round
    assert not stream_threads()
    assert torch.equal(stream.output.sequences, expected.sequences)  # the same tokens, every mode
    assert stream.output.stats["ran_as"] == mode
    T = ids.shape[1]
    for b in range(batch):
        row = ids[b].tolist() + [t for chunk in chunks for t in chunk.new_tokens[b]]
        assert row == expected.sequences[b, : len(row)].tolist()
        assert (expected.sequences[b, len(row) :] == 0).all()  # the padding of a row that finished first
        assert all(len(c.new_tokens[b]) <= program.config.k + 1 for c in chunks)
        # a row is finished from the round that gave it its EOS (or its last token) on, and gains nothing after
        done_at = next(i for i, c in enumerate(chunks) if c.finished[b])
        assert sum(len(c.new_tokens[b]) for c in chunks[: done_at + 1]) == len(row) - T
        assert all(c.finished[b] and not c.new_tokens[b] for c in chunks[done_at + 1 :])
    assert chunks[-1].finished == [True] * batch and chunks[-2].finished != [True] * batch
    if batch == 2:
        assert any(c.finished == [True, False] for c in chunks)  # row 0 (its EOS) ended first


def test_transformers_streamers_receive_exactly_the_tokens_of_generate():
    from transformers import TextIteratorStreamer, TextStreamer
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ends += 1

    class Printed(TextStreamer):
        text = ""

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

    tok = tiny_tokenizer()
    target, draft, program = tiny_program("llama", mode="ssd", lane="thread")
    ids = tok("def f(x):", return_tensors="pt").input_ids  # [1, T]
    try:
        expected = program.generate(ids, max_new_tokens=NEW, eos_token_id=None)
        recorder, printed, queued = Recorder(), Printed(tok), TextIteratorStreamer(tok, skip_prompt=True)
        for streamer in (recorder, printed, queued):
            out = program.generate(ids, max_new_tokens=NEW, eos_token_id=None, streamer=streamer)
            assert torch.equal(out.sequences, expected.sequences)
        with pytest.raises(ValueError, match="batch of 2"):  # as in transformers: one sequence
            program.generate(torch.cat([ids, ids]), max_new_tokens=NEW, streamer=Recorder())
    finally:
        program.close()
    # the prompt first, as transformers puts it, then each round's tokens [1, n], then end() once
    assert torch.equal(recorder.puts[0], ids) and recorder.ends == 1
    assert all(p.dim() == 2 and p.shape[0] == 1 and p.shape[1] >= 1 for p in recorder.puts[1:])
    assert len(recorder.puts) == expected.stats["rounds"] + 2
    assert torch.equal(torch.cat(recorder.puts, dim=1), expected.sequences)
    assert printed.text == tok.decode(expected.sequences[0])
    assert "".join(queued) == tok.decode(expected.sequences[0, ids.shape[1] :])


def test_errors_surface_from_the_iterator_and_closing_early_leaves_the_lane_usable(monkeypatch):
    target, draft, program = tiny_program("llama", mode="ssd", lane="thread")
    ids, mask = prompts(2, 8, seed=4, pad_rows={0: 2})
    try:
        expected = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        lane = program.lanes.lane()
        with pytest.raises(ValueError, match="max_new_tokens"):  # a bad argument: raised by next()
            next(program.stream(ids, attention_mask=mask, max_new_tokens=0))
        with pytest.raises(TypeError):  # a wrong name: at once
            program.stream(ids, max_new_tokenz=3)
        # closed after two rounds (explicitly, and by dropping the iterator): the generation stops there
        for drop in (False, True):
            calls = counting_rounds(monkeypatch)
            stream = program.stream(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
            next(stream), next(stream)
            # the stream holds the Program until it ends: a call from the reader's thread is refused, not a hang
            with pytest.raises(SaguaroError, match="reading a program.stream"):
                program.generate(ids, attention_mask=mask, max_new_tokens=2)
            with pytest.raises(SaguaroError, match="reading a program.stream"):
                next(program.stream(ids, attention_mask=mask, max_new_tokens=2))
            if drop:
                del stream
            else:
                stream.close()
                assert stream.output is None
            assert calls[0] == 2 and not stream_threads()
            monkeypatch.undo()
        # an error inside the generation, mid-way: raised by the iterator, after the rounds before it
        real, verifies = program.target.run, [0]

        def failing(stage, *args):
            verifies[0] += stage.qualified.startswith("target.verify")
            if verifies[0] == 3:
                raise RuntimeError("verify failed")
            return real(stage, *args)

        monkeypatch.setattr(program.target, "run", failing)
        stream = program.stream(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        got = []
        with pytest.raises(RuntimeError, match="verify failed"):
            for chunk in stream:
                got.append(chunk)
        monkeypatch.undo()
        assert len(got) == 3 and not stream_threads()  # the prefill's token and two rounds
        # the same lane, in step: the next generation gives the same tokens
        again = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(again.sequences, expected.sequences)
        assert program.lanes.lane() is lane and again.stats["lane_failures"] == 0
    finally:
        program.close()


def test_ctrl_c_while_the_reader_waits_stops_the_generation_and_leaves_the_lane_in_step(monkeypatch):
    import signal

    target, draft, program = tiny_program("llama", mode="ssd", lane="thread")
    ids, mask = prompts(1, 8, seed=5)
    real, calls = DecodeState.round_committed, [0]

    def sigint_at_third(self):  # on the generating thread, while the reader waits in next()
        calls[0] += 1
        if calls[0] == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        real(self)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a user's script
    try:
        expected = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        lane = program.lanes.lane()
        monkeypatch.setattr(DecodeState, "round_committed", sigint_at_third)
        got = []
        with pytest.raises(KeyboardInterrupt):
            for chunk in program.stream(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None):
                got.append(chunk)
        monkeypatch.undo()
        assert len(got) == 2 and calls[0] == 3 and not stream_threads()  # stopped at the round it was in
        again = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(again.sequences, expected.sequences) and program.lanes.lane() is lane
    finally:
        signal.signal(signal.SIGINT, previous)
        program.close()
