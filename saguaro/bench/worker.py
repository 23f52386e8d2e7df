"""One benchmark row in a process of its own, so every mode gets the same fresh machine state.

``python -m saguaro.bench.worker PARAMS_JSON MODE BACKEND`` loads the pair, compiles and warms up every batch,
then answers its parent in JSON lines, one request on stdin, one answer on stdout:

- once warm: ``{"ready": true, "setup_s": S}`` (S: capture, compile and warm-up; null for ``transformers``);
- ``{"do": "time"}``: one timed pass, ``{"timed": {"tokens_per_s": X, "started": T0, "ended": T1}}``;
- ``{"do": "finish"}``: the trace (``trace_dir``), then ``{"row": {...}}``, and the process exits.

It exits too when its stdin closes. Other stdout output goes to stderr, which holds a failing row's traceback
(exit status non-zero). :class:`RowSession` is the same row in the caller's process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from saguaro.bench.bandwidth import token_bytes
from saguaro.bench.prompts import PromptSet, prompt_set
from saguaro.bench.rows import DRAFT_MODES, SAGUARO_MODES, RowTimer, compile_for


@dataclass(frozen=True)
class BenchParams:
    """What one benchmark run measures. ``modes=None``: every row that applies."""

    target: str | None = None  # a save_pretrained folder; None with draft None: the default pair
    draft: str | None = None
    modes: tuple | None = None
    prompts: int = 8
    batch: int = 1
    k: int = 5
    max_new_tokens: int = 64
    temperature: float = 0.0
    backend: str = "inductor"  # "eager", "inductor" or "both"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    same_process: bool = False  # every row in the caller's process instead of one process each
    trace_dir: str | None = None  # write one timeline per Saguaro row here
    plan: str = "auto"  # "always-ssd": sd_when_faster=False, SSD's own rounds on any machine
    repeats: int = 3  # timed passes per row, the rows' passes alternating
    linears: str = "auto"  # SaguaroConfig.linears of the Saguaro rows
    narrow_weights: bool = True  # SaguaroConfig.narrow_weights of the Saguaro rows
    # SaguaroConfig.weights / draft_weights / weight_group_size of the Saguaro rows
    weights: str = "as-loaded"
    draft_weights: str | None = None
    weight_group_size: int | None = None

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} is not allowed: it must be an int >= 1")


def run_prompts(params: BenchParams, tokenizer, target) -> PromptSet:
    """The run's prompts, deterministic (every row's process builds the same): held-out text for the
    default pair, each leaving ``max_new_tokens`` positions."""
    default_pair = params.target is None and params.draft is None
    positions = getattr(target.config, "max_position_embeddings", None)
    room = positions - params.max_new_tokens if positions else None
    return prompt_set(tokenizer, params.prompts, target.config.vocab_size, params.seed, default_pair, room)


class RowSession:
    """One row in this process: load the pair, compile for ``backend`` (a Saguaro row) and warm up; then
    :meth:`time_pass` as often as the caller asks, and :meth:`finish` for the row."""

    def __init__(self, params: BenchParams, mode: str, backend: str):
        from saguaro.models_io import DTYPES, load_pair

        if params.threads is not None:
            torch.set_num_threads(params.threads)
        self.params = params
        self.mode = mode
        self.backend = backend
        need_draft = mode in DRAFT_MODES
        target, draft, tokenizer = load_pair(
            params.target,
            params.draft,
            need_draft=need_draft,
            dtype=DTYPES[params.dtype],
            device=params.device,
        )
        draft = draft if need_draft else None
        self.prompts = run_prompts(params, tokenizer, target)
        self.program = None
        started = time.perf_counter()
        try:
            if mode in SAGUARO_MODES:
                self.program = compile_for(
                    target,
                    draft,
                    params.k,
                    backend,
                    sd_when_faster=params.plan != "always-ssd",
                    linears=params.linears,
                    narrow_weights=params.narrow_weights,
                    weights=params.weights,
                    draft_weights=params.draft_weights,
                    weight_group_size=params.weight_group_size,
                )
            self.timer = RowTimer(
                target,
                draft,
                self.program,
                self.prompts.ids,
                mode,
                params.k,
                params.max_new_tokens,
                params.temperature,
                params.batch,
                params.seed,
            )
            self.timer.warm_up()
        except BaseException:
            self.close()
            raise
        # capture, compile and the warm-up pass
        self.setup_s = time.perf_counter() - started if mode in SAGUARO_MODES else None

    def time_pass(self) -> dict:
        """One timed pass: its tokens/s and its start and end (epoch seconds)."""
        return self.timer.timed_pass().brief()

    def finish(self) -> dict:
        """The row from its timed passes (after the trace, with ``trace_dir``); the program is closed."""
        try:
            if self.params.trace_dir is not None:
                self.timer.write_trace(self.params.trace_dir, self.backend)
            row = self.timer.row()
            if self.mode in SAGUARO_MODES:  # from the stages the row built: what it streamed
                row["weight_bytes_per_token"] = token_bytes(
                    self.program, self.mode, self.params.k, row.get("mean_accepted_len")
                )
        finally:
            self.close()
        if self.mode in SAGUARO_MODES:
            row["backend"] = self.backend
        ssd = self.mode.startswith("ssd") and torch.device(self.params.device).type == "cpu"
        threads = torch.get_num_threads()
        row["threads"] = {"target": 1, "draft": 1} if ssd else {"target": threads, "draft": threads}
        row["setup_s"] = self.setup_s
        row["prompt_source"] = self.prompts.source
        return row

    def close(self) -> None:
        if self.program is not None:
            self.program.close()
            self.program = None


def main(argv=None) -> int:
    params_json, mode, backend = argv if argv is not None else sys.argv[1:]
    fields = json.loads(params_json)
    fields["modes"] = tuple(fields["modes"]) if fields.get("modes") else None
    answers = _answer_channel()
    session = RowSession(BenchParams(**fields), mode, backend)
    try:
        _send(answers, {"ready": True, "setup_s": session.setup_s})
        for line in sys.stdin:
            request = json.loads(line)["do"]
            if request == "time":
                _send(answers, {"timed": session.time_pass()})
            elif request == "finish":
                _send(answers, {"row": session.finish()})
                return 0
            else:
                raise ValueError(f"request {request!r} is not allowed: 'time' or 'finish'")
        return 0  # stdin closed: the parent is gone or gave up on this row
    finally:
        session.close()
        # the process ends here: skip the interpreter's last collection over torch's heap, slow, see
        # docs/measurements/2026-12-07-figures-from-runtime-bench-cli.md
        gc.freeze()


def _answer_channel():
    """The process's stdout as a private stream for the answers; file descriptor 1 (what a library
    prints, in Python or C) goes to stderr from then on, so no stray line breaks the protocol."""
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by the row's own processes
    os.dup2(2, 1)
    return answers


def _send(stream, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def params_json(params: BenchParams) -> str:
    return json.dumps(asdict(params))


if __name__ == "__main__":
    sys.exit(main())
