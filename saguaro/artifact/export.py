"""``program.export(path)``: write a program's stages, weights and manifest to a directory.

Layout of an artifact::

    manifest.json                 format, versions, environment, models, stages, sha256 of every file
    weights/<model>.safetensors   each model's weights, once, shared by all of its stages
    stages/<stage>.pt2            AOTInductor package of the stage (native=True), weights outside the .so
    stages/<stage>.ep             the stage's ExportedProgram without weights (the portable form)
    stages/<stage>.inputs         its example inputs; stages/<stage>.constants.safetensors if it has any
    models/<model>/config.json    the Hugging Face config of each model, when known
    tokenizer/                    the tokenizer, when one is given
    schedule.json                 the SSD round DAG (nodes, lanes, stages, edges)

Stages whose graphs are identical (``target.prefill`` and ``target.step``) share their files. The
directory is written beside ``path`` and renamed into place last, so an export that crashes or is
killed leaves nothing loadable at ``path``.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from saguaro.artifact.manifest import (
    FORMAT,
    FORMAT_VERSION,
    NATIVE_OPTIONS,
    environment,
    file_entries,
    write_manifest,
)
from saguaro.artifact.record import record_stages
from saguaro.artifact.signature import describe, dynamic_shapes, examples
from saguaro.capture.captured_files import spec_json
from saguaro.core.errors import ArtifactError
from saguaro.core.schedule import round_schedule
from saguaro.core.stages import stages_for
from saguaro.core.tensor_files import model_tensors, save_tensors
from saguaro.tensor_math.quantized_linear import QUANTIZED_LINEAR, quantized_linear_decomposition

log = logging.getLogger(__name__)

BUILTIN_NAMESPACES = ("aten", "prims")  # ops with C++ kernels that AOTInductor-compiled code can call


def serialize_graph(program: torch.export.ExportedProgram):
    """torch.export's serialized form of ``program``: graph and example inputs, whose weights and constants
    the callers drop (pickled only where ``serialize`` cannot skip them: torch before 2.13)."""
    from torch._export.serde.serialize import serialize

    if "serialize_state_dict" in inspect.signature(serialize).parameters:
        return serialize(program, serialize_state_dict=False, serialize_constants=False)
    return serialize(program)


def export_program(
    program,
    path,
    *,
    modes=None,
    sampling: bool = True,
    native: bool = True,
    max_batch: int = 64,
    model_configs: dict | None = None,
    tokenizer=None,
    announce=None,
) -> Path:
    """Export ``program``'s stages for ``modes`` (default: every mode it can run), greedy and (with
    ``sampling``) sampled, to the directory ``path``. ``native=True`` compiles each stage with
    AOTInductor; ``native=False`` writes only the portable form (the loaded stages then run the exported
    graphs). ``max_batch`` bounds the batch dimension. ``announce(line)`` sees the progress lines.
    Returns the path."""
    started = time.perf_counter()
    say = _announcer(announce)
    if program.target.captured.graph_module is None:
        raise ArtifactError(
            "this program was loaded from an artifact and holds no captured graphs; export the "
            "program saguaro.compile returned"
        )
    modes = (
        tuple(modes) if modes is not None else (("ar", "sd", "ssd") if program.draft is not None else ("ar",))
    )
    if program.draft is None and set(modes) - {"ar"}:
        raise ValueError(f"modes={list(modes)} need a draft model; this program has none: use modes=['ar']")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} is not allowed: it must be an int >= 1")
    attention = "inline" if program.config.attention == "auto" else program.config.attention
    temperatures = (0.0, 1.0) if sampling else (0.0,)
    stages = list(dict.fromkeys(s for m in modes for t in temperatures for s in stages_for(m, t)))
    say(f"export: recording the inputs of {len(stages)} stages ({', '.join(modes)})")
    recorders = record_stages(program, modes, temperatures, attention)

    dest = Path(path).resolve()
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    _remove_stale_partials(dest)
    (tmp / "stages").mkdir(parents=True)
    (tmp / "weights").mkdir()
    try:
        models = {}
        for name, recorder in recorders.items():
            runner = program.runner(name)
            aliases = save_tensors(tmp / f"weights/{name}.safetensors", model_tensors(recorder.graph_module))
            models[name] = {
                "spec": spec_json(runner.spec),
                "width": runner.width,
                "weights": f"weights/{name}.safetensors",
                "aliases": aliases,
            }
            config = (model_configs or {}).get(name)
            if config is not None:
                config.save_pretrained(tmp / "models" / name)
        ranges = _ranges(program, max_batch)
        entries, written = {}, {}
        for i, stage in enumerate(stages, 1):
            t0 = time.perf_counter()
            recorder = recorders[stage.model]
            gm = recorder.graphs[stage]
            described = describe(
                stage, recorder.inputs[stage], program.runner(stage.model).spec.num_layers, ranges
            )
            key = (stage.model, gm.code, json.dumps(described))
            if key in written:
                entries[stage.qualified] = written[key]
                say(
                    f"[{i}/{len(stages)}] {stage.qualified}: same graph as {written[key]['stem']}, files shared"
                )
                continue
            entry = _export_stage(
                tmp,
                stage,
                gm,
                described,
                ranges,
                native,
                program.target.spec.device,
                set(model_tensors(recorder.graph_module)),
            )
            entries[stage.qualified] = written[key] = entry
            say(
                f"[{i}/{len(stages)}] {stage.qualified}: exported{' and compiled' if native else ''} in "
                f"{time.perf_counter() - t0:.1f}s"
            )
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "schedule.json").write_text(json.dumps(_schedule(program), indent=1))
        files = file_entries(tmp)
        for entry in entries.values():
            entry["files"] = sorted(n for n in files if n.startswith(f"{entry['stem']}."))
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "environment": environment(program.target.spec.device),
            "native": native,
            "modes": list(modes),
            "sampling": sampling,
            "ranges": ranges,
            "config": asdict(program.config),
            "pad_token_id": program.pad_token_id,
            "eos_token_id": program.eos_token_id,
            "shapes": asdict(program.shapes),
            "models": models,
            "stages": entries,
            "tokenizer": tokenizer is not None,
            "files": files,
        }
        write_manifest(tmp, manifest)
        _replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f["bytes"] for f in manifest["files"].values())
    say(
        f"export: {len(entries)} stages, {size / 2**20:.1f} MiB to {dest} in {time.perf_counter() - started:.1f}s"
    )
    return dest


def _export_stage(tmp: Path, stage, gm, described, ranges, native: bool, device, shared: set) -> dict:
    """torch.export the stage graph, refuse Python-only custom ops, write its portable form and (native)
    its AOTInductor package; returns its manifest entry."""
    from safetensors.torch import save_file

    with torch.no_grad():
        ep = torch.export.export(
            gm, examples(described, device), dynamic_shapes=dynamic_shapes(described, ranges), strict=False
        )
        if any(node.target is QUANTIZED_LINEAR for node in ep.graph_module.graph.nodes):
            # quantized weights: the op's aten form (unpack the panels, dequantize, multiply), so AOTInductor
            # compiles it and a loaded program needs no Python registration
            ep = ep.run_decompositions({QUANTIZED_LINEAR: quantized_linear_decomposition})
    for node in ep.graph_module.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        if node.op == "call_function" and namespace is not None and namespace not in BUILTIN_NAMESPACES:
            raise ArtifactError(
                f"stage {stage.qualified}: node {node.name!r} calls the Python-only custom op {node.target}; its "
                "compiled code could not run without Python registration. Compile with attention='inline' (or "
                "'auto') so that attention is lowered to aten ops, then export"
            )
    stem = f"stages/{stage.qualified}"
    serialized = serialize_graph(ep)
    (tmp / f"{stem}.ep").write_bytes(serialized.exported_program)
    (tmp / f"{stem}.inputs").write_bytes(serialized.example_inputs)
    # weights and non-persistent buffers come from the model's weights file; other constants (tensors
    # the passes created) are the stage's own
    own = {name: t for name, t in ep.constants.items() if name not in shared}
    if any(not isinstance(t, torch.Tensor) for t in own.values()):
        raise ArtifactError(f"stage {stage.qualified}: holds a script object constant; it cannot be exported")
    entry = {
        "stem": stem,
        "inputs": described,
        "state_dict": sorted(ep.state_dict),
        "parameters": sorted(ep.graph_signature.parameters),
        "constants": sorted(ep.constants),
        "stage_constants": sorted(own),
        "package": None,
    }
    if own:
        save_file({k: v.contiguous() for k, v in own.items()}, str(tmp / f"{stem}.constants.safetensors"))
    if native:
        package = tmp / f"{stem}.pt2"
        try:
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(package), inductor_configs=dict(NATIVE_OPTIONS)
            )
        except Exception as exc:  # compiler failures carry long traces: name the stage and the first line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ArtifactError(
                f"stage {stage.qualified}: AOTInductor could not compile it: {first}"
            ) from exc
        entry["package"] = f"{stem}.pt2"
    return entry


def _ranges(program, max_batch: int) -> dict:
    """Each dynamic dimension's range: batch, tokens (up to the program's maximum length), KV slots (the
    largest store a generation of that length allocates) and tree branches."""
    k, longest = program.config.k, program.max_length
    branches = max(program.max_branches, 2) if program.draft is not None else 1  # 2: a round without branches
    slots = program.shapes.capacity(longest + k + 2 + k * branches)
    return {"B": [1, max_batch], "T": [1, longest], "S": [1, slots], "MQ": [1, branches]}


def _schedule(program) -> dict:
    g = round_schedule("ssd", program.config.k, sampled=False)
    return {
        "nodes": [
            {
                "id": str(n),
                "lane": d.get("lane"),
                "stage": getattr(d.get("stage"), "qualified", None),
                "depth": d.get("depth"),
            }
            for n, d in g.nodes(data=True)
        ],
        "edges": [[str(a), str(b)] for a, b in g.edges],
    }


def _replace(tmp: Path, dest: Path) -> None:
    """Move the finished artifact to ``dest`` (an older one there is replaced)."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_partials(dest: Path) -> None:
    """Remove what killed exports to ``dest`` left (their process is gone), and this process's own."""
    for partial in dest.parent.glob(f".{dest.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        alive = False
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                alive = True
            except ProcessLookupError:
                pass
            except PermissionError:  # another user's live process
                alive = True
        if not alive:
            shutil.rmtree(partial, ignore_errors=True)


def _announcer(announce):
    def say(line: str) -> None:
        log.info("%s", line)
        if announce is not None:
            announce(line)

    return say
