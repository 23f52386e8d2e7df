"""What Inductor generated for a stage: its output code files and kernel names, from the structured log's
``inductor_output_code`` records while it compiles."""

from __future__ import annotations

import logging
import re
import threading
from contextlib import contextmanager

# C++ kernels on CPU (cpp_fused_...), Triton kernels on GPU (triton_...), extern calls the wrapper makes
KERNEL = re.compile(r"\b((?:cpp_fused|triton_(?:poi|red|per|tem|for)?_?fused)\w*|triton_\w+)\b")


class _OutputCode(logging.Handler):
    """Collects ``{"file", "kernels", "lines"}`` of each output-code record this thread emits."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.thread = threading.get_ident()
        self.files: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None) or {}
        if record.thread != self.thread or "inductor_output_code" not in metadata:
            return
        code = getattr(record, "payload", None) or ""
        info = metadata["inductor_output_code"] or {}
        self.files.append(
            {
                "file": info.get("file_path") or info.get("filename"),
                "kernels": sorted(set(KERNEL.findall(code))),
                "lines": code.count("\n"),
            }
        )


@contextmanager
def capture_output_code():
    """Yields a list filled with the output code Inductor writes on this thread within the block."""
    from torch._logging._internal import trace_log

    handler = _OutputCode()
    trace_log.addHandler(handler)
    try:
        yield handler.files
    finally:
        trace_log.removeHandler(handler)
