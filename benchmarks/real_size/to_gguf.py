"""Write a Hugging Face Llama or Qwen2 checkpoint as a GGUF file for llama.cpp, with the ``gguf`` package from
PyPI (``pip install gguf``): the weights as they are, in ``f16``, ``bf16``, ``f32``, ``q8_0`` or ``q4_0``.

    python benchmarks/real_size/to_gguf.py pairs/tinyllama/target pairs/tinyllama/target-f16.gguf --outtype f16
    python benchmarks/real_size/to_gguf.py pairs/tinyllama/draft pairs/tinyllama/draft-q8_0.gguf --outtype q8_0

Meant for :mod:`make_pair`'s pairs: their byte-level tokenizer (ids 0..255 the bytes, no merges that text can
reach) is written as a ``gpt2`` vocabulary without a BOS token, so llama.cpp turns a prompt into the very ids
Saguaro's tokenizer gives. Llama's q and k projections are permuted into GGML's rotary layout (adjacent pairs
rotated, where ``transformers`` rotates halves), as llama.cpp's own converter does; Qwen2 keeps its layout
(GGML's NeoX rotation is ``transformers``'). Norms and biases stay float32, as llama.cpp's converter keeps them.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("to_gguf")
ARCHES = {"llama": "llama", "qwen2": "qwen2"}
TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``transformers``' rotate-half rows of a q/k projection as GGML's adjacent pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_names(config) -> dict[str, str]:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(config["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in parts.items()})
    return names


def write(folder: Path, out: Path, outtype: str) -> None:
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = ARCHES.get(config["model_type"])
    if arch is None:
        raise SystemExit(
            f"{folder}: model_type {config['model_type']!r}; this writer knows {', '.join(ARCHES)}"
        )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2, "bf16": 32}[outtype])
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [None] * config["vocab_size"]
    for text, index in vocab.items():
        if index < len(tokens):
            tokens[index] = text
    tokens = [t if t is not None else f"<pad{i}>" for i, t in enumerate(tokens)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.NORMAL if i < 256 else gguf.TokenType.USER_DEFINED for i in range(len(tokens))]
    )
    merges = json.loads((folder / "tokenizer.json").read_text())["model"].get("merges") or []
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges] or ["õ ö"])
    writer.add_bos_token_id(config.get("bos_token_id") or 1)
    writer.add_eos_token_id(config.get("eos_token_id") or 2)
    writer.add_add_bos_token(False)
    names = gguf_names(config)
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    quant = getattr(gguf.GGMLQuantizationType, TYPES[outtype])
    for name, tensor in state.items():
        if name not in names:
            raise SystemExit(f"{folder}: no GGUF name for tensor {name!r}")
        tensor = tensor.float()
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = permute(tensor, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            tensor = permute(tensor, kv_heads)
        data = tensor.numpy()
        if tensor.dim() == 1 or outtype == "f32":
            writer.add_tensor(names[name], data.astype(np.float32))
        elif outtype == "f16":
            writer.add_tensor(names[name], data.astype(np.float16))
        else:
            packed = gguf.quants.quantize(data, quant)
            writer.add_tensor(names[name], packed, raw_shape=packed.shape, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("wrote %s (%s, %.2f GB)", out, outtype, out.stat().st_size / 1e9)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a Hugging Face checkpoint folder (config.json, *.safetensors)")
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--outtype", default="f16", choices=sorted(TYPES))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write(args.folder, args.out, args.outtype)


if __name__ == "__main__":
    main()
