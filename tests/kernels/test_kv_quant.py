"""Quantized KV caches (int8, fp8 e4m3): the codes each implementation writes, and attention
over them, against the float64 reference over the very values the cache holds."""

from __future__ import annotations

import pytest
import torch

from duet.kernels import cpu_ops
from duet.kernels.fused import rotate_half
from duet.kernels.kv_quant import (
    QUANTIZED_DTYPES,
    decode_scales,
    dequantize_rows,
    hadamard_rows,
    quantize_rows,
    rotate,
    row_scales,
)
from duet.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch
from tests.kernels.test_cpu_kernels import _metadata, _reference_attention

NATIVE = cpu_ops.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
DTYPE_IDS = ["int8", "fp8"]


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=DTYPE_IDS)
def test_quantized_rows_keep_every_magnitude_to_the_codes_precision(cache_dtype):
    """Rows of very different magnitudes (a scale per token and head) are stored as the codes of
    their Hadamard transform, within half a code step of its largest value (int8) or e4m3's
    relative precision (fp8); ``rotate`` brings them back as close; zeros stay zero."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 3, 64, generator=generator) * torch.tensor([1e-6, 1.0, 300.0]).view(1, 3, 1)
    rows[0, 1] = 0.0
    quantized = quantize_rows(rows, cache_dtype)
    assert quantized.shape == (6, 3, 65) and quantized.dtype == cache_dtype
    back = dequantize_rows(quantized, torch.float32)
    assert torch.equal(back[0, 1], torch.zeros(64))
    transformed = rows.double() @ _sylvester(64)
    amax = transformed.abs().amax(-1, keepdim=True)
    if cache_dtype == torch.int8:
        bound = amax / 127 * 1.25 * 0.51  # the scale: amax / 127 rounded up to 3 significant bits
    else:
        bound = transformed.abs() / 16 + amax / 2**14  # 3 mantissa bits; subnormals
    assert ((back - transformed).abs() <= bound).all()
    assert ((rotate(back).double() - rows).abs() <= bound.amax(-1, keepdim=True) + amax * 1e-6).all()


def test_scale_bytes_round_up_to_three_significant_bits_and_clamp_their_exponent():
    """A row's scale is its largest magnitude over the largest code, rounded up (codes never
    overflow) to 2**E * (1 + m/4), E in [-32, 31]: the byte's fields, exactly."""
    amax = torch.tensor([127.0, 127.0 * 1.26, 127.0 * 2**-40, 0.0, 127.0 * 2**40]).view(-1, 1)
    rows = torch.cat([amax, torch.zeros(5, 3)], dim=-1)
    scales, scale_bytes = row_scales(rows, torch.int8)
    assert scales.flatten().tolist() == [1.0, 1.5, 2.0**-32, 2.0**-32, 2.0**31 * 1.75]
    assert (scale_bytes.flatten().to(torch.int32) & 0xFF).tolist() == [32 << 2, (32 << 2) | 2, 0, 0, 255]
    assert torch.equal(decode_scales(scale_bytes), scales)


def _sylvester(width: int) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < width:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


@pytest.mark.parametrize("head_dim", [8, 64, 96, 128])
def test_hadamard_rows_is_the_sylvester_matrix_in_blocks_and_rotate_undoes_it(head_dim):
    """The butterflies compute ``x @ H`` blockwise (96: three blocks of 32), and ``rotate`` is
    ``H / b``, its own inverse up to ``b``: a query and an output cross between the bases by it."""
    block = head_dim & -head_dim
    expected = torch.block_diag(*[_sylvester(block)] * (head_dim // block))
    assert torch.equal(hadamard_rows(torch.eye(head_dim)).double(), expected)
    x = torch.randn(5, head_dim)
    torch.testing.assert_close(rotate(hadamard_rows(x)), x)


def test_a_key_with_an_outlier_channel_keeps_its_other_channels():
    """Why the Hadamard basis: a row whose one channel is 100 times the rest (as RoPE's slow
    pairs make keys) would round every other channel to a step of 1/127 of the outlier; spread
    over the transform, the error per channel falls about eightfold (by sqrt(64))."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(256, 64, generator=generator)
    rows[:, 5] = 100.0
    error = rotate(dequantize_rows(quantize_rows(rows, torch.int8), torch.float32)) - rows
    step = 100.0 / 127  # the untransformed row's code step
    assert float(error.abs().mean()) < step / 4 / 4  # a quarter of a step is plain rounding's mean error


@needs_native
@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_and_torch_write_the_same_bytes(cache_dtype, dtype):
    """The fused C++ RoPE-and-write and the torch path quantize alike, byte for byte: a cache
    written by either reads the same everywhere (and PD pairs may mix them); both leave the
    query in the cache's basis."""
    generator = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim, positions = 5, 6, 2, 64, torch.tensor([0, 3, 7, 40, 41])
    q = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=generator) * 30).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    angles = torch.arange(64).float()[:, None] * torch.rand(1, head_dim // 2, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([5, 0, 17, 9, 30])
    caches, queries = [], []
    for native in (True, False):
        key_cache = torch.zeros(kv_heads, 2, 16, head_dim + 1, dtype=cache_dtype)
        value_cache = torch.zeros_like(key_cache)
        q_copy, k_copy = q.clone(), k.clone()
        if native:
            NATIVE.rope_and_cache(q_copy, k_copy, v, positions, cos, sin, key_cache, value_cache, slots)
        else:
            q_copy.copy_(rotate(rotate_half(q_copy, cos[positions][:, None], sin[positions][:, None]).float()))
            k_copy.copy_(rotate_half(k_copy, cos[positions][:, None], sin[positions][:, None]))
            write_kv_cache_torch(k_copy, v, key_cache, value_cache, slots)
        caches.append((key_cache.view(torch.uint8), value_cache.view(torch.uint8)))
        queries.append(q_copy.float())
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(queries[0], queries[1], **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
    assert int((caches[0][0] != 0).any(-1).sum()) == tokens * kv_heads


@pytest.mark.parametrize("impl", ["torch", pytest.param("cpp", marks=needs_native)])
@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", [([1, 1, 1], [1, 40, 300]), ([4, 1], [129, 17]), ([23], [23]), ([9, 1], [41, 16])])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 128), (4, 2, 32)])  # the vector kernel's widths, and the generic one's
def test_attention_over_a_quantized_cache_matches_the_reference_over_its_values(impl, cache_dtype, case, shape):
    """Decode rows, verification spans and prompt chunks read codes times their row's scale,
    in both caches: against the float64 reference over the dequantized cache."""
    generator = torch.Generator().manual_seed(2)
    query_lens, seq_lens = case
    num_heads, num_kv_heads, head_dim = shape
    block_size = 16
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    md = _metadata(query_lens, seq_lens, block_size, num_blocks, generator)
    ramp = torch.linspace(0, 4, num_blocks * block_size).view(1, num_blocks, block_size, 1)
    keys = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator) * 3 + ramp
    values = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    shrink = head_dim**-0.5  # the transform grows a row by sqrt(head_dim): the cache keeps the magnitudes of the tolerance
    key_cache, value_cache = quantize_rows(keys * shrink, cache_dtype), quantize_rows(values * shrink, cache_dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    got = paged_attention_torch(query, key_cache, value_cache, md, head_dim**-0.5, native_ops=NATIVE if impl == "cpp" else None)
    expected = _reference_attention(
        query, dequantize_rows(key_cache, torch.float64), dequantize_rows(value_cache, torch.float64), md, head_dim**-0.5
    )
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES, ids=DTYPE_IDS)
def test_torch_write_stores_quantized_rows_at_their_slots(cache_dtype):
    """Guards the byte view the write goes through (fp8 has no ``index_copy_``): each token's
    row lands at its slot, and nothing else changes."""
    key_cache = torch.zeros(2, 4, 4, 9, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache_torch(key, value, key_cache, value_cache, torch.tensor([13, 2, 7]))
    for token, slot in enumerate([13, 2, 7]):
        stored = key_cache[:, slot // 4, slot % 4].view(torch.uint8)
        assert torch.equal(stored, quantize_rows(key[token], cache_dtype).view(torch.uint8))
        assert torch.equal(value_cache[:, slot // 4, slot % 4].view(torch.uint8), quantize_rows(value[token], cache_dtype).view(torch.uint8))
    assert int((key_cache.view(torch.uint8) != 0).any(-1).sum()) == 3 * 2
