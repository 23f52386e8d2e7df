"""The artifact's ``manifest.json``: what was exported, on what, and the sha256 of every file.

The only file read before every other file's checksum is verified. It names the format version, the
versions and platform the native code was compiled for (device type, CPU instruction set or CUDA compute
capability), each model's spec and weights, each stage's files and input ranges, and each file's size and
sha256.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from saguaro.core.errors import ArtifactError

FORMAT = "saguaro-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
NATIVE_OPTIONS = {"aot_inductor.package_constants_in_so": False}  # weights stay in weights/, loaded once
REMEDY = (
    "export the program again on this machine (`program.export(path)` / `saguaro export`), or call "
    "saguaro.load(path, rebuild=True) to rebuild its stages from their portable form (slow)"
)


def saguaro_version() -> str:
    import saguaro

    return getattr(saguaro, "__version__", "unknown")


def environment(device: torch.device) -> dict:
    """What the native code of an artifact exported here depends on."""
    import transformers

    env = {
        "saguaro": saguaro_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "machine": platform.machine(),
        "device_type": device.type,
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["compute_capability"] = f"{major}.{minor}"
    else:
        env["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
    return env


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_entries(root: Path) -> dict:
    """``{relative path: {"sha256", "bytes"}}`` of every file under ``root`` but the manifest."""
    entries = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST:
            entries[rel] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}
    return entries


def write_manifest(root: Path, manifest: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def read_manifest(root: Path) -> dict:
    """The parsed manifest of the artifact at ``root``; ``ArtifactError`` when it is missing, not
    JSON, not a Saguaro artifact, or of another format version."""
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(
            f"{root}: no such artifact directory; expected a folder written by program.export "
            "(an interrupted export leaves none)"
        )
    if not path.is_file():
        raise ArtifactError(
            f"{path}: missing; expected the manifest of an artifact written by program.export "
            f"(an interrupted export writes none); {REMEDY}"
        )
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(
            f"{path}: expected a JSON manifest, found unreadable text ({exc}); the file is "
            f"truncated or damaged; {REMEDY}"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{path}: field 'format': expected {FORMAT!r}, found {found!r}; {REMEDY}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: field 'format_version': expected {FORMAT_VERSION}, found "
            f"{manifest.get('format_version')!r}; {REMEDY}"
        )
    for field in ("environment", "files", "models", "stages", "config"):
        if field not in manifest:
            raise ArtifactError(f"{path}: field {field!r}: expected it, found none; {REMEDY}")
    return manifest
