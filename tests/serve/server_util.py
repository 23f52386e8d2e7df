"""A ``saguaro serve`` server on loopback for the tests: in this process (a thread, an ephemeral port) over a
tiny program, and each request's solo answer from ``program.generate`` to compare it with."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from saguaro.serve.server import bound_socket, make_server
from tests.tiny_tokenizer import tiny_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass
class Running:
    url: str
    server: object
    service: object
    thread: threading.Thread
    program: object
    tokenizer: object

    def wait_idle(self) -> None:
        """Until the scheduler has no batch running (a batch's stats are recorded after its last answer is sent)."""
        scheduler = self.service.scheduler
        for _ in range(600):
            if scheduler.running == 0 and scheduler.queue_depth == 0:
                return
            threading.Event().wait(0.1)
        raise AssertionError("the scheduler did not become idle")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop"


def start(program, tokenizer=None, **options) -> Running:
    """Serve ``program`` on 127.0.0.1, a port the system picks; returns once it takes requests."""
    tokenizer = tokenizer if tokenizer is not None else chat_tokenizer()
    ready = threading.Event()
    server, service = make_server(
        program, tokenizer, "tiny", "127.0.0.1", 0, announce=lambda h, p: ready.set(), **options
    )
    sock = bound_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert ready.wait(60), "the server did not start"
    return Running(f"http://127.0.0.1:{server.port}/v1", server, service, thread, program, tokenizer)


def solo(program, prompt_ids, max_tokens, temperature=0.0, seed=None) -> list:
    """What ``program.generate`` gives this prompt alone: the new tokens, up to and with the first EOS."""
    out = program.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_tokens, temperature=temperature, seed=seed
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    eos = program.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
