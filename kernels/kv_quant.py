"""KV cache rows of one byte a value — int8 or fp8 (e4m3) codes — with a power-of-two scale per
token and head, stored in a Hadamard basis.

A quantized cache holds, for each token and KV head, ``head_dim`` codes followed by one byte:
the exponent ``e`` (int8) of the row's scale, the row being ``codes * 2**e``. The cache tensor's
dtype says which codes it holds (``torch.int8`` or ``torch.float8_e4m3fn``) and its last
dimension is ``head_dim + 1``.

Why a Hadamard basis: a key row's few outlier channels (RoPE's slow pairs carry most of its
magnitude) set the row's scale, and the rest then keeps a few of the code's bits. The row is
stored as ``x @ H``, ``H`` the Sylvester Hadamard matrix of ±1 (block-diagonal in blocks of
``head_dim``'s largest power-of-two divisor), which spreads an outlier over every channel; a
query enters this basis and an attention output leaves it by the same product ``x @ H / b``
(``rotate``; ``H @ H = b * I``, so scores and outputs are the model's). On SmolLM2's own text
the int8 cache's KL divergence from fp32 falls from 1.3e-3 to 3.8e-4. The transform is a
butterfly of adds and subtractions in fp32, in the same order in every implementation, so the
C++ write and the torch write store the same bytes; the attention kernels never see it.

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
    key = (x.shape[-1], x.dtype, x.device)
    if key not in _ROTATIONS:
        eye = torch.eye(x.shape[-1])
        _ROTATIONS[key] = (hadamard_rows(eye) / hadamard_block(x.shape[-1])).to(x.dtype).to(x.device)  # ±2**-k: exact
    return torch.matmul(x, _ROTATIONS[key])


def _row_exponents(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Each row's scale exponent, ``[..., 1]`` int32: from the largest magnitude's float bits."""
    amax = rows.float().abs().amax(dim=-1, keepdim=True)
    biased = (amax.view(torch.int32) >> 23) & 0xFF  # zero and subnormals give the floor below
    return (biased - 126 - _HEADROOM[cache_dtype]).clamp_(MIN_EXPONENT, MAX_EXPONENT)


def quantize_rows(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim]`` floats as ``[..., head_dim + 1]`` of ``cache_dtype``: the codes of
    ``rows @ H``, then the exponent."""
    rows = hadamard_rows(rows)
    exponents = _row_exponents(rows, cache_dtype)
    scaled = rows * power_of_two(-exponents)  # exact
    if cache_dtype == torch.int8:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)  # round half to even
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.int8)
    return torch.cat([codes, exponents.to(torch.int8)], dim=-1).view(cache_dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + 1]`` quantized rows as ``[..., head_dim]`` of ``dtype``: exactly their
    values, in the cache's basis (``rotate`` takes them back to the model's)."""
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
