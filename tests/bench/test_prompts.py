"""``saguaro bench``'s prompts: the default pair's are snippets of its held-out files (never trained on),
and the report says so; where that text is unavailable the fallback is explicit, logged and reported."""

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from saguaro.bench import run as bench_run
from saguaro.bench.prompts import DEFAULT_PROMPTS, FIXED, HELDOUT, RANDOM, prompt_set
from saguaro.bench.worker import BenchParams, run_prompts
from tests.tiny_tokenizer import tiny_tokenizer

dp = importlib.import_module("saguaro.default_pair")  # the module, not the function of the same name


@pytest.fixture(scope="module")
def tokenizer():
    """The default pair's own tokenizer (a small file: no model is loaded)."""
    from transformers import AutoTokenizer

    if not (dp.ASSETS_DIR / "target" / "tokenizer.json").is_file():
        pytest.skip(f"default pair not built: run `{dp.TRAIN_COMMAND}`")
    return AutoTokenizer.from_pretrained(dp.ASSETS_DIR / "target")


def default_target(tokenizer):
    """What bench reads of the default target: its vocabulary and its positions (256)."""
    config = dp.load_heldout_eval()  # present with the assets
    assert config["seq_len"] == 256
    return SimpleNamespace(config=SimpleNamespace(vocab_size=len(tokenizer), max_position_embeddings=256))


def test_the_default_pairs_bench_prompts_are_held_out_stdlib_text(tokenizer):
    params = BenchParams(prompts=8, max_new_tokens=64)  # no folders: the default pair
    prompts = run_prompts(params, tokenizer, default_target(tokenizer))
    if prompts.source != HELDOUT:
        pytest.skip(f"this interpreter has no stdlib sources: {prompts.detail}")
    assert len(prompts.ids) == len(prompts.origins) == 8
    paths = [origin.rsplit(":", 1)[0] for origin in prompts.origins]
    assert all(dp.is_heldout(path) for path in paths), paths  # never a file the pair trained on
    assert len(set(paths)) > 1  # spread over the held-out files, not one file's first functions
    root = dp.stdlib_root()
    for ids, origin in zip(prompts.ids, prompts.origins):
        path, line = origin.rsplit(":", 1)
        source = "".join(x.rstrip() + "\n" for x in dp.read_source(root, path).splitlines()[int(line) - 1 :])
        text = tokenizer.decode(ids[0], skip_special_tokens=True)
        assert text.startswith(("def ", "class ")) and source.startswith(text), origin  # the file's own lines
        assert ids.shape[1] + params.max_new_tokens <= 256  # room for the tokens each row generates
    again = run_prompts(params, tokenizer, default_target(tokenizer))
    assert again.origins == prompts.origins and all(torch.equal(a, b) for a, b in zip(again.ids, prompts.ids))


def test_a_long_generation_gets_shorter_held_out_prompts(tokenizer):
    prompts = run_prompts(BenchParams(prompts=8, max_new_tokens=200), tokenizer, default_target(tokenizer))
    if prompts.source != HELDOUT:
        pytest.skip(f"this interpreter has no stdlib sources: {prompts.detail}")
    assert max(ids.shape[1] for ids in prompts.ids) <= 56


def test_without_stdlib_sources_bench_says_it_uses_the_fixed_prompts(
    tokenizer, monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(dp, "stdlib_root", lambda: tmp_path)  # an interpreter shipped without its .py files
    with caplog.at_level(logging.WARNING, logger="saguaro.bench.prompts"):
        prompts = run_prompts(BenchParams(prompts=3), tokenizer, default_target(tokenizer))
    assert prompts.source == FIXED and "held-out stdlib sources are unavailable" in prompts.detail
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and str(tmp_path) in caplog.text
    assert [tokenizer.decode(ids[0], skip_special_tokens=True) for ids in prompts.ids] == list(
        DEFAULT_PROMPTS[:3]
    )


def test_other_pairs_get_fixed_prompts_or_random_ids_and_say_why():
    tok = tiny_tokenizer()
    fixed = prompt_set(tok, 14, 128, seed=0, default_pair=False)  # a user's pair: no held-out text known
    assert fixed.source == FIXED and "default pair only" in fixed.detail
    assert [tok.decode(ids[0], skip_special_tokens=True) for ids in fixed.ids] == [
        DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(14)
    ]
    random = prompt_set(None, 3, 50, seed=4, default_pair=True)  # no tokenizer: ids, whatever the pair
    assert random.source == RANDOM and "no tokenizer" in random.detail
    assert all(ids.shape == (1, 8) and int(ids.min()) >= 3 and int(ids.max()) < 50 for ids in random.ids)
    assert all(
        torch.equal(a, b) for a, b in zip(random.ids, prompt_set(None, 3, 50, seed=4, default_pair=True).ids)
    )
    assert not torch.equal(random.ids[0], prompt_set(None, 3, 50, seed=5, default_pair=True).ids[0])


def test_the_report_and_the_output_name_the_prompt_source(tokenizer, monkeypatch):
    """run_bench announces the prompts before the rows and writes them into the report (no row is run)."""
    import saguaro.models_io

    target = default_target(tokenizer)
    monkeypatch.setattr(saguaro.models_io, "load_pair", lambda *args, **kwargs: (target, None, tokenizer))
    expected = run_prompts(BenchParams(prompts=2, modes=("hf",)), tokenizer, target)

    class FakeRow:  # a warm row that times nothing
        setup_s = None
        time_pass = staticmethod(lambda: {"tokens_per_s": 1.0})
        finish = staticmethod(lambda: {"mode": "hf", "tokens_per_s": 1.0, "prompt_source": expected.source})
        close = staticmethod(lambda: None)

    monkeypatch.setattr(bench_run, "start_row", lambda params, mode, backend: FakeRow())
    lines = []
    report = bench_run.run_bench(BenchParams(prompts=2, modes=("hf",)), announce=lines.append)
    assert report["prompts"] == expected.describe() and report["prompts"]["count"] == 2
    assert lines[0] == f"prompts ({expected.source}): 2 {expected.detail}"
