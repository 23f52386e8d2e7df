"""A stage GraphModule's forward code: generated outside dynamo's compiles, read to name a failed node."""

from __future__ import annotations

import re
import traceback

import torch


def forward_outside_compiles(gm: torch.fx.GraphModule) -> None:
    """Generate ``gm``'s forward code again under dynamo's compile lock (waiting for a compile under way):
    while dynamo compiles, FX's code generator, process-wide, marks each new forward never to be compiled,
    and ``torch.compile`` would then run that stage eager on every call."""
    from torch._dynamo.convert_frame import compile_lock

    with compile_lock:
        gm.recompile()
        # a lazy GraphModule's recompile() installs a stub that would generate the code on its first call
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
