"""KV cache rows of one byte a value — int8 or fp8 (e4m3) codes — with a one-byte scale per
token and head, stored in a Hadamard basis.

A quantized cache holds, for each token and KV head, ``head_dim`` codes followed by one byte,
the row's scale (``decode_scales``), the row being ``codes * scale``. The cache tensor's
dtype says which codes it holds (``torch.int8`` or ``torch.float8_e4m3fn``) and its last
dimension is ``head_dim + 1``.

Why a Hadamard basis: a key row's few outlier channels (RoPE's slow pairs carry most of its
magnitude) set the row's scale, and the rest then keeps a few of the code's bits. The row is
stored as ``x @ H``, ``H`` the Sylvester Hadamard matrix of ±1 (block-diagonal in blocks of
``head_dim``'s largest power-of-two divisor), which spreads an outlier over every channel; a
query enters this basis and an attention output leaves it by the same product ``x @ H / b``
(``rotate``; ``H @ H = b * I``, so scores and outputs are the model's). On SmolLM2's own text
the int8 cache's KL divergence from fp32 falls from 1.3e-3 to 3.7e-4. The transform is a
butterfly of adds and subtractions in fp32, in the same order in every implementation, so the
C++ write and the torch write store the same bytes; the attention kernels never see it.

Why a scale per token and head: a row is written once, when its token is computed, so its scale
is known then and never revisited. A scale per block would have to be fixed before the block's
later tokens exist (a calibrated constant, as vLLM's ``k_scale``) or its rows requantized as
they arrive. Why one byte: the row costs ``head_dim + 1`` bytes (65 against 256 in fp32 for
SmolLM2's 64: 3.94x the blocks; an fp32 scale would give 68 bytes, 3.76x). The byte holds 6
bits of exponent and 2 of mantissa: the row's largest magnitude over ``MAX_CODE`` (127 for
int8, e4m3's 448), rounded up on the float's bits, so the largest code lands within 20% of the
limit (a power of two left it anywhere in the top half: on SmolLM2's text the int8 cache's KL
divergence from fp32 falls from 3.7e-4 to 2.3e-4 by it). Every step is integer arithmetic on
float bits, one product by a constant, or one IEEE reciprocal, so the C++ and torch writes
store the same bytes; codes times scale are exact in fp32, so the C++, torch and Triton readers
see the same values (a bf16 reader then rounds them as any bf16).
"""

from __future__ import annotations

import torch

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# The code a row's largest magnitude maps to (at most: the scale is rounded up).
MAX_CODE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_PER_CODE = {dtype: 1.0 / code for dtype, code in MAX_CODE.items()}  # taken as fp32 by an fp32 product, as in C++
# The scale byte: 6 bits of exponent (2**-32 to 2**31) and 2 of mantissa.
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -32, 31
_MANTISSA_DROPPED = 21  # of fp32's 23 mantissa bits


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED_DTYPES


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements a token's row of one head takes in a cache of ``cache_dtype``."""
    return head_dim + 1 if cache_dtype in QUANTIZED_DTYPES else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The model's head_dim, from a cache ``[..., row_width]``."""
    return cache.shape[-1] - 1 if is_quantized(cache) else cache.shape[-1]


def hadamard_block(head_dim: int) -> int:
    """The transform's block: ``head_dim``'s largest power-of-two divisor (64 for 64, 32 for 96)."""
    return head_dim & -head_dim


def hadamard_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows @ H`` in fp32 by butterflies (stage h: ``(a + c, a - c)`` for elements h apart), in
    the order of the C++ write (``cpu_ops.cpp``), so both round alike."""
    rows = rows.float()
    lead, width = rows.shape[:-1], rows.shape[-1]
    half = 1
    while half < hadamard_block(width):
        pairs = rows.reshape(*lead, width // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        rows = torch.stack((first + second, first - second), dim=-2).reshape(*lead, width)
        half *= 2
    return rows


_ROTATIONS: dict[tuple, torch.Tensor] = {}


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H / b`` over the last dimension: a query into the cache's basis, or an attention
    output computed there back into the model's (``H`` is symmetric and ``H @ H = b * I``)."""
    return torch.matmul(x, rotation(x.shape[-1], x.dtype, x.device))


def rotation(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``H / b`` for rows of ``width``: the matrix ``rotate`` multiplies by (built once)."""
    key = (width, dtype, torch.device(device))
    matrix = _ROTATIONS.get(key)
    if matrix is None:
        eye = torch.eye(width)
        matrix = _ROTATIONS[key] = (hadamard_rows(eye) / hadamard_block(width)).to(dtype).to(device)  # ±2**-k: exact
    return matrix


def row_scales(rows: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's scale (``[..., 1]`` fp32) and its byte (int8): the largest magnitude over
    ``MAX_CODE``, rounded up to 3 significant bits on the float's bits."""
    target = rows.abs().amax(dim=-1, keepdim=True) * _PER_CODE[cache_dtype]  # an fp32 product: no division to differ
    low = (1 << _MANTISSA_DROPPED) - 1
    bits = (target.view(torch.int32) + low) & ~low  # round up (a carry moves to the exponent)
    exponents = ((bits >> 23) & 0xFF) - 127
    mantissas = (bits >> _MANTISSA_DROPPED) & 3
    mantissas = torch.where(exponents < MIN_SCALE_EXPONENT, 0, torch.where(exponents > MAX_SCALE_EXPONENT, 3, mantissas))
    exponents = exponents.clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
    scale_bytes = ((exponents - MIN_SCALE_EXPONENT) << 2) | mantissas
    return decode_scales(scale_bytes), scale_bytes.to(torch.uint8).view(torch.int8)


def decode_scales(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Scale bytes (any integer dtype) as fp32: ``2**E * (1 + m / 4)``, built from its bits."""
    byte = scale_bytes.to(torch.int32) & 0xFF
    return ((((byte >> 2) + MIN_SCALE_EXPONENT + 127) << 23) | ((byte & 3) << _MANTISSA_DROPPED)).view(torch.float32)


def quantize_rows(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim]`` floats as ``[..., head_dim + 1]`` of ``cache_dtype``: the codes of
    ``rows @ H``, then the scale's byte."""
    rows = hadamard_rows(rows)
    scales, scale_bytes = row_scales(rows, cache_dtype)
    limit = MAX_CODE[cache_dtype]
    scaled = (rows * scales.reciprocal()).clamp_(-limit, limit)  # as the C++ write: by the rounded reciprocal
    if cache_dtype == torch.int8:
        codes = scaled.round_().to(torch.int8)  # round half to even
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.int8)
    return torch.cat([codes, scale_bytes], dim=-1).view(cache_dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + 1]`` quantized rows as ``[..., head_dim]`` of ``dtype``: their values
    (exact in fp32), in the cache's basis (``rotate`` takes them back to the model's)."""
    codes = rows[..., :-1].float()  # int8 and e4m3 values are exact in fp32
    return (codes * decode_scales(rows[..., -1:].view(torch.int8))).to(dtype)


def cache_bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 when its dtype has few kernels (fp8: no ``index_copy_`` on CPU, no
    gloo transport); other caches as they are. Moving blocks never needs their values."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
