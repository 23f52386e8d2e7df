"""A stage GraphModule's forward code: generated where dynamo will compile it, and read back to name the FX node a
failed compile stopped at (for the error that names it)."""

from __future__ import annotations

import re
import traceback

import torch


def forward_outside_compiles(gm: torch.fx.GraphModule) -> None:
    """Generate ``gm``'s forward code again while no dynamo compile runs in this process (under dynamo's
    compile lock). While dynamo compiles, it swaps FX's code generator for one that marks each new forward
    as never to be compiled, process-wide: a stage graph whose forward was generated then (built on one
    thread while the compile thread compiled another stage) got such a forward, and ``torch.compile`` then
    ran it eager on every call (measured: the default pair's AR step at a quarter of its speed after an SSD
    generation in the background). Waits for a compile under way."""
    from torch._dynamo.convert_frame import compile_lock

    with compile_lock:
        gm.recompile()
        # a _LazyGraphModule's recompile() only installs a stub that would generate the code on its first call,
        # which may come inside a compile: generate it now
        getattr(gm, "real_recompile", lambda: None)()


def responsible_node(gm: torch.fx.GraphModule, exc: BaseException) -> str | None:
    """The FX node whose generated line the failure passed through last, if any."""
    lines = gm.code.splitlines()
    names = {n.name for n in gm.graph.nodes}
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith("<eval_with_key>") and 0 < frame.lineno <= len(lines):
            match = re.match(r"\s*(\w+)\s*=", lines[frame.lineno - 1])
            if match and match.group(1) in names:
                found = match.group(1)
    text = str(exc)
    for name in sorted(names, key=len, reverse=True):  # dynamo quotes the user code line it stopped at
        if found is None and re.search(rf"\b{re.escape(name)} = ", text):
            found = name
    return found
