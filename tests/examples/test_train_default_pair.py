"""examples/train_default_pair.py keeps working: a 20-step run on tiny sizes, and its --help."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_default_pair.py"

TINY = [
    "--max-steps",
    "20",
    "--max-files",
    "30",
    "--vocab-size",
    "512",
    "--seq-len",
    "64",
    "--target-layers",
    "2",
    "--target-hidden",
    "64",
    "--target-heads",
    "2",
    "--target-intermediate",
    "128",
    "--draft-layers",
    "1",
    "--draft-hidden",
    "16",
    "--draft-heads",
    "2",
    "--draft-intermediate",
    "32",
    "--target-batch",
    "4",
    "--draft-batch",
    "4",
    "--eval-chunks",
    "4",
    "--eval-len",
    "64",
    "--accept-prompts",
    "4",
    "--accept-prompt-len",
    "16",
    "--accept-new-tokens",
    "16",
    "--sample-new-tokens",
    "4",
    "--log-every",
    "10",
    "--eval-every",
    "10",
    "--ckpt-every",
    "10",
    "--threads",
    "1",
]


def _run(*args, timeout=240):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _parser():
    spec = importlib.util.spec_from_file_location("train_default_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_help_documents_every_option():
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    options = [s for a in _parser()._actions for s in a.option_strings if s.startswith("--")]
    assert {"--resume", "--max-steps", "--threads", "--out", "--seed", "--kd-alpha"} <= set(options)
    missing = [o for o in options if o not in proc.stdout]
    assert not missing, f"--help does not mention {missing}"
    for action in _parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


@pytest.mark.heavy
def test_tiny_run_writes_loadable_pair_and_resumes(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _run(*TINY, "--out", str(out), "--workdir", str(work))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tok/s" in proc.stderr and "ETA" in proc.stderr  # progress is logged
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(out / name)
        tokenizer = AutoTokenizer.from_pretrained(out / name)
        assert model.config.vocab_size == len(tokenizer) == 512
        assert (out / name / "generation_config.json").is_file()
        ids = tokenizer("def f(x):", return_tensors="pt")["input_ids"]
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 512)
    assert next(AutoModelForCausalLM.from_pretrained(out / "target").parameters()).dtype == torch.float16
    ev = json.loads((out / "heldout_eval.json").read_text())
    assert ev["flops_ratio"] <= 1 / 8 and ev["n_chunks"] == 4
    results = json.loads((work / "results.json").read_text())
    assert results["steps"] == {"target": 20, "draft": 20}
    # the acceptance estimate accounts for every generated token: each round emits its accepted drafts
    # plus one, and the rounds of each of the 4 prompts cover its accept_new_tokens (16) once; a prompt's
    # last round, cut short by the end of the continuation, still counts its bonus token (one past the end)
    acc = results["acceptance"]
    hist = acc["accepted_hist"]  # rounds by accepted count 0..k
    assert len(hist) == results["args"]["k"] + 1 and sum(hist) == acc["rounds"]
    emitted = sum((a + 1) * rounds for a, rounds in enumerate(hist))
    assert results["accept_new_tokens"] == 16 and 4 * 16 <= emitted <= 4 * (16 + 1)
    assert acc["mean_accepted_len"] == pytest.approx(emitted / acc["rounds"])
    assert (out / "MODEL_CARD.md").read_text().count("```") >= 8

    # Finished phases are reloaded, not retrained, and give the same evaluation.
    proc = _run(*TINY, "--out", str(out), "--workdir", str(work), "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loaded finished phase" in proc.stderr and "target step" not in proc.stderr
    assert json.loads((out / "heldout_eval.json").read_text()) == ev
