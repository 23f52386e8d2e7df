"""``program.export`` and ``saguaro.load``: a loaded program (in a fresh process, nothing captured or
compiled) gives the original program's tokens and ``transformers``' greedy tokens in every mode and
both lanes; tampered artifacts are refused before any of their files is loaded; an interrupted export
leaves nothing loadable.

The tiny pair is exported once per session: the portable form of every stage (``native=False``,
seconds), and AOTInductor packages for AR only (one compile: ``target.prefill`` and ``target.step``
share one graph). Tamper tests copy the portable artifact.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import saguaro
from saguaro.core.errors import ArtifactError
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

REPO = Path(__file__).resolve().parents[2]
# one pytest-xdist worker runs this file (make test: --dist loadgroup), so the session's export, about a
# minute of torch.export and AOTInductor work, is built once rather than once per worker
pytestmark = pytest.mark.xdist_group("exported_artifact")


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """``(target, program, portable_dir, native_dir)``."""
    root = tmp_path_factory.mktemp("artifacts")
    target = tiny_target("llama")
    draft = truncated_draft(target)
    # a fixed tree: the planner's sampled plans follow each program's own warm-up costs, so a seed fixes the
    # tokens within one program, not across the original and the loaded one
    program = saguaro.compile(
        target,
        draft,
        k=4,
        mode="sd",
        attention="inline",
        lane="thread",
        fan_out="geometric",
        backend="eager",
        sd_when_faster=False,
    )
    program.export(root / "portable", native=False)
    program.export(root / "native", modes=["ar"], sampling=False)
    return target, program, root / "portable", root / "native"


def run_loader(runs):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.artifact.load_check", json.dumps(runs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_loaded_program_generates_the_original_tokens_compiling_nothing(exported):
    target, program, portable, native = exported
    runs = [dict(path=str(native), mode="ar", temperature=0.0)]
    runs += [dict(path=str(portable), mode=m, temperature=0.0) for m in ("ar", "sd", "ssd")]
    runs += [dict(path=str(portable), mode="ssd", temperature=0.0, lane="process")]
    runs += [dict(path=str(portable), mode=m, temperature=1.0) for m in ("sd", "ssd")]
    result = run_loader(runs)
    ids, mask = prompts(2, 7, seed=1, pad_rows={1: 2})
    expected_greedy = reference_greedy(target, ids, mask, max_new_tokens=12)
    assert len(result["tokens"]) == len(runs)
    for run, tokens in zip(runs, result["tokens"]):
        original = program.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            mode=run["mode"],
            temperature=run["temperature"],
            seed=3,
            eos_token_id=None,
        ).sequences
        assert torch.equal(torch.tensor(tokens), original), f"loaded program diverged: {run}"
        if run["temperature"] == 0.0:
            assert torch.equal(torch.tensor(tokens), expected_greedy), f"diverged from transformers: {run}"
    assert result["kinds"] == {str(native): ["native"], str(portable): ["portable"]}
    compiled = {
        k: v for k, v in result["counters"].items() if k in ("stats", "inductor", "aot_autograd") and v
    }
    assert not compiled, f"the loading process captured or compiled: {compiled}"


def copy_of(artifact: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    return copy


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def no_native_loads(monkeypatch):
    """Records every AOTInductor package load; a failed check must come before any."""
    loads = []
    real = torch._C._aoti.AOTIModelPackageLoader

    def spy(*args):
        loads.append(args[0])
        return real(*args)

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", spy)
    return loads


@pytest.mark.parametrize("which", ["native", "portable"])
def test_flipped_byte_in_a_stage_file_is_refused(exported, tmp_path, no_native_loads, which):
    artifact = copy_of(exported[3] if which == "native" else exported[2], tmp_path)
    name = "stages/target.prefill.pt2" if which == "native" else "stages/draft.glue.ep"
    flip_byte(artifact / name, 1000)
    with pytest.raises(
        ArtifactError, match=rf"{name}: expected sha256 [0-9a-f]{{64}}, found [0-9a-f]{{64}}.*rebuild"
    ):
        saguaro.load(artifact)
    assert no_native_loads == []


def test_flipped_byte_in_weights_is_refused(exported, tmp_path, no_native_loads):
    artifact = copy_of(exported[3], tmp_path)
    flip_byte(artifact / "weights/target.safetensors", -5)
    with pytest.raises(ArtifactError, match=r"weights/target.safetensors: expected sha256"):
        saguaro.load(artifact)
    assert no_native_loads == []


def test_manifest_naming_another_torch_is_refused(exported, tmp_path, no_native_loads):
    artifact = copy_of(exported[3], tmp_path)
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["environment"]["torch"] = "2.0.0"
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ArtifactError,
        match=rf"environment.torch.*'2.0.0', found '{re.escape(torch.__version__)}'"
        r".*rebuild=True",
    ):
        saguaro.load(artifact)
    assert no_native_loads == []


def test_deleted_file_is_refused(exported, tmp_path, no_native_loads):
    artifact = copy_of(exported[3], tmp_path)
    (artifact / "weights/target.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"weights/target.safetensors: missing"):
        saguaro.load(artifact)
    assert no_native_loads == []


def test_truncated_manifest_is_refused(exported, tmp_path, no_native_loads):
    artifact = copy_of(exported[3], tmp_path)
    text = (artifact / "manifest.json").read_text()
    (artifact / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArtifactError, match=r"manifest.json: expected a JSON manifest.*truncated"):
        saguaro.load(artifact)
    assert no_native_loads == []


def test_a_stage_not_exported_is_named(exported, tmp_path):
    artifact = copy_of(exported[2], tmp_path)  # as if exported with sampling=False
    manifest = json.loads((artifact / "manifest.json").read_text())
    for name in ("target.verify_sampled", "draft.step_sampled", "draft.tree_sampled"):
        del manifest["stages"][name]
    manifest["sampling"] = False
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    program = saguaro.load(artifact)
    ids, mask = prompts(1, 5)
    assert program.generate(ids, max_new_tokens=3, mode="sd").sequences.shape == (1, 8)
    with pytest.raises(
        ArtifactError,
        match=r"stage target.verify_sampled was not exported \(modes \['ar', 'sd', "
        r"'ssd'\], sampling False\)",
    ):
        program.generate(ids, max_new_tokens=3, mode="sd", temperature=1.0, seed=0)


def test_the_inspector_shows_a_loaded_program_and_names_what_it_cannot(exported):
    """A loaded program's stage graphs are the exported ones (after every pass); its schedule is the
    program's; the per-pass views need the captured graphs, which an artifact does not hold."""
    _, program, portable, _ = exported
    loaded = saguaro.load(portable)
    try:
        inspector = saguaro.inspect(loaded)
        text = inspector.graph("target.verify_round_greedy", expand=True)  # greedy SD's verify and commit
        assert (
            "draft_tokens" in text and "eos_table" in text and "accept_u" not in text
        )  # the greedy round's inputs
        glue = inspector.stage_graph("draft.glue")
        outputs = next(n for n in reversed(glue.graph.nodes) if n.op == "output").args[0]
        assert len(outputs) == 2  # candidates, ranked
        layers = program.draft.spec.num_layers
        assert inspector.graph("draft.glue").count("call_module[target=submod_") == layers + 2
        lanes = lambda text: [line.split("\t")[:2] for line in text.splitlines()]
        assert lanes(inspector.schedule("ssd", format="text")) == lanes(
            saguaro.inspect(program).schedule("ssd", format="text")
        )
        for view in (
            lambda: inspector.passes("target.verify_round_greedy"),
            lambda: inspector.pass_diff("target.verify_round_greedy", "splice_epilogue"),
        ):
            with pytest.raises(
                ValueError,
                match=r"stage target.verify_round_greedy: this program was loaded from .*no "
                r"captured graph, so the per-pass views .* cannot be shown",
            ):
                view()
    finally:
        loaded.close()


def test_inputs_outside_the_exported_ranges_are_refused(exported):
    program = saguaro.load(exported[3])
    ids = torch.randint(3, 100, (65, 4))  # max_batch defaults to 64
    with pytest.raises(ValueError, match=r"dimension B=65 is outside the exported range 1..64"):
        program.generate(ids, max_new_tokens=2, mode="ar")


def test_python_only_custom_op_is_refused(tmp_path):
    target = tiny_target("llama")
    program = saguaro.compile(target, k=2, mode="ar", attention="op", backend="eager", sd_when_faster=False)
    with pytest.raises(ArtifactError, match=r"target.prefill.*custom op saguaro.attention"):
        program.export(tmp_path / "out", native=False, modes=["ar"], sampling=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.iterdir()), "the partial export must be removed"


KILL_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
import saguaro
from tests.models import tiny_target, truncated_draft
target = tiny_target("llama")
program = saguaro.compile(target, truncated_draft(target), k=2, attention="inline", lane="thread", backend="eager", sd_when_faster=False)
def announce(line):  # after the first stage, wait (on a stdin nobody writes) to be killed: never too late
    print(line, flush=True)
    if line.startswith("[1/"):
        sys.stdin.readline()
program.export(sys.argv[1], native=False, modes=["sd"], sampling=False, announce=announce)
print("finished", flush=True)
"""


@pytest.mark.heavy
def test_export_killed_midway_leaves_nothing_loadable(tmp_path):
    dest = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(dest)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.startswith("[1/"):  # one stage written, more to go
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, f"killed too late: {lines}"
    assert not dest.exists()
    with pytest.raises(ArtifactError, match=r"no such artifact directory"):
        saguaro.load(dest)
    # what the killed export left is a hidden partial directory beside the destination, which the next
    # export to the same destination removes
    leftovers = list(tmp_path.iterdir())
    assert leftovers and all(p.name.startswith(".out.partial-") for p in leftovers)
    from saguaro.artifact.export import _remove_stale_partials

    _remove_stale_partials(dest)
    assert not list(tmp_path.iterdir())


def test_bad_export_arguments_are_named(exported, tmp_path):
    _, program, portable, _ = exported
    with pytest.raises(ValueError, match=r"max_batch=0 is not allowed"):
        program.export(tmp_path / "a", max_batch=0)
    with pytest.raises(ValueError, match=r"mode='beam' is not allowed"):
        program.export(tmp_path / "b", modes=["beam"])
    with pytest.raises(saguaro.SaguaroError, match=r"cannot be exported: .*loaded"):
        saguaro.load(portable).export(tmp_path / "c")
    with pytest.raises(ArtifactError, match=r"exported for device type 'cpu', found a request for 'meta'"):
        saguaro.load(portable, device="meta")
    assert not list(tmp_path.iterdir())


def test_weights_are_written_once_outside_the_packages(exported):
    """Each model's weights live in one safetensors file; the AOTInductor package holds code only, greedy
    AR's stages are the prefill and the round, and (in the portable export, which has sampled AR's step)
    ``target.step`` shares ``target.prefill``'s files (one graph)."""
    import zipfile

    portable, native = exported[2], exported[3]
    manifest = json.loads((native / "manifest.json").read_text())
    assert sorted(manifest["stages"]) == ["target.prefill", "target.round_greedy"]
    shared = json.loads((portable / "manifest.json").read_text())["stages"]
    assert shared["target.step"]["stem"] == shared["target.prefill"]["stem"]
    assert shared["target.round_greedy"]["stem"] != shared["target.prefill"]["stem"]
    assert sorted(manifest["models"]) == ["target"]  # AR only: the draft is not exported
    names = zipfile.ZipFile(native / "stages/target.prefill.pt2").namelist()
    assert not [n for n in names if "/weights/" in n or "/constants/" in n or n.endswith(".bin")], names
    assert sorted(p.name for p in (native / "weights").iterdir()) == ["target.safetensors"]
    assert set(manifest["files"]) == {
        p.relative_to(native).as_posix()
        for p in native.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }


@pytest.mark.heavy
def test_a_quantized_program_survives_export_and_load_in_a_fresh_process(tmp_path):
    """int4 weights (the nibble panels and their scales in the weights file, unpacked by the stages' aten form):
    the loaded program's greedy AR and SD give the original program's tokens, which are the quantized target's."""
    target = tiny_target("llama")
    program = saguaro.compile(
        target,
        truncated_draft(target),
        k=3,
        mode="sd",
        attention="inline",
        lane="thread",
        backend="eager",
        sd_when_faster=False,
        weights="int4",
    )
    program.export(tmp_path / "int4", native=False, modes=["ar", "sd"], sampling=False)
    manifest = json.loads((tmp_path / "int4" / "manifest.json").read_text())
    assert manifest["config"]["weights"] == "int4"
    runs = [dict(path=str(tmp_path / "int4"), mode=m, temperature=0.0) for m in ("ar", "sd")]
    result = run_loader(runs)
    ids, mask = prompts(2, 7, seed=1, pad_rows={1: 2})
    original = program.generate(
        ids, attention_mask=mask, max_new_tokens=12, mode="ar", eos_token_id=None
    ).sequences
    program.close()
    # the quantization shows: these seeded weights' int4 tokens are not the float target's
    assert not torch.equal(original, reference_greedy(target, ids, mask, max_new_tokens=12))
    for tokens in result["tokens"]:
        assert torch.equal(torch.tensor(tokens), original)
