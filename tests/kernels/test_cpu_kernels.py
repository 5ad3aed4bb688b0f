"""The CPU kernels (C++ and torch) agree with an obviously-correct float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet.kernels import AttentionMetadata, cpu_ops
from duet.kernels.fused import add_rms_norm, rms_norm, rope_and_write_kv, rotate_half, silu_and_mul
from duet.kernels.torch_attention import paged_attention_torch, write_kv_cache_torch

NATIVE = cpu_ops.load()
IMPLEMENTATIONS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain"))]


def _metadata(query_lens, seq_lens, block_size, num_blocks, generator):
    """Random, non-contiguous block tables for sequences of the given lengths."""
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, slots, cursor = [], [], 0
    for q_len, s_len, n in zip(query_lens, seq_lens, blocks_needed):
        table = perm[cursor : cursor + n]
        cursor += n
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len)]
    width = max(blocks_needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def _reference_attention(query, key_cache, value_cache, md, scale, window=None, softcap=None):
    num_kv_heads, _, block_size, _ = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query, dtype=torch.float64)
    for seq, (q_len, s_len) in enumerate(zip(md.query_lens, md.seq_lens_list)):
        start = int(md.query_start_loc[seq])
        positions = torch.arange(s_len)
        blocks = md.block_tables[seq][positions // block_size].long()
        keys = key_cache[:, blocks, positions % block_size].double().repeat_interleave(group, 0)
        values = value_cache[:, blocks, positions % block_size].double().repeat_interleave(group, 0)
        q = query[start : start + q_len].double().transpose(0, 1)
        scores = q @ keys.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(s_len - q_len, s_len)
        scores.masked_fill_(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window is not None:
            scores.masked_fill_(positions[None, None, :] <= q_pos[None, :, None] - window, float("-inf"))
        out[start : start + q_len] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


CASES = {
    "decode": ([1, 1, 1, 1], [1, 16, 17, 40]),
    "prefill": ([23], [23]),
    "chunk_over_context": ([9], [41]),
    "verification_spans": ([4, 4], [20, 33]),
    "mixed": ([1, 30, 5, 1], [50, 30, 37, 16]),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
def test_paged_attention_matches_reference(impl, case, heads):
    """Guards the causal offset, GQA head mapping, block-table indexing and partial last blocks."""
    generator = torch.Generator().manual_seed(0)
    query_lens, seq_lens = CASES[case]
    num_heads, num_kv_heads = heads
    head_dim, block_size, num_blocks = 64, 16, 24
    md = _metadata(query_lens, seq_lens, block_size, num_blocks, generator)
    key_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    value_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    got = paged_attention_torch(query, key_cache, value_cache, md, 0.125, native_ops=NATIVE if impl == "cpp" else None)
    torch.testing.assert_close(got.double(), _reference_attention(query, key_cache, value_cache, md, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [64, 32])  # the vector kernel's, and the generic one's
@pytest.mark.parametrize(("window", "softcap"), [(7, None), (20, None), (1, None), (12, 0.5), (None, 0.3)])
def test_windowed_and_soft_capped_attention_matches_reference(impl, case, head_dim, window, softcap):
    """Guards sliding windows (each row sees its last ``window`` keys, from a start inside a
    block, across blocks, the query alone at 1) and soft-capped scores, dispatched as the model
    calls them: decode rows and spans through the C++ kernel, chunks and caps in torch."""
    from duet.kernels import paged_attention

    generator = torch.Generator().manual_seed(1)
    query_lens, seq_lens = CASES[case]
    md = _metadata(query_lens, seq_lens, 16, 24, generator)
    key_cache = torch.randn(3, 24, 16, head_dim, generator=generator)
    value_cache = torch.randn(3, 24, 16, head_dim, generator=generator)
    query = torch.randn(sum(query_lens), 9, head_dim, generator=generator)
    if impl == "cpp":
        got = paged_attention(query, key_cache, value_cache, md, 0.125, window, softcap)
    else:
        got = paged_attention_torch(query, key_cache, value_cache, md, 0.125, window=window, softcap=softcap)
    expected = _reference_attention(query, key_cache, value_cache, md, 0.125, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


def _rising_keys(query_lens, seq_lens, heads, head_dim, block_size, dtype, seed):
    """Metadata, queries and caches for sequences of these lengths, the keys rising over
    positions: later keys score higher, so an online softmax's max grows chunk by chunk."""
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    md = _metadata(query_lens, seq_lens, block_size, num_blocks, generator)
    ramp = torch.linspace(0, 4, num_blocks * block_size).view(1, num_blocks, block_size, 1)
    key_cache = (torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator) + ramp).to(dtype)
    value_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).abs().to(dtype)
    return md, query, key_cache, value_cache


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
@pytest.mark.parametrize("head_dim", [64, 128, 32])  # the vector kernel's two widths, and the generic one's
@pytest.mark.parametrize("block_size", [16, 8, 32])  # chunks of 16 tokens within a block, across blocks, two a block
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (12, 1)])  # groups of 3, 8 (the vector kernel's most) and 12 (generic)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_attention_over_long_contexts(head_dim, block_size, heads, dtype):
    """Decode rows and a verification span over contexts of many 16-token chunks (the online
    softmax rescales as the running max grows; the last chunk is partial), against the float64
    reference over the very values the caches hold."""
    md, query, key_cache, value_cache = _rising_keys([1, 4, 1], [300, 129, 17], heads, head_dim, block_size, dtype, seed=1)
    got = paged_attention_torch(query, key_cache, value_cache, md, head_dim**-0.5, native_ops=NATIVE)
    expected = _reference_attention(query, key_cache, value_cache, md, head_dim**-0.5)
    tolerance = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # bf16 output rounding
    torch.testing.assert_close(got.double(), expected, **tolerance)


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 8, 32])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (12, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (40, None), (None, 0.5), (100, 0.8)])
def test_native_prompt_attention_over_many_key_chunks(head_dim, block_size, heads, dtype, window, softcap):
    """Prompt chunks through the tiled C++ kernel, taken directly: a whole prompt of several
    tiles of query rows (the last one partial) over many chunks of keys, a chunk over a long
    cached context, and one whose tokens fill neither a tile nor a key chunk; keys rising over
    positions; with a sliding window (the chunks before a tile's first key skipped, the rest
    masked per row) and soft-capped scores. Against the float64 reference."""
    md, query, key_cache, value_cache = _rising_keys([203, 37, 9], [203, 300, 9], heads, head_dim, block_size, dtype, seed=2)
    got = torch.full_like(query, float("nan"))
    attended = NATIVE.prompt_attention(
        got, query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, [0, 1, 2], head_dim**-0.5,
        window or 0, softcap or 0.0,
    )
    assert attended
    expected = _reference_attention(query, key_cache, value_cache, md, head_dim**-0.5, window, softcap)
    # fp32: torch's SDPA is 2.1e-5 off the reference on the head_dim 128 case; bf16: output rounding
    tolerance = {"atol": 5e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.double(), expected, **tolerance)


@pytest.mark.skipif(NATIVE is None or not NATIVE.prompt_attention_amx(), reason="no AMX-BF16 here")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (12, 2)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (40, None), (None, 0.5)])
def test_amx_prompt_attention_is_as_close_as_fp32_products(head_dim, heads, window, softcap):
    """bf16 prompts by AMX tiles (probabilities rounded to bf16, as torch's flash kernel rounds
    them) against the same kernel's fp32 products over the same bf16 values: both within the
    bf16 tolerance of the float64 reference, and AMX's mean error at most twice fp32's (the
    output's rounding to bf16 is the larger part of both). A sequence's rows come out bitwise the
    same in a call of their own (batch invariance: a row's sums do not depend on the tile's
    other rows)."""
    md, query, key_cache, value_cache = _rising_keys(
        [203, 37, 9], [203, 300, 9], heads, head_dim, 16, torch.bfloat16, seed=3
    )
    expected = _reference_attention(query, key_cache, value_cache, md, head_dim**-0.5, window, softcap)
    outputs = {}
    try:
        for amx in (False, True):
            NATIVE.set_prompt_attention_amx(amx)
            got = torch.full_like(query, float("nan"))
            assert NATIVE.prompt_attention(
                got, query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, [0, 1, 2],
                head_dim**-0.5, window or 0, softcap or 0.0,
            )
            torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)
            outputs[amx] = got
        starts = md.query_start_loc.tolist()
        for seq in (1, 2):
            alone = torch.full_like(query, float("nan"))
            NATIVE.prompt_attention(
                alone, query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, [seq],
                head_dim**-0.5, window or 0, softcap or 0.0,
            )
            rows = slice(starts[seq], starts[seq + 1])
            assert torch.equal(alone[rows], outputs[True][rows])
    finally:
        NATIVE.set_prompt_attention_amx(True)
    errors = {amx: (out.double() - expected).abs().mean().item() for amx, out in outputs.items()}
    print(f"mean errors: fp32 products {errors[False]:.2e}, AMX {errors[True]:.2e}")
    assert errors[True] <= 2 * errors[False], errors


def test_write_kv_cache_stores_each_token_at_its_slot():
    """Guards against K/V landing in the wrong block, offset or head."""
    key_cache = torch.zeros(2, 4, 4, 8)
    value_cache = torch.zeros(2, 4, 4, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache_torch(key, value, key_cache, value_cache, torch.tensor([13, 2, 7]))
    for token, slot in enumerate([13, 2, 7]):
        torch.testing.assert_close(key_cache[:, slot // 4, slot % 4], key[token], rtol=0, atol=0)
        torch.testing.assert_close(value_cache[:, slot // 4, slot % 4], value[token], rtol=0, atol=0)
    assert int((key_cache != 0).sum()) == 3 * 2 * 8


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
def test_fused_layer_ops_match_transformers_formulas():
    """Guards the fused norm (with residual add), RoPE + cache write and SiLU-and-mul."""
    torch.manual_seed(0)
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), expected, atol=1e-5, rtol=1e-5)
    summed = residual + x
    normed = add_rms_norm(x.clone(), residual, weight, 1e-5)
    torch.testing.assert_close(residual, summed, atol=0, rtol=0)
    torch.testing.assert_close(normed, weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)), atol=1e-5, rtol=1e-5)

    gate_up = torch.randn(3, 2 * 40)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:], atol=1e-6, rtol=1e-5)

    qkv = torch.randn(4, (6 + 2 + 2) * 16)
    q, k, v = (t.view(4, -1, 16) for t in qkv.split([96, 32, 32], dim=-1))
    positions = torch.tensor([0, 5, 6, 30])
    freqs = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
    cos_table, sin_table = freqs.cos(), freqs.sin()
    expected_q = rotate_half(q, cos_table[positions][:, None], sin_table[positions][:, None])
    expected_k = rotate_half(k, cos_table[positions][:, None], sin_table[positions][:, None])
    key_cache, value_cache = torch.zeros(2, 4, 8, 16), torch.zeros(2, 4, 8, 16)
    slots = torch.tensor([3, 9, 10, 31])
    rope_and_write_kv(q, k, v, positions, cos_table, sin_table, key_cache, value_cache, slots)
    torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, expected_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key_cache.view(2, 32, 16)[:, slots].transpose(0, 1), expected_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(value_cache.view(2, 32, 16)[:, slots].transpose(0, 1), v, atol=0, rtol=0)


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
def test_bf16_silu_and_mul_rounds_as_torch_does():
    """bf16's SiLU-and-mul: silu in fp32 rounded to bf16, then the product rounded to nearest
    even, as torch's bf16 ops round them. Gates of 16 to 64 make silu(g) = g exactly, so every
    product's rounding (ties among them) is checked bit for bit; with random gates an fp32 silu
    a bit or two away from torch's (another exponential, another division) may round to the
    next bf16 (0.1% of them on a Xeon), and the product to one more step. Rows of 520: AVX-512's
    16 at a time and the rest one by one."""
    generator = torch.Generator().manual_seed(0)
    up = torch.randn(64, 520, generator=generator).to(torch.bfloat16)
    gate = torch.randint(16, 65, (64, 520), generator=generator).to(torch.bfloat16)
    exact = silu_and_mul(torch.cat([gate, up], dim=1))
    assert torch.equal(exact, F.silu(gate) * up)
    gate = torch.randn(64, 520, generator=generator).mul(4).to(torch.bfloat16)
    gate[0, :3] = torch.tensor([0.0, -50.0, 100.0])
    out, expected = silu_and_mul(torch.cat([gate, up], dim=1)), F.silu(gate) * up
    same = out == expected
    assert same.float().mean() > 0.99, same.float().mean()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-6, atol=0)


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
@pytest.mark.parametrize("hidden", [576, 100])  # 16 lanes at a time (AVX512_BF16), one by one
def test_bf16_rms_norm_rounds_as_transformers_does(hidden):
    """bf16's fused residual add and RMSNorm as transformers computes them: the residual's sum
    rounded to bf16, the row normed in fp32 and rounded, times the weight and rounded. The
    squares' sum in another order may move the norm by an ulp, and a normed value to the next
    bf16: nearly all outputs equal, each within a bf16 step or two."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, hidden, generator=generator).mul(3).to(torch.bfloat16)
    residual = torch.randn(64, hidden, generator=generator).to(torch.bfloat16)
    weight = torch.randn(hidden, generator=generator).to(torch.bfloat16)

    def transformers_norm(h: torch.Tensor) -> torch.Tensor:
        h32 = h.float()
        return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)

    summed = residual + x
    cases = [(rms_norm(x, weight, 1e-5), transformers_norm(x))]
    kept = residual.clone()
    cases.append((add_rms_norm(x.clone(), kept, weight, 1e-5), transformers_norm(summed)))
    assert torch.equal(kept, summed)
    for got, expected in cases:
        assert (got == expected).float().mean() > 0.99
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=1e-6)


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_very_negative_gates_is_zero_not_nan(dtype):
    """Guards gates below -ln(FLT_MAX), where exp(-g) overflows: torch's silu is -0 there; the
    kernel's vectorized division (under -ffast-math) gave NaN for gates of -89 and -100.
    Just above, silu is under 1e-36 (the kernel may flush it to zero)."""
    gate = torch.linspace(-110.0, -80.0, 256).to(dtype)[None].repeat(4, 1)
    up = torch.ones_like(gate)
    out, expected = silu_and_mul(torch.cat([gate, up], dim=1)), F.silu(gate) * up
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-5, atol=1e-35)
