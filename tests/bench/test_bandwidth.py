"""What a bench row streams (``saguaro.bench.bandwidth``): a decode stage's bytes are its linears' weights as it
holds them (float32, quantized panels), not the embedding table; a token's bytes follow the row's mode; the
table shows the columns."""

import pytest
import torch

import saguaro
from saguaro.bench.bandwidth import add_bandwidth, model_stream_bytes, token_bytes
from saguaro.bench.report import format_table
from tests.models import prompts, tiny_target, truncated_draft


def _linear_bytes(model) -> int:
    return sum(
        m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


@pytest.mark.parametrize("weights", ["as-loaded", "int8"])
def test_a_models_stream_is_its_linears_weights_as_held(weights):
    target = tiny_target("llama", hidden=128)
    draft = truncated_draft(target)
    program = saguaro.compile(target, draft, k=3, mode="sd", backend="eager", weights=weights)
    ids, mask = prompts(1, 6)
    program.generate(ids, attention_mask=mask, max_new_tokens=8)
    got = {name: model_stream_bytes(program, name) for name in ("target", "draft")}
    program.close()
    for name, model in (("target", target), ("draft", draft)):
        floats = _linear_bytes(model)
        if weights == "as-loaded":
            assert got[name] == floats  # float32 weights, the embedding table not counted
        else:  # a byte a weight (panels padded to 64 columns) and a float32 scale a column
            assert floats / 4 <= got[name] <= floats / 4 * 1.6
    assert token_bytes(program, "ar", 3, 1.0) == got["target"]
    assert token_bytes(program, "sd", 3, 2.0) == round((got["target"] + 3 * got["draft"]) / 2.0)


def test_the_table_shows_bytes_rate_and_roofline_share():
    row = {"mode": "ar", "tokens_per_s": 10.0, "decode_tokens_per_s": 12.0, "weight_bytes_per_token": 2.0e9}
    add_bandwidth(row, read_gbs=30.0)
    assert row["weight_gbs"] == pytest.approx(24.0) and row["roofline_share"] == pytest.approx(0.8)
    table = format_table([row])
    header, _, line = table.splitlines()[:3]
    assert header.split()[-3:] == ["MB/token", "GB/s", "roofline"]
    assert line.split()[-3:] == ["2000.0", "24.0", "0.80"]
    unknown = {"mode": "hf", "tokens_per_s": 5.0}
    add_bandwidth(unknown, read_gbs=30.0)
    assert unknown["weight_gbs"] is None and unknown["roofline_share"] is None
