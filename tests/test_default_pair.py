"""The committed default pair: loads, fits its size and FLOPs budgets, matches its model card."""

import importlib
import platform

import pytest
import torch

import saguaro

# the module, not the package attribute of the same name (which may be the public function)
dp = importlib.import_module("saguaro.default_pair")

MAX_ASSET_BYTES = 40 * 1024 * 1024

needs_assets = pytest.mark.skipif(
    not (dp.ASSETS_DIR / "target" / "config.json").is_file(),
    reason=f"default pair not built: run `{dp.TRAIN_COMMAND}` to create saguaro/assets/default",
)


@pytest.fixture(scope="module")
def pair():
    return saguaro.default_pair()


@needs_assets
def test_loads_in_eval_mode_float32(pair):
    target, draft, tokenizer = pair
    for model in (target, draft):
        assert not model.training
        assert next(model.parameters()).dtype == torch.float32
        assert model.config.vocab_size == len(tokenizer)
        assert model.generation_config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id


@needs_assets
def test_dtype_argument(pair):
    target, _, _ = saguaro.default_pair(dtype=torch.bfloat16)
    assert next(target.parameters()).dtype == torch.bfloat16


@needs_assets
def test_assets_at_most_40_mb():
    size = sum(f.stat().st_size for f in dp.ASSETS_DIR.rglob("*") if f.is_file())
    assert size <= MAX_ASSET_BYTES, f"saguaro/assets/default holds {size / 1e6:.1f} MB"


@needs_assets
def test_sizes_and_draft_flops_ratio(pair):
    target, draft, _ = pair
    cfg = target.config
    assert cfg.num_hidden_layers >= 6 and cfg.hidden_size >= 384
    ft, fd = dp.flops_per_token(target), dp.flops_per_token(draft)
    assert fd <= ft / 8, f"draft costs {fd / ft:.4f} of the target"
    expected = dp.load_heldout_eval()
    assert (ft, fd) == (expected["target_flops_per_token"], expected["draft_flops_per_token"])


@needs_assets
def test_heldout_perplexity_matches_model_card(pair):
    target, draft, tokenizer = pair
    ev = dp.load_heldout_eval()
    chunks = dp.heldout_chunks(
        tokenizer,
        ev["n_chunks"],
        ev["seq_len"],
        heldout_percent=ev["heldout_percent"],
        max_file_bytes=ev["max_file_bytes"],
    )
    if dp.slice_digest(chunks) != ev["slice_sha1"]:
        pytest.skip(
            f"this Python's stdlib ({platform.python_version()}) gives a different held-out slice "
            f"than the one evaluated (Python {ev['python_version']})"
        )
    for model, key in ((target, "target_ppl"), (draft, "draft_ppl")):
        ppl = dp.perplexity(model, chunks)
        assert ppl == pytest.approx(ev[key], rel=0.01), f"{key}: {ppl:.3f} vs card {ev[key]:.3f}"
    assert ev["target_ppl"] < ev["draft_ppl"]


@needs_assets
def test_greedy_generation_reads_like_python(pair):
    target, _, tokenizer = pair
    ids = tokenizer("import os\n\n\ndef main(", return_tensors="pt")["input_ids"]
    out = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
    )
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith("import os\n\n\ndef main(") and len(text) > len("import os\n\n\ndef main(")


def test_split_rule_is_fixed():
    # The held-out set is a published rule; these paths pin it (sha1 mod 100 = 2, 2, 2 and >= 3).
    assert dp.is_heldout("_collections_abc.py") and dp.is_heldout("decimal.py")
    assert dp.is_heldout("email/encoders.py")
    assert not dp.is_heldout("os.py") and not dp.is_heldout("json/decoder.py")
    files = dp.corpus_files()
    if not files:
        pytest.skip(f"this interpreter ships no stdlib sources under {dp.stdlib_root()}")
    # the pinned paths are in the corpus (so the split above is about real files), sorted, packages excluded
    assert {"_collections_abc.py", "decimal.py", "os.py", "json/decoder.py"} <= set(files)
    assert files == sorted(files) and all("site-packages" not in f for f in files)


def test_heldout_snippets_come_from_heldout_files_only(tmp_path):
    """On a corpus of one training file and two held-out ones: only held-out text, whole lines from a
    top-level def or class, spread over both held-out files, capped in lines and characters."""
    body = "".join(f"    x{i} = {i}   \n" for i in range(30))
    (tmp_path / "email").mkdir()
    (tmp_path / "os.py").write_text("def trained_on():\n" + body)  # not held out
    (tmp_path / "decimal.py").write_text("import sys\n\nclass Decimal:\n" + body + "def other():\n    pass")
    (tmp_path / "email" / "encoders.py").write_text("'''doc'''\ndef encode(msg):\n" + body)
    snippets = dp.heldout_snippets(3, root=tmp_path, max_lines=5, max_chars=50)
    assert [(s.path, s.line) for s in snippets] == [
        ("decimal.py", 3),
        ("decimal.py", 34),
        ("email/encoders.py", 2),
    ]
    lines = [f"    x{i} = {i}\n" for i in range(30)]  # 11 characters each, trailing spaces dropped
    assert snippets[0].text == "class Decimal:\n" + "".join(lines[:3])  # 48 characters: a 4th line makes 59
    assert snippets[1].text == "def other():\n    pass\n"  # the file's last line, given its newline
    assert snippets[2].text == "def encode(msg):\n" + "".join(lines[:3])  # 50 characters
    assert dp.heldout_snippets(1, root=tmp_path, max_lines=3, max_chars=1000)[0].text == (
        "class Decimal:\n" + "".join(lines[:2])
    )  # three lines
    assert dp.heldout_snippets(3, root=tmp_path, max_lines=5, max_chars=50) == snippets
    with pytest.raises(ValueError, match="no held-out file under"):
        dp.heldout_snippets(2, root=tmp_path / "email" / "none")


def test_missing_assets_raise_saguaro_error(monkeypatch, tmp_path):
    monkeypatch.setattr(dp, "ASSETS_DIR", tmp_path)
    with pytest.raises(saguaro.SaguaroError, match="train_default_pair.py"):
        saguaro.default_pair()
