"""``saguaro generate``: complete one prompt with a compiled (or ``--program``-loaded) pair, printing the
completion as each round decides it, then a stats line. Stages run eager while Inductor compiles them in
the background (``--compile background``, the default here); on a terminal each compile shows a progress
line on stderr until the text starts (``-q``: none)."""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager

from saguaro.cli.args import add_linears_arg, add_model_args, add_plan_arg, sd_when_faster, weight_options
from saguaro.cli.program import add_program_arg, check_program_args, load_program
from saguaro.cli.registry import Subcommand
from saguaro.core.config import COMPILE_MODES, MODES
from saguaro.core.errors import SaguaroError
from saguaro.runtime.base.stats import ran_as_sd


def add_arguments(gen) -> None:
    gen.add_argument("--prompt", required=True, help="text to complete")
    gen.add_argument(
        "--mode",
        default="sd",
        choices=list(MODES),
        help="ar: target alone; sd: speculative decoding; ssd: speculative speculative decoding (default sd)",
    )
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="write a timeline of the call here (Chrome trace-event JSON: open it in "
        "https://ui.perfetto.dev or chrome://tracing)",
    )
    gen.add_argument(
        "--compile",
        default="background",
        choices=list(COMPILE_MODES),
        help="background (default): stages run eager at once while Inductor compiles them, each "
        "switching to its compiled form when ready (the same greedy tokens); blocking: wait for "
        "each compile (what benchmarks time; a --seed reproduces sampled text only then)",
    )
    gen.add_argument("-q", "--quiet", action="store_true", help="no compile progress lines on stderr")
    add_plan_arg(gen)
    add_model_args(gen)
    add_linears_arg(gen)
    add_program_arg(gen)


def run(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text to complete")
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    check_program_args(args)
    if args.program is not None:
        program, tokenizer = load_program(args)
        if tokenizer is None:
            raise SaguaroError(
                f"no tokenizer in the exported program {args.program!r}; generate needs one to read "
                "--prompt (export with a tokenizer beside the target)"
            )
    else:
        target, draft, tokenizer = load_pair(
            args.target,
            args.draft,
            need_draft=args.mode != "ar",
            dtype=DTYPES[args.dtype],
            device=args.device,
        )
        if tokenizer is None:
            raise SaguaroError(
                f"no tokenizer beside the target in {args.target!r}; generate needs one to read --prompt"
            )
        if args.mode == "ar":
            draft = None  # AR never runs the draft: do not capture it
        program = saguaro_compile(
            target,
            draft,
            k=args.k,
            mode=args.mode,
            backend=args.backend,
            compile=args.compile,
            sd_when_faster=sd_when_faster(args),
            linears=args.linears,
            narrow_weights=args.narrow_weights == "on",
            **weight_options(args),
        )
    if not sd_when_faster(args) and args.program is not None:
        program = program.reconfigure(sd_when_faster=False)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    # progress lines on a terminal, unless -q; -v logs the compiles instead
    show = sys.stderr.isatty() and not args.quiet and not getattr(args, "verbose", False)
    with (
        compile_progress(show) as progress,
        program.stream(
            ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            trace=args.trace,
        ) as stream,
    ):
        print_as_decided(
            tokenizer, args.prompt, stream, before_text=progress.mute if progress is not None else None
        )
    if progress is not None and progress.summary():
        sys.stderr.write(progress.summary() + "\n")
        sys.stderr.flush()
    sys.stdout.write(stats_line(stream.output.stats) + "\n")
    if args.trace:
        sys.stdout.write(f"wrote the timeline to {args.trace} (open it in https://ui.perfetto.dev)\n")
    return 0


def print_as_decided(tokenizer, prompt: str, stream, before_text=None) -> None:
    """Write the prompt, then the completion as each round of ``stream`` decides it, and a newline.

    A round's text is written once it decodes to an extension of what is shown (an incomplete character
    waits); a tokenizer that rewrites earlier text gets the whole completion again on a line of its own. With
    ``before_text`` (the progress lines' ``mute``), it runs before the prompt, written at the first round."""
    started = False

    def start():
        nonlocal started
        if not started:
            started = True
            if before_text is not None:
                before_text()
            sys.stdout.write(prompt)
            sys.stdout.flush()

    if before_text is None:
        start()
    tokens, shown = [], ""
    for chunk in stream:
        start()
        tokens += chunk.new_tokens[0]
        text = tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(shown) and len(text) > len(shown):
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    start()
    final = tokenizer.decode(tokens, skip_special_tokens=True)
    sys.stdout.write((final[len(shown) :] if final.startswith(shown) else "\n" + prompt + final) + "\n")
    sys.stdout.flush()


def stats_line(s: dict) -> str:
    """``[mode] N tokens in ...``; ``[ssd, ran as SD: no tree pays here] ...`` where SD's rounds ran
    (:func:`~saguaro.runtime.base.stats.ran_as_sd`)."""
    why = ran_as_sd(s)
    label = f"{s['mode']}, {why}" if why else s["mode"]
    hits = f", cache hit rate {s['cache_hit_rate']:.2f}" if "cache_hit_rate" in s else ""
    return (
        f"[{label}] {s['new_tokens']} tokens in {s['wall_s']:.2f}s: {s['tokens_per_s']:.1f} tokens/s, "
        f"mean accepted length {s['mean_accepted_len']:.2f}, {s['rounds']} rounds{hits}"
    )


class CompileProgress(logging.Handler):
    """Draws the lowering's compile progress records (``PROGRESS_LOGGER``) on stderr with ``tqdm``: per
    stage a line ``compiling STAGE ELAPSED`` while Inductor works, then ``compiled STAGE in {seconds}s``.
    :meth:`mute` (the text starts) clears the line under way and draws no more; :meth:`summary` names every
    compile seen."""

    def __init__(self, stream=None):
        super().__init__(logging.INFO)
        self.stream = stream or sys.stderr
        self.bars: dict = {}  # stage -> the tqdm line of its compile under way
        self.done: list = []  # (stage, seconds) of each finished compile
        self.running: set = set()  # stages compiling now
        self.muted = False
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="saguaro-progress", daemon=True)
        self._ticker.start()

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        event, stage = getattr(record, "compile_event", None), getattr(record, "stage", "?")
        if event == "start":
            self.running.add(stage)
            if not self.muted:
                self.bars[stage] = tqdm(
                    desc=f"compiling {stage}", bar_format="{desc} {elapsed}", file=self.stream, leave=True
                )
        elif event in ("done", "failed"):
            self.running.discard(stage)
            seconds = getattr(record, "seconds", 0.0)
            if event == "done":
                self.done.append((stage, seconds))
            bar = self.bars.pop(stage, None)
            if bar is not None:
                bar.bar_format = "{desc}"
                bar.set_description_str(
                    f"compiled {stage} in {seconds:.1f}s" if event == "done" else f"{stage} did not compile",
                    refresh=False,
                )
                bar.close()  # leave=True: the line stays

    def _tick(self) -> None:
        while not self._stopped.wait(0.5):
            with self.lock:
                for bar in self.bars.values():
                    bar.refresh()

    def mute(self) -> None:
        with self.lock:
            self.muted = True
            for bar in self.bars.values():
                bar.leave = False
                bar.close()  # clears its line
            self.bars.clear()

    def summary(self) -> str:
        """``inductor: compiled STAGE in {seconds}s, ...; still compiling STAGE, ...`` ("": none ran)."""
        parts = []
        if self.done:
            parts.append(
                "compiled " + ", ".join(f"{stage} in {seconds:.1f}s" for stage, seconds in self.done)
            )
        if self.running:
            parts.append("still compiling " + ", ".join(sorted(self.running)))
        return "inductor: " + "; ".join(parts) if parts else ""

    def close(self) -> None:
        self._stopped.set()
        self.mute()
        super().close()


@contextmanager
def compile_progress(enabled: bool):
    """A :class:`CompileProgress` on the lowering's progress logger while the block runs (None when not
    ``enabled``); its INFO records then reach it alone (the root handler logs them only with ``-v``)."""
    if not enabled:
        yield None
        return
    from saguaro.lower.lowering import PROGRESS_LOGGER

    logger = logging.getLogger(PROGRESS_LOGGER)
    handler = CompileProgress()
    level = logger.level
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        handler.close()


COMMAND = Subcommand(
    "generate", "complete a prompt and print the completion and a stats line", add_arguments, run
)
