"""Captures kept on disk as :mod:`~saguaro.capture.graph_file` JSON (no weights), so a later process skips
``torch.export`` for an architecture captured before; read back bound to the new model's weights by name.

One folder per fingerprint and capture source under :func:`cache_root`, renamed into place whole; an entry
that differs or cannot be read is a logged miss, and the capture runs as if there were no cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from saguaro.capture import graph_file
from saguaro.capture.capture_cache import named_tensors

log = logging.getLogger(__name__)

ENV_DIR, ENV_SWITCH = "SAGUARO_CACHE_DIR", "SAGUARO_CAPTURE_CACHE"
FORMAT = 2  # 1: torch.export's serialized form; 2: graph_file's JSON


def cache_root() -> Path | None:
    """``$SAGUARO_CACHE_DIR/captures`` (default ``~/.cache/saguaro``); None if ``SAGUARO_CAPTURE_CACHE=0``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    base = os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "saguaro")
    return Path(base) / "captures"


_SOURCE_DIGEST: list = []


def _capture_source() -> str:
    """A digest of Saguaro's capture code (this folder's modules): part of every entry's name."""
    if not _SOURCE_DIGEST:
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + path.read_bytes())
        _SOURCE_DIGEST.append(digest.hexdigest())
    return _SOURCE_DIGEST[0]


def _entry(root: Path, key: tuple) -> tuple[Path, str]:
    described = repr((FORMAT, _capture_source(), key))
    return root / hashlib.sha256(described.encode()).hexdigest()[:40], described


def write(key: tuple | None, graph_module: torch.fx.GraphModule) -> None:
    """Keep ``graph_module`` (``ExportedProgram.module()``: the graph, not its weights) under ``key``; any
    failure is logged, never raised."""
    root = cache_root()
    if key is None or root is None:
        return
    folder, described = _entry(root, key)
    if folder.exists():
        return
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        (tmp / "graph.json").write_text(graph_file.dumps(graph_module))
        tensors = graph_file.attribute_names(graph_module)
        (tmp / "entry.json").write_text(json.dumps(dict(fingerprint=described, tensors=tensors)))
        try:
            tmp.rename(folder)
            tmp = None
        except OSError:  # another process wrote it first: theirs is the same graph
            pass
    except graph_file.NotKept as exc:
        log.info("capture cache: this graph is not kept on disk (%s)", exc)
    except Exception as exc:  # a full disk or an unwritable home must not stop a capture
        log.warning("could not keep the capture on disk in %s: %s", root, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def read(key: tuple | None, wrapper: torch.nn.Module) -> torch.fx.GraphModule | None:
    """The graph kept under ``key``, bound to ``wrapper``'s parameters, buffers and constants (the module
    the graph was exported from, the new model inside), or None."""
    root = cache_root()
    if key is None or root is None:
        return None
    folder, described = _entry(root, key)
    if not (folder / "entry.json").exists():
        return None
    try:
        entry = json.loads((folder / "entry.json").read_text())
        if entry.get("fingerprint") != described:
            log.info("capture cache: %s holds another fingerprint; capturing afresh", folder)
            return None
        own = dict(named_tensors(wrapper))
        missing = [name for name in entry["tensors"] if name not in own]
        if missing:
            log.info(
                "capture cache: %s needs %s, which this model has not got; capturing afresh",
                folder,
                missing[0],
            )
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree's LeafSpec deprecation, inside torch
            return graph_file.loads((folder / "graph.json").read_text(), wrapper)
    except Exception as exc:  # a corrupt or foreign entry: capture as if it were not there
        log.warning(
            "capture cache: could not read %s (%s: %s); capturing afresh", folder, type(exc).__name__, exc
        )
        return None


def clear() -> None:
    """Remove every kept capture (the folder of captures, nothing else)."""
    root = cache_root()
    if root is not None and root.exists():
        shutil.rmtree(root)
