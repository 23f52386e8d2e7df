"""Warnings attributed to the user's line, not to a frame inside Saguaro or torch."""

from __future__ import annotations

import os
import sys
import warnings

_SAGUARO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _library_dirs() -> tuple:
    dirs = [_SAGUARO_DIR]
    torch = sys.modules.get("torch")  # torch's decorators (inference_mode) wrap Saguaro's entry points
    if torch is not None and getattr(torch, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    return tuple(dirs)


def warn_at_caller(message: str, category: type = RuntimeWarning) -> None:
    """``warnings.warn`` at the first frame outside Saguaro and torch (3.11 has no ``skip_file_prefixes``)."""
    skip = _library_dirs()
    frame, level = sys._getframe(1), 2  # level 2: the caller of this function
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
