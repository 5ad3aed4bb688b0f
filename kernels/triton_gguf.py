"""Triton kernels over GGUF codes (``kernels.gguf.GGUFWeight``'s layout): the GPU twin of
``csrc/gguf_ops.cpp``, with its functions' names and arguments (this module is a
``GGUFWeight``'s ``ops`` on a GPU; its argmax is not fused: it reads the full products). Each program dequantizes a tile of output features, block of 32 weights
by block, to the floats gguf's dequantizer gives (d * q exact in fp32, one rounding for + m),
and accumulates in fp32.

Q4_1 codes are 16 bytes a block laid out as four 32-bit words (``kernels.gguf._q4_1_words``): weight
``e``'s code sits in byte ``4 * (e % 4) + 2 * (e // 16) + (e % 16) // 8`` of the block, at bit
``4 * ((e % 8) // 4)``. Q8_0 codes are the 32 int8 as they are; Q6_K's too, with two scales;
Q5_K's are 32 bytes of 0-31, with Q4_1's d and m; Q2_K's 32 bytes of 0-3, with a d and m per 16; Q8Z's 32 bytes of 0-255, with a scale and zero point; F8's 32 float8 (e4m3fn) bytes, with one scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from duet.kernels.fused import greedy_argmax
from duet.kernels.gguf import BLOCK


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, rows, row_mask, block, num_blocks, QTYPE: tl.constexpr):
    """The 32 weights of ``block`` for each of ``rows``: fp32 ``[len(rows), 32]``."""
    e = tl.arange(0, 32)
    if QTYPE == 3:  # Q4_1
        byte = 4 * (e % 4) + 2 * (e // 16) + (e % 16) // 8
        shift = 4 * ((e % 8) // 4)
        offsets = (rows[:, None] * num_blocks + block) * 16 + byte[None, :]
        codes = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.int32)
        q = ((codes >> shift[None, :]) & 15).to(tl.float32)
        d = tl.load(scales_ptr + (rows * num_blocks + block) * 2, mask=row_mask, other=0.0)
        m = tl.load(scales_ptr + (rows * num_blocks + block) * 2 + 1, mask=row_mask, other=0.0)
        return q * d[:, None] + m[:, None]
    elif QTYPE == 13:  # Q5_K as kernels.gguf rewrites it: codes 0-31 a byte each, d and m
        offsets = (rows[:, None] * num_blocks + block) * 32 + e[None, :]
        q = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.float32)
        d = tl.load(scales_ptr + (rows * num_blocks + block) * 2, mask=row_mask, other=0.0)
        m = tl.load(scales_ptr + (rows * num_blocks + block) * 2 + 1, mask=row_mask, other=0.0)
        return q * d[:, None] + m[:, None]
    elif QTYPE == 10:  # Q2_K as kernels.gguf rewrites it: codes 0-3 a byte each, d and m per 16
        offsets = (rows[:, None] * num_blocks + block) * 32 + e[None, :]
        q = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.float32)
        half = (rows[:, None] * num_blocks + block) * 4 + 2 * (e[None, :] // 16)
        d = tl.load(scales_ptr + half, mask=row_mask[:, None], other=0.0)
        m = tl.load(scales_ptr + half + 1, mask=row_mask[:, None], other=0.0)
        return q * d + m
    elif QTYPE == 1001:  # Q8Z: codes 0-255 a byte each, a scale s and zero point z: (u - z) * s
        offsets = (rows[:, None] * num_blocks + block) * 32 + e[None, :]
        q = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.float32)
        d = tl.load(scales_ptr + (rows * num_blocks + block) * 2, mask=row_mask, other=0.0)
        z = tl.load(scales_ptr + (rows * num_blocks + block) * 2 + 1, mask=row_mask, other=0.0)
        return (q - z[:, None]) * d[:, None]
    elif QTYPE == 14:  # Q6_K as kernels.gguf rewrites it: int8 codes, a scale per 16
        offsets = (rows[:, None] * num_blocks + block) * 32 + e[None, :]
        q = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float32)
        half = (rows[:, None] * num_blocks + block) * 2 + e[None, :] // 16
        d = tl.load(scales_ptr + half, mask=row_mask[:, None], other=0.0)
        return q * d
    elif QTYPE == 1000:  # F8: float8 (e4m3fn) codes, a scale a block (kernels.gguf.float8_blocks)
        offsets = (rows[:, None] * num_blocks + block) * 32 + e[None, :]
        codes = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.int32)
        # read as the fp16 of the code's sign at bit 15 and other bits at 7-13 (2^-8 its value,
        # subnormals too), as the C++ kernels do: no float8 type, which older GPUs lack
        halves = (((codes & 0x7F) << 7) | ((codes & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        d = tl.load(scales_ptr + rows * num_blocks + block, mask=row_mask, other=0.0)
        return halves.to(tl.float32) * (d * 256.0)[:, None]
    else:
        offsets = (rows[:, None] * num_blocks + block) * 32 + e[None, :]
        q = tl.load(codes_ptr + offsets, mask=row_mask[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = tl.load(scales_ptr + rows * num_blocks + block, mask=row_mask, other=0.0)
        return q * d[:, None]


@triton.jit
def _matmul_kernel(x_ptr, codes_ptr, scales_ptr, out_ptr, N, num_blocks, stride_x, stride_out, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # of x
    rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    row_mask = rows < N
    acc = tl.zeros([BLOCK_N, 32], dtype=tl.float32)
    for block in range(0, num_blocks):
        x = tl.load(x_ptr + row * stride_x + block * 32 + tl.arange(0, 32)).to(tl.float32)
        acc += _dequant_tile(codes_ptr, scales_ptr, rows, row_mask, block, num_blocks, QTYPE) * x[None, :]
    tl.store(out_ptr + row * stride_out + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, N, num_blocks, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.program_id(1)
    row_mask = rows < N
    weights = _dequant_tile(codes_ptr, scales_ptr, rows, row_mask, block, num_blocks, QTYPE)
    offsets = rows[:, None] * (num_blocks * 32) + block * 32 + tl.arange(0, 32)[None, :]
    tl.store(out_ptr + offsets, weights, mask=row_mask[:, None])


def gguf_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qtype: int, block_n: int = 32) -> torch.Tensor:
    """``x @ W.T`` in fp32, returned in ``x``'s dtype; ``x`` is ``[M, in_features]``."""
    x = x.contiguous()
    N, num_blocks = codes.shape[0], x.shape[1] // BLOCK
    out = torch.empty(x.shape[0], N, dtype=torch.float32, device=x.device)
    _matmul_kernel[(x.shape[0], triton.cdiv(N, block_n))](
        x, codes, scales, out, N, num_blocks, x.stride(0), out.stride(0), QTYPE=qtype, BLOCK_N=block_n
    )
    return out.to(x.dtype)


def gguf_matmul_argmax(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qtype: int, excluded: torch.Tensor) -> torch.Tensor:
    """The products' greedy tokens (``kernels.fused.greedy_argmax``), from the full products."""
    return greedy_argmax(gguf_matmul(x, codes, scales, qtype).float(), excluded)


def gguf_dequantize(codes: torch.Tensor, scales: torch.Tensor, qtype: int, in_features: int, block_n: int = 32) -> torch.Tensor:
    """The fp32 weight ``[out_features, in_features]`` the products use."""
    N, num_blocks = codes.shape[0], in_features // BLOCK
    out = torch.empty(N, in_features, dtype=torch.float32, device=codes.device)
    _dequantize_kernel[(triton.cdiv(N, block_n), num_blocks)](codes, scales, out, N, num_blocks, QTYPE=qtype, BLOCK_N=block_n)
    return out
