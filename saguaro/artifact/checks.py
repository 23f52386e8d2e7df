"""Checks run on an artifact before any of its files is loaded: every file's size and sha256, then the
environment its native code was compiled for (torch version, platform, device, CPU instruction set or
CUDA compute capability). Each failure is an ``ArtifactError`` naming the file or field, what was
expected, what was found and the remedy."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from saguaro.artifact.manifest import MANIFEST, REMEDY, environment, sha256_of
from saguaro.core.errors import ArtifactError

log = logging.getLogger(__name__)

# fields of the manifest's environment the native code depends on (the others are informative)
NATIVE_FIELDS = ("torch", "platform", "machine", "device_type", "cpu_isa", "compute_capability")


def verify_files(root: Path, manifest: dict, names=None) -> None:
    """Every file the manifest lists (or those in ``names``) exists with its recorded size and sha256."""
    files = manifest["files"]
    for name in sorted(files if names is None else names):
        entry = files.get(name)
        if entry is None:
            raise ArtifactError(f"{root / MANIFEST}: lists no file {name!r} that a stage needs; {REMEDY}")
        path = root / name
        if not path.is_file():
            raise ArtifactError(
                f"{path}: missing; the manifest expects it ({entry['bytes']} bytes, sha256 "
                f"{entry['sha256'][:16]}...); {REMEDY}"
            )
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(
                f"{path}: expected {entry['bytes']} bytes, found {size}; the file changed after "
                f"export; {REMEDY}"
            )
        digest = sha256_of(path)
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{path}: expected sha256 {entry['sha256']}, found {digest}; the file changed after "
                f"export; {REMEDY}"
            )
    log.info("artifact %s: %d files match their sha256", root, len(files if names is None else names))


def resolve_device(manifest: dict, device) -> torch.device:
    """The device to load on: ``device``, or the one the artifact was exported for."""
    exported = manifest["environment"]["device_type"]
    if device is None:
        return torch.device(exported)
    device = torch.device(device)
    if device.type != exported:
        raise ArtifactError(
            f"device: the artifact was exported for device type {exported!r}, found a request for "
            f"{str(device)!r}; load it with device={exported!r}, or export it again on a "
            f"{device.type} machine"
        )
    return device


def verify_environment(root: Path, manifest: dict, device: torch.device, native: bool) -> None:
    """The environment here matches the one the artifact's native code was compiled for. Without native
    code (a portable artifact, or ``rebuild=True``) only the device type must match."""
    recorded = manifest["environment"]
    here = environment(device)
    fields = NATIVE_FIELDS if native else ("device_type",)
    for field in fields:
        if field not in recorded and field not in here:
            continue
        expected, found = recorded.get(field), here.get(field)
        if expected != found:
            raise ArtifactError(
                f"{root / MANIFEST}: field 'environment.{field}': the artifact's native code was "
                f"compiled for {expected!r}, found {found!r} here; {REMEDY}"
            )
