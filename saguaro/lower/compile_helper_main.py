"""The compile helper process (:class:`~saguaro.lower.compile_helper.CompileHelper`): it warms Inductor up,
then compiles each stage it is sent as the compile thread would, and replies ``{"ok", "detail"}``."""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch

from saguaro.lower.compile_helper import inductor_settings, mark_dynamic, read_message, write_message
from saguaro.lower.direct_call import compile_with_inductor
from saguaro.lower.graph_transport import unpack_graph
from saguaro.lower.lowering import INDUCTOR_OPTIONS
from saguaro.lower.tiered import materialise


def compile_request(request: dict) -> None:
    """Compile a request's stage as :class:`~saguaro.lower.tiered.CompileJob` would (after its ``setup``
    ``module:function`` calls); the outputs are thrown away."""
    for name in request.get("setup", ()):
        module, function = name.split(":")
        getattr(importlib.import_module(module), function)()
    gm = unpack_graph(request["graph"])
    compiled = compile_with_inductor(gm, request["options"])
    args = materialise(request["args"])
    mark_dynamic(args, request["dynamic_dims"])
    inference, grad, threads = request["modes"]
    torch.set_num_threads(threads)
    with (
        inductor_settings(request["config_patch"]),
        torch.inference_mode(inference),
        torch.set_grad_enabled(grad),
    ):
        compiled(*args)


def warm_up() -> None:
    """Inductor's one-time CPU set-up (instruction-set probes, the C++ wrapper's precompiled header), on a
    trivial function; it lands in Inductor's cache, where the compile thread finds it too."""
    with torch.inference_mode():
        torch.compile(lambda x: (x * 2).sum(), options=dict(INDUCTOR_OPTIONS["cpu"]))(torch.ones(64))


def serve(requests, replies) -> None:
    """The helper's loop: one reply per request, until the requests end."""
    import torch._inductor.lowering  # noqa: F401 - registers prims.inductor_force_stride_order

    import saguaro  # noqa: F401 - registers Saguaro's operators

    try:
        warm_up()
    except Exception:
        pass

    while (request := read_message(requests)) is not None:
        started = time.perf_counter()
        try:
            compile_request(request)
            reply = {"ok": True, "detail": f"{time.perf_counter() - started:.1f}s"}
        except Exception as exc:
            reply = {"ok": False, "detail": f"{type(exc).__name__}: {str(exc).strip()[:500]}"}
        write_message(replies, reply)


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")  # the replies' channel; what anything prints goes to stderr
    os.dup2(2, 1)
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
