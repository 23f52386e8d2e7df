"""Weight-only int8 / int4 quantization and the kernels that read it: the packed kernel over quantized panels
gives the dequantized weight's outputs bit for bit, in the vector and the scalar loop and for any number of rows;
the op's aten form agrees with it within float32 rounding; the quantization error is within half a step; bad
bits and group sizes are refused by name."""

import pytest
import torch

from saguaro.tensor_math import packed_linear as pl
from saguaro.tensor_math import quantized_linear as ql

pytestmark = pytest.mark.skipif(not pl.available(), reason="the packed kernel could not be built here")


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, None), (4, 16), (4, 64)])
@pytest.mark.parametrize(
    "rows, n, k", [(1, 48, 64), (2, 250, 128), (6, 130, 192), (7, 64, 64), (13, 17, 256)]
)
def test_quantized_panels_give_the_dequantized_weights_bits_in_both_loops_at_any_row_count(
    bits, group, rows, n, k
):
    gen = torch.Generator().manual_seed(rows * n + k + bits)
    x = torch.randn(rows, k, generator=gen)  # [M, K]
    weight = torch.randn(n, k, generator=gen)  # [N, K]
    q, scales = ql.quantize(weight, bits, group)
    packed, packed_scales = ql.pack_quantized(q, scales, bits)
    assert packed.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert packed.shape == (-(-n // pl.PANEL), k if bits == 8 else k // 2, pl.PANEL)
    dequantized = ql.dequantize(q, scales)  # [N, K] float32
    got = pl.packed_linear_q(x, packed, packed_scales, n)  # [M, N]
    assert torch.equal(got, pl.packed_linear(x, pl.pack(dequantized), n))
    assert torch.equal(torch.ops.saguaro_kernels.packed_linear_q_scalar(x, packed, packed_scales, n), got)
    for row in range(rows):  # one row alone (AR's step) gives the bits it gets among others (a verify)
        assert torch.equal(pl.packed_linear_q(x[row : row + 1], packed, packed_scales, n), got[row : row + 1])
    torch.testing.assert_close(ql.quantized_linear(x, packed, packed_scales, n), got, rtol=1e-5, atol=1e-4)
    assert torch.equal(ql.unpacked_weight(packed, packed_scales, n, k), dequantized)
    step = scales.repeat_interleave(k // scales.shape[1], dim=1)  # [N, K]: each weight's scale
    assert bool(((weight - dequantized).abs() <= step / 2 * (1 + 1e-5)).all())
    assert int(q.abs().max()) <= (127 if bits == 8 else 7)


def test_sixteen_bit_panels_give_the_same_bits_at_any_row_count():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 320, generator=gen)
    weight = torch.randn(200, 320, generator=gen)
    for dtype in (torch.float16, torch.bfloat16):
        panels = pl.pack(weight.to(dtype))
        assert panels.shape == (4, 320, pl.PANEL)
        rows6 = pl.packed_linear(x, panels, 200)
        assert torch.equal(rows6, pl.packed_linear(x, pl.pack(weight.to(dtype).float()), 200))
        for row in range(6):
            assert torch.equal(pl.packed_linear(x[row : row + 1], panels, 200), rows6[row : row + 1])


def test_the_read_bandwidth_is_measured_and_positive():
    assert pl.read_bandwidth(megabytes=64, passes=1) > 0.1  # GB/s: any machine reads faster than that


@pytest.mark.parametrize(
    "bits, group, match",
    [
        (3, None, "bits=3"),
        (8, 48, "group size 48 does not divide"),
        (4, 5, "group size 5 does not divide"),
        (4, 7, "int4 group size must be even, got 7"),
        (8, 0, "group size 0"),
    ],
)
def test_bad_bits_and_group_sizes_are_refused_by_name(bits, group, match):
    with pytest.raises(ValueError, match=match):
        ql.quantize(torch.randn(8, 112 if group == 7 else 64), bits, group)


def test_the_kernel_refuses_scales_that_do_not_fit():
    q, scales = ql.quantize(torch.randn(64, 64), 8)
    packed, packed_scales = ql.pack_quantized(q, scales, 8)
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32"):
        pl.packed_linear_q(torch.randn(1, 64), packed, packed_scales.double(), 64)
    with pytest.raises(RuntimeError, match="packed's rows do not fit"):
        pl.packed_linear_q(torch.randn(1, 32), packed, packed_scales, 64)
