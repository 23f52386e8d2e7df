"""lm-evaluation-harness (the real ``lm_eval`` command) runs ``local-completions`` against ``saguaro serve``.

The default pair is served on loopback (``--backend eager --mode sd``, float32) and lm-eval runs two local tasks
(``tests/serve/lm_eval_tasks/``: a multiple-choice loglikelihood task and a ``generate_until`` task on Python
code, over JSONL files: nothing comes from the Hugging Face hub, which is kept offline). ``--batch_size 4`` makes
lm-eval send prompt lists of token ids (``echo``, ``logprobs: 1``, ``max_tokens: 1`` for loglikelihoods; stop
lists for generations). Checked against lm-eval's own ``hf`` model on the same target, from the per-sample logs
(``--log_samples``): every loglikelihood within :data:`TOLERANCE`, the same greedy flags, and the same
generations, which are also the server's own answers to the same requests sent directly.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "serve" / "lm_eval_tasks"
TARGET = REPO / "saguaro" / "assets" / "default" / "target"
LIMIT = 4  # documents per task: 16 loglikelihoods (4 choices each) and 4 generations
TOLERANCE = 1e-3  # the bound on |server - hf| per loglikelihood
LM_EVAL_TIMEOUT = 300  # seconds, per lm_eval run
READY = re.compile(r"saguaro serve: (\S+) at (http://127\.0\.0\.1:\d+/v1)")
# one worker runs both tests: the module's fixture (the three processes) is built once
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("lm_eval")]

if importlib.util.find_spec("lm_eval") is None:  # not imported here: lm_eval runs in its own processes
    pytest.skip("lm-eval is not installed: pip install -e '.[dev]'", allow_module_level=True)
if not (TARGET / "model.safetensors").is_file():
    pytest.skip(
        "the default pair is not built: python examples/train_default_pair.py", allow_module_level=True
    )


def offline_env(cache: Path) -> dict:
    """The environment of every child: the hub and datasets offline, their caches in ``cache``, one thread."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(cache / "hf"),
        HF_DATASETS_CACHE=str(cache / "datasets"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )


def lm_eval(model: str, model_args: str, out: Path, env: dict) -> subprocess.Popen:
    """``lm_eval --model MODEL`` over the two local tasks, run from the repository (the tasks' data paths)."""
    argv = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args]
    argv += ["--include_path", str(TASKS), "--tasks", "saguaro_python_mc,saguaro_python_gen"]
    argv += ["--limit", str(LIMIT), "--batch_size", "4", "--log_samples", "--output_path", str(out)]
    with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def finished(process: subprocess.Popen, out: Path) -> dict:
    """The per-sample logs of a finished lm_eval run: ``{task: [sample, ...]}`` in document order."""
    code = process.wait(timeout=LM_EVAL_TIMEOUT)
    log = out.with_suffix(".log").read_text()
    assert code == 0, f"lm_eval exited {code}:\n{log[-4000:]}"
    samples = {}
    for task in ("saguaro_python_mc", "saguaro_python_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.open()), key=lambda s: s["doc_id"])
    return samples


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """lm-eval's ``hf`` model and its ``local-completions`` against ``saguaro serve`` (the hf run and the
    server's start overlap); ``(hf samples, server samples, server url)``."""
    root = tmp_path_factory.mktemp("lm_eval")
    env = offline_env(root)
    hf = lm_eval("hf", f"pretrained={TARGET},dtype=float32,add_bos_token=True", root / "hf", env)
    code = "import sys; from saguaro.cli import main; sys.exit(main(sys.argv[1:]))"
    serve_argv = ["serve", "--backend", "eager", "--mode", "sd", "--port", "0"]
    with open(root / "serve.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", code, *serve_argv],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=dict(env, PYTHONPATH=str(REPO)),
        )
    try:
        line = server.stdout.readline()
        ready = READY.search(line)
        assert ready, f"saguaro serve did not start: {line!r}\n{(root / 'serve.log').read_text()[-4000:]}"
        name, url = ready.groups()
        args = (
            f"model={name},base_url={url}/completions,tokenizer={TARGET},tokenizer_backend=huggingface,"
            "add_bos_token=True,max_retries=1"
        )
        served = finished(lm_eval("local-completions", args, root / "served", env), root / "served")
        yield finished(hf, root / "hf"), served, url
    finally:
        server.terminate()  # SIGTERM: the server drains and exits
        for process in (hf, server):
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        server.stdout.close()


def loglikelihoods(samples) -> list:
    """``(loglikelihood, is_greedy)`` of every choice of every document, in order."""
    return [(float(r[0][0]), r[0][1]) for s in samples for r in s["resps"]]


def test_loglikelihoods_equal_lm_evals_own_hf_model(runs):
    hf, served, _ = runs
    want, got = loglikelihoods(hf["saguaro_python_mc"]), loglikelihoods(served["saguaro_python_mc"])
    assert len(got) == len(want) == 4 * LIMIT
    worst = max(abs(g - w) for (g, _), (w, _) in zip(got, want))
    assert worst <= TOLERANCE, (worst, got, want)
    assert [g for _, g in got] == [w for _, w in want]  # is_greedy: the server's top-1 is the target's argmax
    assert [s["acc"] for s in served["saguaro_python_mc"]] == [s["acc"] for s in hf["saguaro_python_mc"]]


def test_the_generation_task_returns_the_servers_greedy_completions(runs):
    hf, served, url = runs
    texts = [s["resps"][0][0] for s in served["saguaro_python_gen"]]
    assert len(texts) == LIMIT and any(texts)
    assert texts == [s["resps"][0][0] for s in hf["saguaro_python_gen"]]  # float32 greedy: the target's own
    for sample, text in zip(served["saguaro_python_gen"], texts):
        kwargs = sample["arguments"]["gen_args_0"]["arg_1"]
        body = {
            "prompt": sample["arguments"]["gen_args_0"]["arg_0"],
            "max_tokens": kwargs["max_gen_toks"],
            "stop": kwargs["until"],
            "temperature": 0,
        }
        answer = httpx.post(url + "/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == text
