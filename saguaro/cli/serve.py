"""``saguaro serve``: an OpenAI-compatible HTTP server over a compiled (or ``--program``-loaded) pair
(:mod:`saguaro.serve`): ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``. Serves the default pair with no model arguments; stops on SIGTERM or Ctrl-C after finishing
the requests in flight."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saguaro.cli.args import add_linears_arg, add_plan_arg, int_at_least, sd_when_faster, weight_options
from saguaro.cli.program import add_program_arg, check_program_args, load_program
from saguaro.cli.registry import Subcommand
from saguaro.core.config import MAX_K, MODES
from saguaro.runtime.batching import K_CHOICES


def add_arguments(parser) -> None:
    parser.add_argument(
        "--target", metavar="DIR", help="saved target model folder (default: the default pair)"
    )
    parser.add_argument("--draft", metavar="DIR", help="saved draft model folder (default: the default pair)")
    parser.add_argument("--mode", default="sd", choices=list(MODES), help="ar, sd or ssd (default sd)")
    parser.add_argument(
        "--k", type=int_at_least(1, "k", MAX_K), default=5, help=f"speculation length, 1..{MAX_K} (default 5)"
    )
    parser.add_argument(
        "--backend",
        default="inductor",
        choices=["eager", "inductor"],
        help="lowering backend (default inductor; eager starts at once)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where both models run: cpu, cuda, cuda:1, ... (default cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype of both models (default float32)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the one address to bind (default 127.0.0.1); any non-loopback address needs --api-key-file",
    )
    parser.add_argument(
        "--port",
        type=int_at_least(0, "port", 65535),
        default=8000,
        help="TCP port (default 8000; 0: one the system picks, printed when ready)",
    )
    parser.add_argument(
        "--max-batch",
        type=int_at_least(1, "max_batch", 256),
        default=8,
        help="most rows (a request's choices are a row each) decoded at once, over all running "
        "batches (default 8)",
    )
    parser.add_argument(
        "--max-queue",
        type=int_at_least(0, "max_queue"),
        default=64,
        help="most requests (choices) waiting beyond a full batch; past it a request gets 429 with "
        "Retry-After (default 64; 0: accepted only while the running batch has room)",
    )
    parser.add_argument(
        "--k-choice",
        choices=K_CHOICES,
        default="measured",
        help="speculation length of a batch's SD rounds: measured (default: of 1..k, the one whose rounds "
        "decide the most tokens a second at the batch's size; a seeded sampled batch keeps k) or fixed (k)",
    )
    parser.add_argument(
        "--max-tokens-default",
        type=int_at_least(1, "max_tokens_default"),
        default=None,
        metavar="N",
        help="max_tokens of a request that names none, at most the room its prompt "
        "leaves (default: all that room, the model's context minus the prompt)",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int_at_least(0, "prefix_cache_tokens"),
        default=0,
        metavar="N",
        help="reuse the KV of earlier prompts for a request that starts with the same tokens (a shared "
        "system prompt), holding up to N prompt positions (default 0: off; greedy answers may then differ "
        "from an uncached prefill's by float rounding of the rows prefilled after the reused prefix)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=None,
        help="a file holding the API key every /v1 request must send as 'Authorization: Bearer KEY' "
        "(/health and /metrics stay open unless --auth-health)",
    )
    parser.add_argument(
        "--auth-health",
        action="store_true",
        help="with --api-key-file, /health and /metrics need the key too (default: open, for "
        "probes and Prometheus scrapes)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file for /v1/chat/completions, in place of the tokenizer's own (it gets "
        "messages, tools, add_generation_prompt and each request's chat_template_kwargs)",
    )
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --backend inductor, compile every batch shape the server will run before it says "
        "it is ready, so no request waits for a compile (default on; --no-warm-up: compile on "
        "first use)",
    )
    add_plan_arg(parser)
    add_linears_arg(parser)
    add_program_arg(parser)


def build_program(args):
    """``(program, tokenizer, model name)`` from the arguments."""
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    check_program_args(args)
    if args.program is not None:
        program, tokenizer = load_program(args)
        return program.reconfigure(mode=args.mode), tokenizer, Path(args.program).name
    target, draft, tokenizer = load_pair(
        args.target, args.draft, need_draft=args.mode != "ar", dtype=DTYPES[args.dtype], device=args.device
    )
    program = saguaro_compile(
        target,
        None if args.mode == "ar" else draft,
        k=args.k,
        mode=args.mode,
        backend=args.backend,
        sd_when_faster=sd_when_faster(args),
        linears=args.linears,
        narrow_weights=args.narrow_weights == "on",
        **weight_options(args),
    )
    name = Path(args.target).name if args.target else "saguaro-default-pair"
    return program, tokenizer, name


def run(args) -> int:
    from saguaro.core.openmp import release_thread_pool
    from saguaro.serve.server import check_address, make_server, print_ready, read_api_key, read_chat_template
    from saguaro.serve.warm_up import needs_warm_up, warm_up

    api_key = read_api_key(args.api_key_file)
    check_address(args.host, api_key)  # before loading any model
    template = read_chat_template(args.chat_template)
    program, tokenizer, name = build_program(args)
    if template is not None and tokenizer is not None:
        tokenizer.chat_template = template
    if args.warm_up and needs_warm_up(program):
        sys.stderr.write(
            "saguaro serve: warming up (compiling each batch shape before serving; --no-warm-up skips it)\n"
        )
        seconds = warm_up(program, tokenizer, args.max_batch)
        sys.stderr.write(f"saguaro serve: warm-up done in {seconds:.0f} s\n")
    program.cache_prefixes(args.prefix_cache_tokens)  # after the warm-up: its prompts are not kept
    release_thread_pool()  # the scheduler's thread (and a draft lane) decode from now on: core/openmp.py
    server, _ = make_server(
        program,
        tokenizer,
        name,
        args.host,
        args.port,
        args.max_batch,
        args.max_queue,
        api_key,
        announce=print_ready(name),
        default_max_tokens=args.max_tokens_default,
        auth_health=args.auth_health,
        k_choice=args.k_choice,
    )
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn drained the requests in flight, then raised the signal again
        return 130
    finally:
        program.close()
    return 0


COMMAND = Subcommand("serve", "serve a pair over HTTP with OpenAI-compatible endpoints", add_arguments, run)
