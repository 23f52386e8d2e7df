"""A stage loaded from an artifact: its AOTInductor package (weights from the model's shared file,
held by the runtime, never copied) or its portable ExportedProgram, behind a check of the inputs
against the recorded signature."""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from pathlib import Path

import torch

from saguaro.artifact.manifest import NATIVE_OPTIONS
from saguaro.artifact.signature import InputCheck
from saguaro.core.errors import ArtifactError

log = logging.getLogger(__name__)

PACKAGE_MODEL = "model"  # the model name aoti_compile_and_package gives the one model of a package


class LoadedStage:
    """Callable like a lowered stage: ``stage(*flat inputs) -> tuple of outputs``."""

    def __init__(self, qualified: str, run, check: InputCheck, kind: str):
        self.qualified = qualified
        self._run = run
        self.check = check
        self.kind = kind

    def __call__(self, *args):
        self.check(args)
        # compiled code assumes the traced (contiguous) strides and does not check them; the runtime
        # passes expanded index tensors. The KV caches, written in place, are contiguous (checked).
        return tuple(self._run([a if a.is_contiguous() else a.contiguous() for a in args]))


def load_native(package: Path, tensors: dict, device: torch.device):
    """The AOTInductor package at ``package`` with its constants bound to ``tensors`` (by name, user
    managed: the compiled model uses these very tensors)."""
    index = device.index if device.index is not None else -1
    loader = torch._C._aoti.AOTIModelPackageLoader(str(package), PACKAGE_MODEL, False, 1, index)
    names = loader.get_constant_fqns()
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ArtifactError(
            f"{package}: expected constants {missing[:5]} in the model's weights file, found none; "
            "export again"
        )
    loader.load_constants({n: tensors[n] for n in names}, False, True, True)
    return loader.run


def load_portable(root: Path, entry: dict, tensors: dict):
    """The stage's ExportedProgram, its weights taken from ``tensors``."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass

    stem = root / entry["stem"]
    serialized = _bytes_to_dataclass(schema.ExportedProgram, (stem.parent / f"{stem.name}.ep").read_bytes())
    parameters = set(entry["parameters"])
    state_dict = {
        name: torch.nn.Parameter(tensors[name], requires_grad=False) if name in parameters else tensors[name]
        for name in entry["state_dict"]
    }
    constants = {name: tensors[name] for name in entry["constants"]}
    return ExportedProgramDeserializer().deserialize(
        serialized, state_dict, constants, (stem.parent / f"{stem.name}.inputs").read_bytes()
    )


def portable_runner(ep):
    """Runs the exported graph itself (no compilation), writing the KV caches in place."""
    module = ep.module()

    def run(args):
        return module(*args)

    return run


def rebuild_native(qualified: str, ep, tensors: dict, device: torch.device, workdir: Path):
    """Compile the portable form again with AOTInductor here (the ``rebuild=True`` path)."""
    started = time.perf_counter()
    package = workdir / f"{qualified}.pt2"
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(package), inductor_configs=dict(NATIVE_OPTIONS)
    )
    log.info("rebuilt stage %s with AOTInductor in %.1fs", qualified, time.perf_counter() - started)
    return load_native(package, tensors, device)


def stage_runner(
    root: Path,
    entry: dict,
    tensors: dict,
    device: torch.device,
    native: bool,
    rebuild: bool,
    qualified: str,
    workdir_holder: list,
    exported,
):
    """The callable of one stage entry, per the artifact kind and ``rebuild``; ``exported()`` gives the
    stage's portable form (:func:`load_portable`) when it is needed."""
    if native and not rebuild:
        return load_native(root / entry["package"], tensors, device), "native"
    ep = exported()
    if not native:
        return portable_runner(ep), "portable"
    if not workdir_holder:
        workdir_holder.append(tempfile.TemporaryDirectory(prefix="saguaro-rebuild-"))
        warnings.warn(
            "saguaro.load(rebuild=True): compiling every stage again from its portable form; this takes "
            "minutes",
            RuntimeWarning,
            stacklevel=4,
        )
    return rebuild_native(qualified, ep, tensors, device, Path(workdir_holder[0].name)), "rebuilt"
