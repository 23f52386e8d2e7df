"""Which FX node of a stage graph a failed compile stopped at, for the error that names it."""

from __future__ import annotations

import re
import traceback

import torch


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
