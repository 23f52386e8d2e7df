"""``saguaro.load(path)``: a :class:`~saguaro.runtime.program.Program` from an exported artifact, with
nothing captured or compiled (see :mod:`saguaro.artifact`)."""

from __future__ import annotations

import logging
import time

from saguaro.artifact.load import load_artifact
from saguaro.lower.lowering import ShapePolicy
from saguaro.runtime.program import Program

log = logging.getLogger(__name__)


def load(path, device=None, rebuild: bool = False) -> Program:
    """Load the program exported to ``path`` (``program.export`` / ``saguaro export``).

    Before any of its native code is loaded, every file's sha256, the format version, the torch version,
    the device and the CPU instruction set (or CUDA compute capability) are checked; a mismatch raises
    :class:`saguaro.ArtifactError` naming the file or field, the expected and found values and the
    remedy. ``device``: where to run (default: the device type it was exported for). ``rebuild=True``
    compiles the stages again from their portable form (slow; for another torch or CPU). The program
    generates every exported mode, both draft lanes included; its ``tokenizer_path`` is the exported
    tokenizer's folder (or ``None``).
    """
    started = time.perf_counter()
    loaded = load_artifact(path, device=device, rebuild=rebuild)
    program = Program(loaded.config, loaded.runners["target"], loaded.runners.get("draft"), loaded.pad_token_id,
                      loaded.eos_token_id, ShapePolicy(**loaded.shapes), remote_draft=loaded.remote_draft)
    program.tokenizer_path = loaded.tokenizer_path
    log.info("loaded program %s in %.2fs", path, time.perf_counter() - started)
    return program
