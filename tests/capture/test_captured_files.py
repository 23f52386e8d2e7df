"""A captured draft as files (``CapturedSource``): read back, it is the same graph over the same tensors
(ties kept, parameters still parameters) and gives the same logits; a draft process builds its server
from them without importing ``transformers``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from saguaro.capture import capture
from saguaro.capture.captured_files import CapturedSource, load_captured
from saguaro.capture.export import example_inputs
from tests.models import tiny_config, tiny_family_target

REPO = Path(__file__).resolve().parents[2]


def tied_draft():
    torch.manual_seed(0)
    draft = LlamaForCausalLM(tiny_config("llama", layers=1)).eval()
    draft.config.tie_word_embeddings = True
    draft.tie_weights()
    return draft


def test_the_files_give_the_same_graph_tensors_and_logits(tmp_path):
    for model in (tied_draft(), tiny_family_target("gemma2").to(torch.bfloat16)):
        captured = capture(model)
        source = CapturedSource.of(captured)
        description = source.save(str(tmp_path))
        read = load_captured(
            json.loads(json.dumps(description)), torch.device("cpu")
        )  # as the draft process gets it
        assert read.spec == captured.spec
        expected = [line for line in captured.graph_module.code.splitlines() if "_guards_fn" not in line]
        assert (
            read.graph_module.code.splitlines() == expected
        )  # export's input guard is not kept (graph_file)
        original = dict(captured.graph_module.named_parameters(remove_duplicate=False))
        again = dict(read.graph_module.named_parameters(remove_duplicate=False))
        assert sorted(again) == sorted(original) and again  # parameters come back as parameters
        buffers = dict(read.graph_module.named_buffers())
        for name, tensor in source.tensors.items():
            got = again.get(name, buffers.get(name))
            assert got is not None and got.dtype == tensor.dtype and torch.equal(got, tensor), name
        inputs = example_inputs(captured.spec)
        with torch.no_grad():
            assert torch.equal(
                read.graph_module(*inputs), captured.graph_module(*example_inputs(captured.spec))
            )
    assert description["aliases"] == {}  # gemma2's head is not tied
    tied = load_captured(
        source_description(tied_draft(), tmp_path / "tied"), torch.device("cpu")
    ).graph_module
    names = [
        n
        for n, _ in tied.named_parameters(remove_duplicate=False)
        if n.endswith(("embed_tokens.weight", "lm_head.weight"))
    ]
    assert len(names) == 2 and tied.get_parameter(names[0]) is tied.get_parameter(names[1])  # the tie holds


def source_description(model, folder: Path) -> dict:
    folder.mkdir()
    return CapturedSource.of(capture(model)).save(str(folder))


CHILD = """
import json, sys, torch
from saguaro.compile import captured_draft_server
from saguaro.core.config import SaguaroConfig
from saguaro.runtime.draft.server import GenerateSpec
description = json.loads(sys.argv[1])
server = captured_draft_server(description, SaguaroConfig(k=2, backend="eager"))
ids = torch.tensor([[1, 2, 3, 4]])
spec = GenerateSpec(ids, torch.ones_like(ids), 8, 32, [], 0, 0.0, None)
server.open(spec)  # the draft's prefill, then k steps: its attention runs
speculation = server.start(torch.tensor([5]))
print(json.dumps({"layers": server.draft.spec.num_layers, "tokens": list(speculation.tokens.shape),
                  "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_a_draft_process_builds_its_server_and_speculates_without_transformers_or_dynamo(tmp_path):
    description = dict(
        source_description(tied_draft(), tmp_path / "draft"), backend="eager", attention="auto", device="cpu"
    )
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(description)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # an eager draft calls the attention ops' kernels directly: a custom op's first call would import
    # torch._dynamo (seconds) in a process that compiles nothing
    assert result == {"layers": 1, "tokens": [1, 2], "transformers": [], "dynamo": False}
