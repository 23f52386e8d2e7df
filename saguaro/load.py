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

    Every file's sha256, the format and torch versions, the device and the CPU instruction set (or CUDA
    capability) are checked before any native code loads; a mismatch raises :class:`saguaro.ArtifactError`
    naming it, both values and the remedy. ``device``: default, the exported device type. ``rebuild=True``
    compiles again from the portable form (another torch or CPU). ``tokenizer_path``: the exported
    tokenizer's folder, or None.
    """
    started = time.perf_counter()
    loaded = load_artifact(path, device=device, rebuild=rebuild)
    program = Program(
        loaded.config,
        loaded.runners["target"],
        loaded.runners.get("draft"),
        loaded.pad_token_id,
        loaded.eos_token_id,
        ShapePolicy(**loaded.shapes),
        remote_draft=loaded.remote_draft,
    )
    program.tokenizer_path = loaded.tokenizer_path
    log.info("loaded program %s in %.2fs", path, time.perf_counter() - started)
    return program
