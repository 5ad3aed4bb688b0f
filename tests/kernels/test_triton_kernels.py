"""The Triton cache-write and paged-attention kernels, run by Triton's CPU interpreter
against a float64 reference that gathers each sequence's K/V through its block table; and the
Triton GGUF kernels against gguf's own dequantizer."""

import os

# The interpreter must be chosen before triton is imported anywhere.
os.environ["TRITON_INTERPRET"] = "1"

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from duet.kernels import triton_gguf  # noqa: E402
from duet.kernels.gguf import GGUFWeight  # noqa: E402
from duet.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton  # noqa: E402
from tests.kernels.attention_cases import build_batch, reference_attention  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _check_attention(spans, num_q_heads=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32):
    query, key_cache, value_cache, metadata = build_batch(
        spans, num_q_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = paged_attention_triton(query, key_cache, value_cache, metadata, scale)
    expected = reference_attention(query, key_cache, value_cache, metadata, scale)
    assert out.dtype == dtype and out.shape == query.shape
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


GQA_AND_DTYPE = pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, dtype",
    [(4, 4, torch.float32), (9, 3, torch.float32), (9, 3, torch.bfloat16)],
)


@GQA_AND_DTYPE
def test_decode_batch_with_partial_last_blocks(num_q_heads, num_kv_heads, dtype):
    """Decode tokens at lengths 1, 16, 17 and 40 must ignore the unwritten tail of the last block."""
    _check_attention([(0, 1), (15, 1), (16, 1), (39, 1)], num_q_heads, num_kv_heads, dtype=dtype)


@GQA_AND_DTYPE
def test_prefill_without_context_is_causal(num_q_heads, num_kv_heads, dtype):
    _check_attention([(0, 21), (0, 5)], num_q_heads, num_kv_heads, dtype=dtype)


@GQA_AND_DTYPE
def test_prefill_chunk_attends_to_cached_context(num_q_heads, num_kv_heads, dtype):
    """Chunk token j sits at context_len + j, not at j."""
    _check_attention([(19, 13)], num_q_heads, num_kv_heads, dtype=dtype)


@GQA_AND_DTYPE
def test_mixed_batch_of_decode_prefill_and_chunk(num_q_heads, num_kv_heads, dtype):
    _check_attention([(23, 1), (0, 18), (17, 9), (0, 1)], num_q_heads, num_kv_heads, dtype=dtype)


def test_verification_span_of_k_plus_one_tokens():
    """Speculative decoding verifies k+1 tokens per sequence on top of its context."""
    _check_attention([(30, 4), (7, 4), (15, 4)], num_q_heads=9, num_kv_heads=3)


def test_query_span_longer_than_one_tile():
    """A 70-token prefill with 3-way GQA spans four query tiles of 21 tokens."""
    _check_attention([(5, 70)], num_q_heads=6, num_kv_heads=2, head_dim=16)


def test_head_dim_128_and_block_size_32():
    _check_attention([(40, 1), (0, 33)], num_q_heads=2, num_kv_heads=1, head_dim=128, block_size=32)


def test_non_power_of_two_head_dim_is_padded():
    _check_attention([(10, 1), (0, 7)], num_q_heads=2, num_kv_heads=2, head_dim=80)


def test_query_sliced_from_fused_qkv_uses_its_strides():
    """Models split q out of a fused qkv projection, leaving a non-contiguous view."""
    spans = [(12, 1), (0, 6)]
    query, key_cache, value_cache, metadata = build_batch(spans, 9, 3, 64, 16, torch.float32)
    fused = torch.cat([query, torch.randn(query.shape[0], 6, 64)], dim=1)
    query_view = fused[:, :9]
    assert not query_view.is_contiguous()
    out = paged_attention_triton(query_view, key_cache, value_cache, metadata, 0.125)
    expected = reference_attention(query, key_cache, value_cache, metadata, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_rejects_mismatched_head_counts():
    query, key_cache, value_cache, metadata = build_batch([(0, 2)], 4, 3, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="num_q_heads=4 must be a multiple of num_kv_heads=3"):
        paged_attention_triton(query, key_cache, value_cache, metadata, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_stores_each_token_and_skips_padding(dtype):
    num_kv_heads, num_blocks, block_size, head_dim = 3, 4, 16, 64
    key_cache = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    # Slots in blocks 2, 0 and 3; the -1 token is padding and must not land anywhere.
    slot_mapping = torch.tensor([37, 5, -1, 63], dtype=torch.int64)
    key = torch.randn(4, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(4, num_kv_heads, head_dim).to(dtype)

    write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)

    expected_key = torch.zeros_like(key_cache)
    expected_value = torch.zeros_like(value_cache)
    for token, (block, offset) in {0: (2, 5), 1: (0, 5), 3: (3, 15)}.items():
        expected_key[:, block, offset] = key[token]
        expected_value[:, block, offset] = value[token]
    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)


def test_write_kv_cache_reads_key_and_value_through_strides():
    """K and V arrive as views of a fused [tokens, q+k+v heads, head_dim] projection."""
    num_kv_heads, block_size, head_dim = 2, 16, 32
    fused = torch.randn(3, 4 + 2 * num_kv_heads, head_dim)
    key, value = fused[:, 4:6], fused[:, 6:8]
    key_cache = torch.zeros(num_kv_heads, 2, block_size, head_dim)
    value_cache = torch.zeros_like(key_cache)

    write_kv_cache_triton(key, value, key_cache, value_cache, torch.tensor([16, 17, 0]))

    assert torch.equal(key_cache[:, 1, :2], key[:2].transpose(0, 1))
    assert torch.equal(value_cache[:, 0, 0], value[2])


@pytest.mark.parametrize("native", [False, True])
def test_triton_agrees_with_the_cpu_implementations_on_a_mixed_batch(native):
    """The GPU and CPU paths are interchangeable: same batch, same answer."""
    from duet.kernels import cpu_ops
    from duet.kernels.torch_attention import paged_attention_torch

    native_ops = cpu_ops.load() if native else None
    if native and native_ops is None:
        pytest.skip("no C++ toolchain")
    query, key_cache, value_cache, metadata = build_batch(
        [(0, 1), (20, 1), (0, 23), (17, 9), (40, 4)], 9, 3, 64, 16, torch.float32
    )
    # The CPU paths gather whole blocks and mask afterwards, so unused slots hold numbers, not NaN.
    key_cache = torch.nan_to_num(key_cache, nan=0.5)
    value_cache = torch.nan_to_num(value_cache, nan=-0.5)
    triton_out = paged_attention_triton(query, key_cache, value_cache, metadata, 0.125)
    cpu_out = paged_attention_torch(query, key_cache, value_cache, metadata, 0.125, native_ops=native_ops)
    torch.testing.assert_close(triton_out, cpu_out, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_quantized_caches_as_the_cpu_paths_do(cache_dtype, dtype):
    """Int8 and e4m3 codes decoded from their bits in the kernel, times each row's scale: the
    same attention as the torch path over the same quantized cache (every e4m3 code, subnormals
    and negatives included, is in these caches)."""
    from duet.kernels.kv_quant import quantize_rows, rotate
    from duet.kernels.torch_attention import paged_attention_torch

    query, key_cache, value_cache, metadata = build_batch([(0, 1), (20, 1), (0, 23), (17, 9), (40, 4)], 9, 3, 64, 16, torch.float32)
    # Rows rotated first: the cache's Hadamard transform gives them back, so it holds codes of these very values.
    key_cache = quantize_rows(rotate(torch.nan_to_num(key_cache, nan=0.5) * torch.logspace(-3, 1, 64)), cache_dtype)
    value_cache = quantize_rows(rotate(torch.nan_to_num(value_cache, nan=-0.5)), cache_dtype)
    if cache_dtype == torch.float8_e4m3fn:
        assert len(torch.unique(key_cache[..., :-1].view(torch.uint8))) > 200
    query = query.to(dtype)
    triton_out = paged_attention_triton(query, key_cache, value_cache, metadata, 0.01)
    cpu_out = paged_attention_torch(query, key_cache, value_cache, metadata, 0.01)
    torch.testing.assert_close(triton_out.float(), cpu_out.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0])
def test_triton_gguf_kernels_use_ggufs_weights_bit_for_bit_and_multiply_them(qtype):
    values = np.random.default_rng(0).standard_normal((37, 96)).astype(np.float32) * 0.1
    blocks = gguf.quants.quantize(values, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(37, 96))
    weight = GGUFWeight.from_blocks(torch.from_numpy(np.ascontiguousarray(blocks).reshape(37, -1)), int(qtype), 96, triton_gguf)
    assert torch.equal(weight.dequantize(), reference)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(weight.matmul(x), (x.double() @ reference.double().T).float(), rtol=1e-5, atol=1e-5)
    excluded = weight.matmul(x).argmax(dim=-1, keepdim=True)  # each row's best excluded: its runner-up wins
    products = weight.matmul(x).scatter(1, excluded, float("-inf"))
    assert torch.equal(weight.matmul_argmax(x, excluded), products.argmax(dim=-1))


@pytest.mark.parametrize(
    "qtype", [gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K]
)
def test_triton_gguf_kernels_read_k_quants_as_rewritten_bit_for_bit(qtype):
    from tests.gguf_writer import k_quant_blocks

    blocks = k_quant_blocks(37, 256, int(qtype), magnitude=0.001)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(37, 256))
    weight = GGUFWeight.from_blocks(torch.from_numpy(blocks), int(qtype), 256, triton_gguf)
    assert torch.equal(weight.dequantize(), reference)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(weight.matmul(x), (x.double() @ reference.double().T).float(), rtol=1e-5, atol=1e-5)


def test_triton_gguf_kernels_read_float8_blocks_bit_for_bit():
    """compressed-tensors' FP8 weights kept as float8 blocks (``kernels.gguf.float8_blocks``):
    every code but NaN's, subnormals included, read as torch reads them, times the block's scale."""
    from duet.kernels.gguf import float8_blocks
    from tests.kernels.test_gguf_ops import float8_codes

    weights = float8_codes(37, 256, seed=2)
    scales = torch.rand(37, 8, generator=torch.Generator().manual_seed(3)) * 1e-3 + 1e-5
    reference = weights.float() * scales.repeat_interleave(32, dim=1)
    weight = float8_blocks(weights, scales, triton_gguf)
    assert torch.equal(weight.dequantize(), reference)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(weight.matmul(x), (x.double() @ reference.double().T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights, rows", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_triton_lora_adds_each_rows_own_adapters_update_and_leaves_base_rows_alone(weights, rows):
    """Adapters of ranks 8, 5 (not a power of two) and 16, one leaving the module out, rows of
    the base among theirs, more rows of one adapter than a block holds: each row gets its own
    adapter's ``(x A^T) B^T`` (summed in fp32, added and rounded once to the row's dtype, as the
    C++ kernel does); base rows and rows of the adapter without the module are untouched."""
    from duet.kernels.triton_lora import ROW_BLOCK, LoRABlocks, lora_add_triton

    generator = torch.Generator().manual_seed(4)
    in_features, out_features = 70, 45  # not multiples of the tiles
    adapters = [
        {"m": (torch.randn(rank, in_features, generator=generator).to(weights), torch.randn(rank, out_features, generator=generator).to(weights))}
        for rank in (8, 5, 16)
    ]
    adapters[1]["other"] = adapters[1].pop("m")  # adapter 1 leaves m out
    slots = [0, -1, 2, 0, 1, 2] + [0] * (ROW_BLOCK + 3) + [-1, 2]
    x = torch.randn(len(slots), in_features, generator=generator).to(rows)
    y = torch.randn(len(slots), out_features, generator=generator).to(rows)
    expected = y.double().clone()
    for row, slot in enumerate(slots):
        if slot in (0, 2):
            a, bt = adapters[slot]["m"]
            expected[row] += (x[row].double() @ a.double().T) @ bt.double()
    base = y.clone()
    lora_add_triton(y, x, LoRABlocks(adapters, slots, "cpu"), "m")
    untouched = [row for row, slot in enumerate(slots) if slot in (-1, 1)]
    assert torch.equal(y[untouched], base[untouched])
    tolerance = 1e-5 if rows == torch.float32 else 0  # a bf16 row: the fp32 sum rounded once, to within an ulp
    torch.testing.assert_close(y.double(), expected.to(rows).double(), rtol=tolerance or 8e-3, atol=tolerance or 1e-2)
    before = y.clone()
    lora_add_triton(y, x, LoRABlocks(adapters, slots, "cpu"), "not a module of any adapter")  # nothing to add
    assert torch.equal(y, before)
