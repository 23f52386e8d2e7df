"""Load an artifact's models: check every file and the environment first, then each model's weights
once and its stages, handed to a :class:`ModelRunner` through its ``build`` callable. Nothing is
captured or compiled (``rebuild=True`` compiles the stages again from their portable form)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.artifact.checks import resolve_device, verify_environment, verify_files
from saguaro.artifact.loaded_stage import LoadedStage, load_portable, stage_runner
from saguaro.artifact.manifest import read_manifest
from saguaro.artifact.signature import InputCheck
from saguaro.capture.captured_files import spec_from_json
from saguaro.capture.export import CapturedModel
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ArtifactError
from saguaro.core.stages import BY_QUALIFIED_NAME, Stage
from saguaro.core.tensor_files import load_tensors
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.draft.server import SpeculationServer
from saguaro.tensor_math.huge_pages import on_huge_pages

log = logging.getLogger(__name__)


@dataclass
class LoadedArtifact:
    """What a Program is built from: config, runners, token ids, the shape policy's fields, and the recipe
    of the draft side for a process lane."""

    manifest: dict
    config: SaguaroConfig
    runners: dict
    pad_token_id: int
    eos_token_id: object
    shapes: dict
    remote_draft: LoadedDraft | None
    tokenizer_path: Path | None


class ArtifactStages:
    """The :class:`~saguaro.runtime.base.model_runner.StageBuilder` of a loaded model: each stage loaded
    from the artifact (stages with one graph share one loaded callable, and one deserialized portable
    form), or an ``ArtifactError`` naming what was exported."""

    def __init__(
        self, root: Path, model: str, manifest: dict, tensors: dict, device: torch.device, rebuild: bool
    ):
        self.root = root
        self.model = model
        self.manifest = manifest
        self.tensors = tensors
        self.device = device
        self.rebuild = rebuild
        self.native = bool(manifest["native"])
        if not self.native:
            self.kind = "portable"
        else:
            self.kind = "rebuilt" if rebuild else "native"
        self.qualified = [q for q in manifest["stages"] if q.split(".")[0] == model]
        self._by_stem: dict = {}
        self._programs: dict = {}  # stem -> its ExportedProgram, deserialized once
        self.workdir: list = []  # keeps a rebuild's packages alive as long as the runner

    def _tensors(self, entry: dict) -> dict:
        """The model's weights, and the stage's own constants when it has any."""
        if not entry["stage_constants"]:
            return self.tensors
        from safetensors.torch import load_file

        own = dict(self.tensors)
        own.update(
            placed(
                load_file(str(self.root / f"{entry['stem']}.constants.safetensors"), device=str(self.device))
            )
        )
        return own

    def exported_program(self, qualified: str):
        """The stage's portable form (its ExportedProgram, weights bound), deserialized on first use."""
        entry = self.manifest["stages"][qualified]
        if entry["stem"] not in self._programs:
            self._programs[entry["stem"]] = load_portable(self.root, entry, self._tensors(entry))
        return self._programs[entry["stem"]]

    def load(self, qualified: str) -> LoadedStage:
        entry = self.manifest["stages"][qualified]
        if entry["stem"] not in self._by_stem:
            self._by_stem[entry["stem"]] = stage_runner(
                self.root,
                entry,
                self._tensors(entry),
                self.device,
                self.native,
                self.rebuild,
                qualified,
                self.workdir,
                lambda: self.exported_program(qualified),
            )
        run, kind = self._by_stem[entry["stem"]]
        return LoadedStage(
            qualified, run, InputCheck(qualified, entry["inputs"], self.manifest["ranges"]), kind
        )

    def _check_exported(self, stage: Stage) -> None:
        if stage.qualified not in self.qualified:
            raise ArtifactError(
                f"{self.root}: stage {stage.qualified} was not exported (modes {self.manifest['modes']}, sampling "
                f"{self.manifest['sampling']}); export with the modes and sampling you generate with"
            )

    def provides(self, stage: Stage) -> bool:
        """Whether the artifact holds ``stage`` (one exported before AR's round stage runs AR by steps)."""
        return stage.qualified in self.qualified

    def __call__(self, stage: Stage):
        self._check_exported(stage)
        return self.load(stage.qualified)

    def stage_graph(self, stage: Stage, observe=None) -> torch.fx.GraphModule:
        """The stage's graph as exported, after every pass (from its portable form, which every artifact
        holds). The passes themselves cannot be observed: the artifact holds no captured graph."""
        if observe is not None:
            raise ValueError(
                f"stage {stage.qualified}: this program was loaded from {self.root}, which holds each "
                "stage's graph as exported after every pass but no captured graph, so the per-pass "
                "views (passes, pass diffs) cannot be shown; its stage graphs, schedule and stages can. "
                "Inspect the program saguaro.compile returns for the passes"
            )
        self._check_exported(stage)
        return self.exported_program(stage.qualified).module()


def model_files(manifest: dict, model: str) -> set:
    """The files loading ``model`` reads."""
    names = {manifest["models"][model]["weights"]}
    for qualified, entry in manifest["stages"].items():
        if qualified.split(".")[0] == model:
            names.update(entry["files"])
    return names


def placed(tensors: dict) -> dict:
    """``tensors`` with each CPU tensor of a huge page or more moved onto huge pages where the platform
    allows (:func:`~saguaro.tensor_math.huge_pages.on_huge_pages`, see
    docs/measurements/2026-12-06-huge-pages.md); aliases stay bound to one copy."""
    copies: dict = {}  # id of a loaded tensor -> its copy
    for t in tensors.values():
        if id(t) not in copies:
            copies[id(t)] = on_huge_pages(t)
    return {name: copies[id(t)] for name, t in tensors.items()}


def load_runner(root: Path, manifest: dict, model: str, device: torch.device, rebuild: bool) -> ModelRunner:
    """One model's runner, its weights read once. Native stages are opened and rebuilt ones compiled now;
    portable ones, slower to open, are deserialized on first use (see
    docs/measurements/2026-12-07-figures-from-runtime-bench-cli.md)."""
    started = time.perf_counter()
    info = manifest["models"][model]
    spec = spec_from_json(info["spec"], device)
    stages = ArtifactStages(
        root,
        model,
        manifest,
        placed(load_tensors(root / info["weights"], info["aliases"], device)),
        device,
        rebuild,
    )
    runner = ModelRunner(model, CapturedModel(graph_module=None, spec=spec), stages, info["width"])
    if stages.kind != "portable":
        for qualified in stages.qualified:
            runner.stage(BY_QUALIFIED_NAME[qualified])
    log.info(
        "loaded %s: %d stages (%s) in %.2fs",
        model,
        len(stages.qualified),
        stages.kind,
        time.perf_counter() - started,
    )
    return runner


def load_artifact(path, device=None, rebuild: bool = False) -> LoadedArtifact:
    """Check the artifact at ``path`` (every file's sha256, format, torch version, device, CPU instruction
    set or compute capability) and only then load its models."""
    root = Path(path).resolve()
    manifest = read_manifest(root)
    device = resolve_device(manifest, device)
    verify_files(root, manifest)
    verify_environment(root, manifest, device, native=bool(manifest["native"]) and not rebuild)
    config = SaguaroConfig(**_config_fields(manifest["config"]))
    runners = {name: load_runner(root, manifest, name, device, rebuild) for name in manifest["models"]}
    remote = LoadedDraft(str(root), str(device), rebuild) if "draft" in runners else None
    eos = manifest["eos_token_id"]
    return LoadedArtifact(
        manifest,
        config,
        runners,
        int(manifest["pad_token_id"]),
        eos,
        manifest["shapes"],
        remote,
        root / "tokenizer" if manifest.get("tokenizer") else None,
    )


def _config_fields(fields: dict) -> dict:
    fields = dict(fields)
    if isinstance(fields.get("fan_out"), list):
        fields["fan_out"] = tuple(fields["fan_out"])
    return fields


class LoadedDraft:
    """The draft side of a loaded program for a process lane: the draft process checks the draft's files
    and loads its stages from the artifact (nothing captured or compiled there either)."""

    def __init__(self, path: str, device: str, rebuild: bool):
        self.path = path
        self.device = device
        self.rebuild = rebuild

    def save(self, directory: str) -> dict:
        """The description the draft process loads the draft from: the artifact itself, nothing written."""
        return {
            "server": "saguaro.artifact.load:loaded_draft_server",
            "path": self.path,
            "device": self.device,
            "rebuild": self.rebuild,
        }


def loaded_draft_server(description: dict, config: SaguaroConfig) -> SpeculationServer:
    """In the draft process: the draft's stages loaded from the artifact, and its speculation server."""
    root = Path(description["path"])
    manifest = read_manifest(root)
    device = torch.device(description["device"])
    rebuild = description["rebuild"]
    verify_files(root, manifest, model_files(manifest, "draft"))
    verify_environment(root, manifest, device, native=bool(manifest["native"]) and not rebuild)
    return SpeculationServer(load_runner(root, manifest, "draft", device, rebuild), config)
