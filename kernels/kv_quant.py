"""KV cache rows of one byte a value — int8 or fp8 (e4m3) codes — with a power-of-two scale per
token and head.

A quantized cache holds, for each token and KV head, ``head_dim`` codes followed by one byte:
the exponent ``e`` (int8) of the row's scale, the row being ``codes * 2**e``. The cache tensor's
dtype says which codes it holds (``torch.int8`` or ``torch.float8_e4m3fn``) and its last
dimension is ``head_dim + 1``.

Why a scale per token and head: a row is written once, when its token is computed, so its scale
is known then and never revisited. A scale per block would have to be fixed before the block's
later tokens exist (a calibrated constant, as vLLM's ``k_scale``) or its rows requantized as
they arrive. Why a power of two in one byte: the row costs ``head_dim + 1`` bytes (65 against
256 in fp32 for SmolLM2's 64: 3.94x the blocks; an fp32 scale would give 68 bytes, 3.76x), and
multiplying by ``2**e`` is exact in every float format, so the C++, torch and Triton kernels
dequantize to the very same values. The exponent is the row's largest magnitude's, less the
code's headroom (``_HEADROOM``): integer arithmetic on the float's bits, the same in every
implementation, no division.
"""

from __future__ import annotations

import torch

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# Bits below the largest magnitude's exponent: int8 rows land in [64, 128) (127 at most after
# rounding), fp8 rows in [128, 256), under e4m3's 448 with its full precision.
_HEADROOM = {torch.int8: 7, torch.float8_e4m3fn: 8}
MIN_EXPONENT, MAX_EXPONENT = -126, 126  # 2**e and 2**-e stay normal fp32 numbers


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED_DTYPES


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements a token's row of one head takes in a cache of ``cache_dtype``."""
    return head_dim + 1 if cache_dtype in QUANTIZED_DTYPES else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The model's head_dim, from a cache ``[..., row_width]``."""
    return cache.shape[-1] - 1 if is_quantized(cache) else cache.shape[-1]


def _row_exponents(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Each row's scale exponent, ``[..., 1]`` int32: from the largest magnitude's float bits."""
    amax = rows.float().abs().amax(dim=-1, keepdim=True)
    biased = (amax.view(torch.int32) >> 23) & 0xFF  # zero and subnormals give the floor below
    return (biased - 126 - _HEADROOM[cache_dtype]).clamp_(MIN_EXPONENT, MAX_EXPONENT)


def quantize_rows(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim]`` floats as ``[..., head_dim + 1]`` of ``cache_dtype``: codes, then the exponent."""
    exponents = _row_exponents(rows, cache_dtype)
    scaled = rows.float() * power_of_two(-exponents)  # exact
    if cache_dtype == torch.int8:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)  # round half to even
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.int8)
    return torch.cat([codes, exponents.to(torch.int8)], dim=-1).view(cache_dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + 1]`` quantized rows as ``[..., head_dim]`` of ``dtype`` (exactly their values)."""
    codes = rows[..., :-1].float()  # int8 and e4m3 values are exact in fp32 (and in bf16)
    exponents = rows[..., -1:].view(torch.int8).to(torch.int32)
    return (codes * power_of_two(exponents)).to(dtype)


def power_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponents`` in fp32, built from its bits (exact; ``torch.pow`` need not be)."""
    return ((exponents.to(torch.int32) + 127) << 23).view(torch.float32)


def cache_bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 when its dtype has few kernels (fp8: no ``index_copy_`` on CPU, no
    gloo transport); other caches as they are. Moving blocks never needs their values."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
