"""``benchmarks/real_size/``: the pair builder (a draft of the target's first layers, agreement tuned by scaling
the later layers, a byte-level tokenizer) and the GGUF writer (llama.cpp's tensor names, Llama's q / k rows in
GGML's rotary order, a vocabulary whose ids are the bytes), on tiny models; the real shapes are the published
configs' numbers."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "real_size"))
import make_pair
import to_gguf

from tests.models import tiny_target


@pytest.mark.parametrize(
    "shape, layers, hidden, vocab",
    [
        ("tinyllama-1.1b", 22, 2048, 32000),
        ("llama-3.2-1b", 16, 2048, 128256),
        ("qwen2.5-0.5b", 24, 896, 151936),
    ],
)
def test_the_named_shapes_are_the_published_configs(shape, layers, hidden, vocab):
    config = make_pair.make_config(shape)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (layers, hidden, vocab)


def test_the_draft_is_the_targets_first_layers_and_the_tuned_agreement_is_measured():
    target = tiny_target("llama", hidden=64, layers=3, logit_scale=4.0)
    draft = make_pair.draft_of(target, 1)
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    prompts = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    scale, measured = make_pair.tune(target, draft, 1, 0.9, steps=4, prompts=prompts)
    assert 0.0 <= scale <= 1.0
    assert measured == pytest.approx(make_pair.agreement(target, draft, prompts, 32))
    # the scale is the later layers' only: the first layer is still the draft's
    assert torch.equal(
        target.model.layers[0].mlp.down_proj.weight, draft.model.layers[0].mlp.down_proj.weight
    )
    with torch.no_grad():
        for w in make_pair.later_projections(target, 1):
            w.zero_()
    assert (
        make_pair.agreement(target, draft, prompts, 8) == 1.0
    )  # the later layers silent: the target is the draft


def test_the_seeded_pair_scales_the_later_layers_and_keeps_the_first(monkeypatch):
    from saguaro.bench import real_size

    tiny = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    monkeypatch.setitem(real_size.SHAPES, "tiny", tiny)
    plain = real_size.random_target("tiny", 3, torch.float32)
    target, draft, tokenizer = real_size.seeded_pair("tiny", seed=3, scale=0.25, dtype=torch.float32)
    assert torch.equal(
        target.model.layers[1].self_attn.o_proj.weight, plain.model.layers[1].self_attn.o_proj.weight * 0.25
    )
    assert torch.equal(
        target.model.layers[2].mlp.down_proj.weight, plain.model.layers[2].mlp.down_proj.weight * 0.25
    )
    assert torch.equal(
        target.model.layers[0].mlp.down_proj.weight, plain.model.layers[0].mlp.down_proj.weight
    )
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(
        draft.model.layers[0].self_attn.o_proj.weight, target.model.layers[0].self_attn.o_proj.weight
    )
    assert tokenizer("ab").input_ids[-2:] == [ord("a"), ord("b")]
    with pytest.raises(SystemExit, match="draft_layers=3 must lie in 1..2"):
        real_size.seeded_pair("tiny", draft_layers=3)


def test_text_is_its_bytes_ids_in_the_byte_tokenizer():
    tokenizer = make_pair.byte_tokenizer(300)
    text = "def f(x):\n    return x + 1  # ¿é?"
    assert tokenizer(text).input_ids == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text


def test_the_gguf_file_holds_llama_cpp_s_names_and_rotary_order(tmp_path):
    gguf = pytest.importorskip("gguf")
    model = tiny_target("llama", hidden=64)
    model.save_pretrained(tmp_path / "model")
    make_pair.byte_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "model")
    to_gguf.write(tmp_path / "model", tmp_path / "model.gguf", "f32")
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "blk.1.ffn_down.weight"} <= set(
        tensors
    )
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()).reshape(64, 64)
    heads = model.config.num_attention_heads
    assert torch.equal(q, to_gguf.permute(model.model.layers[0].self_attn.q_proj.weight.detach(), heads))
    assert not torch.equal(q, model.model.layers[0].self_attn.q_proj.weight.detach())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    first = bytes(tokens.parts[tokens.data[ord("a")]]).decode()
    assert (
        first == "a" and json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "llama"
    )


def test_the_roofline_script_times_the_linears_a_step_calls():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
    import roofline_linears

    shapes = roofline_linears.step_shapes(make_pair.make_config("tinyllama-1.1b"))
    assert (
        len(shapes) == 4 * 22 + 1 and shapes[0] == ((32 + 2 * 4) * 64, 2048) and shapes[-1] == (32000, 2048)
    )
    assert sum(n * k for n, k in shapes) * 2 == pytest.approx(
        2.07e9, rel=0.01
    )  # the journal's 2.07 GB in bf16
    with pytest.raises(SystemExit) as done:
        roofline_linears.main(["--help"])
    assert done.value.code == 0
    with pytest.raises(SystemExit, match="--pages 'small'"):
        roofline_linears.main(["--pages", "small"])
