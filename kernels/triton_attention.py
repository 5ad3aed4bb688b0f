"""Triton kernels for the paged KV cache: writing new K/V into it and attending over it.

The cache of one layer is ``key_cache`` / ``value_cache``, each
``[num_kv_heads, num_blocks, block_size, head_dim]``; flat slot ``s`` is block
``s // block_size``, offset ``s % block_size``. Attention also reads quantized caches (int8 or
fp8 e4m3 codes with a one-byte scale per row, ``kv_quant``), decoding the codes from their
bits; those caches are written by ``kv_quant``'s torch code, on any device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from duet.kernels.kv_quant import head_dim_of
from duet.kernels.metadata import AttentionMetadata

_LOG2_E = 1.4426950408889634
_KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}  # 0: the cache holds floats


@triton.jit
def _dequantize(codes, scale_bytes, KV_CODES: tl.constexpr):
    """Codes (the int8 bits of an int8 or e4m3 cache) times their row's scale, exactly, in fp32
    (the scale byte: 6 bits of exponent from -32, 2 of mantissa; ``kv_quant.decode_scales``)."""
    if KV_CODES == 1:
        values = codes.to(tl.float32)
    else:
        bits = codes.to(tl.int32) & 0xFF
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
        values = tl.where(bits >= 128, -magnitude, magnitude)
    byte = scale_bytes.to(tl.int32) & 0xFF
    return values * ((((byte >> 2) + 95) << 23) | ((byte & 3) << 21)).to(tl.float32, bitcast=True)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kch,
    stride_kcb,
    stride_kcs,
    stride_kcd,
    stride_vch,
    stride_vcb,
    stride_vcs,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    key = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    tl.store(
        key_cache_ptr
        + offs_h[:, None] * stride_kch
        + block_id * stride_kcb
        + block_offset * stride_kcs
        + offs_d[None, :] * stride_kcd,
        key,
        mask=mask,
    )
    tl.store(
        value_cache_ptr
        + offs_h[:, None] * stride_vch
        + block_id * stride_vcb
        + block_offset * stride_vcs
        + offs_d[None, :] * stride_vcd,
        value,
        mask=mask,
    )


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V ``[num_tokens, num_kv_heads, head_dim]`` at its cache slot.

    Token ``t`` goes to ``cache[h, slot // block_size, slot % block_size, :]`` for every kv
    head ``h``, where ``slot = slot_mapping[t]``; tokens with a negative slot are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    cache_shape = key_cache.shape
    if value_cache.shape != cache_shape or cache_shape[0] != num_kv_heads or cache_shape[3] != head_dim:
        raise ValueError(
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} must both be "
            f"[{num_kv_heads}, num_blocks, block_size, {head_dim}] to hold key {tuple(key.shape)}"
        )
    _check_vector(slot_mapping, "slot_mapping", num_tokens)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale times log2(e), so the kernel can use exp2
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kch,
    stride_kcb,
    stride_kcs,
    stride_kcd,
    stride_vch,
    stride_vcb,
    stride_vcs,
    stride_vcd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bts,
    stride_btb,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # cache block size, also the KV tile width
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN_DOT_OPERANDS: tl.constexpr,  # only for the CPU interpreter, see paged_attention_triton
    KV_CODES: tl.constexpr,  # 0: float cache; 1: int8, 2: fp8 e4m3 codes, the scale's byte after them
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    q_block_start = q_block * BLOCK_Q
    # The grid is sized for the longest query span; shorter sequences have idle tiles.
    if q_block_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row m is query token m // GROUP of this tile, query head m % GROUP of this kv head's
    # group, so all heads sharing a kv head read each K/V tile once.
    offs_m = tl.arange(0, BLOCK_M)
    q_index = q_block_start + offs_m // GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_index < query_len)
    q_pos = context_len + q_index
    token = (query_start + q_index).to(tl.int64)
    q_head = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim

    q = tl.load(
        query_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if WIDEN_DOT_OPERANDS:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys up to the tile's last query position, inclusive.
    kv_len = context_len + tl.minimum(q_block_start + BLOCK_Q, query_len)
    offs_n = tl.arange(0, BLOCK_SIZE)
    k_head_ptr = key_cache_ptr + kv_head * stride_kch
    v_head_ptr = value_cache_ptr + kv_head * stride_vch
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for logical_block in range(0, tl.cdiv(kv_len, BLOCK_SIZE)):
        block_id = tl.load(block_table_ptr + logical_block * stride_btb).to(tl.int64)
        k_pos = logical_block * BLOCK_SIZE + offs_n
        # Slots past kv_len were never written and may hold NaN; 0 * NaN would poison acc.
        k_valid = k_pos < kv_len
        k_rows = k_head_ptr + block_id * stride_kcb + offs_n * stride_kcs
        v_rows = v_head_ptr + block_id * stride_vcb + offs_n * stride_vcs
        k = tl.load(k_rows[None, :] + offs_d[:, None] * stride_kcd, mask=k_valid[None, :] & d_valid[:, None], other=0)
        v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_vcd, mask=k_valid[:, None] & d_valid[None, :], other=0)
        if KV_CODES != 0:
            k_scale_bytes = tl.load(k_rows + head_dim * stride_kcd, mask=k_valid, other=0)
            v_scale_bytes = tl.load(v_rows + head_dim * stride_vcd, mask=k_valid, other=0)
            k = _dequantize(k, k_scale_bytes[None, :], KV_CODES).to(query_ptr.dtype.element_ty)
            v = _dequantize(v, v_scale_bytes[:, None], KV_CODES).to(query_ptr.dtype.element_ty)
        if WIDEN_DOT_OPERANDS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(k_pos[None, :] <= q_pos[:, None], scores, float("-inf"))

        # Every row, padding rows included, sees key 0 in the first block, so m_new is finite
        # and exp2 never meets -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Probabilities are rounded to the model dtype (a float cache's, a quantized one's values)
        # as the tensor-core dot consumes them.
        p = p.to(query_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention of a flat token batch over the paged KV cache.

    ``query`` is ``[num_tokens, num_q_heads, head_dim]``; the result has the same shape and
    dtype. Prefill chunks, decode tokens and multi-token verification spans may share one
    batch: query token ``j`` of sequence ``i`` sits at position
    ``seq_lens[i] - query_len_i + j`` and attends to positions ``0..`` that one. The cache
    must already hold this step's K/V (see ``write_kv_cache_triton``).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    cache_head_dim = head_dim_of(key_cache)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}"
        )
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's head_dim {cache_head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size} must be a power of two of at least 16 (the tl.dot tile minimum)"
        )
    num_seqs = metadata.num_seqs
    _check_vector(metadata.query_start_loc, "query_start_loc", num_seqs + 1)
    _check_vector(metadata.seq_lens, "seq_lens", num_seqs)

    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    # Rows for the longest query span's heads, capped at 64 to bound the fp32 accumulator
    # in registers, but never below tl.dot's 16 or one whole head group.
    rows_needed = triton.next_power_of_2(group * metadata.max_query_len)
    block_m = max(16, triton.next_power_of_2(group), min(64, rows_needed))
    block_q = block_m // group
    grid = (num_seqs, triton.cdiv(metadata.max_query_len, block_q), num_kv_heads)
    kv_codes = _KV_CODES.get(key_cache.dtype, 0)
    if kv_codes:  # the bits, decoded in the kernel: fp8 pointers are not everywhere Triton runs
        key_cache, value_cache = key_cache.view(torch.int8), value_cache.view(torch.int8)
    _paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        scale * _LOG2_E,
        head_dim,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *out.stride(),
        *metadata.block_tables.stride(),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 serving is a debugging path; keep it exact rather than silently TF32. Other
        # dtypes take the backend default, as not every backend accepts "tf32".
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        # Triton's CPU interpreter multiplies bf16 dot operands as their raw uint16 bits. CPU
        # tensors only run under the interpreter, so there the operands go in as fp32, where
        # bf16 products are exact; GPUs keep the native bf16 dot.
        WIDEN_DOT_OPERANDS=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        KV_CODES=kv_codes,
    )
    return out


def _check_vector(tensor: torch.Tensor, name: str, length: int) -> None:
    """The kernels index 1-D metadata by element offset, so it must be dense and sized right."""
    if tensor.dim() != 1 or tensor.shape[0] != length or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D tensor of {length} entries, got shape {tuple(tensor.shape)}"
        )
