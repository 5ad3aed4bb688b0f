"""The GGUF block matmuls (``kernels/csrc/gguf_ops.cpp``): their weights are gguf's own
dequantization bit for bit, and their products equal float matmuls over those weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from duet.kernels import cpu_ops

OPS = cpu_ops.load_gguf()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C++ toolchain")
TYPES = {"Q4_1": gguf.GGMLQuantizationType.Q4_1, "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def quantized(rows: int, cols: int, qtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights as GGUF block rows, and gguf's own dequantization of them."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    blocks = gguf.quants.quantize(values, qtype)
    dequantized = gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(blocks).reshape(rows, -1)), torch.from_numpy(dequantized)


@pytest.mark.parametrize("name", TYPES)
def test_the_kernels_weights_are_ggufs_dequantization_bit_for_bit(name):
    blocks, reference = quantized(75, 192, TYPES[name])
    assert torch.equal(OPS.gguf_dequantize(blocks, int(TYPES[name]), 192), reference)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
def test_products_equal_float_matmuls_over_the_dequantized_weights(name, rows):
    # 75 outputs: not a multiple of the kernel's 4- or 2-feature tiles; 11 rows: a tile of 8 and one of 3.
    blocks, weights = quantized(75, 192, TYPES[name], seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    got = OPS.gguf_matmul(x, blocks, int(TYPES[name]))
    expected = (x.double() @ weights.double().T).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_malformed_weights_are_refused_with_a_reason():
    blocks, _ = quantized(4, 64, TYPES["Q4_1"])
    with pytest.raises(RuntimeError, match="do not hold"):
        OPS.gguf_matmul(torch.randn(1, 96), blocks, int(TYPES["Q4_1"]))
    with pytest.raises(RuntimeError, match="not supported"):
        OPS.gguf_matmul(torch.randn(1, 64), blocks, 2)
