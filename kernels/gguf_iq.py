"""GGUF's 1- to 3-bit i-quants kept as the kernels' int8 blocks rather than dequantized to floats.

Each of these super-blocks of 256 weights gives every weight as a scale of its sub-block times a
small integer: a value of the type's fixed grid (llama.cpp's ``iq2xxs_grid`` and the rest, as
gguf-py packs them) with its sign, or for IQ1_S a grid value of -1, 0 or 1 plus a shift of
``±1/8``. gguf's own dequantization computes ``db * grid * sign`` (IQ1_S: ``dl * (grid + delta)``)
in fp32, where ``db`` is exact (fp16 ``d`` times a 3- or 4-bit integer and a power of two). The
kernels' blocks hold exactly that: int8 codes ``grid * sign`` (IQ1_S: ``8 (grid + delta)``, with
the scale ``dl / 8``, exact) beside the fp32 scales, and compute ``scale * code`` rounded once:
the same floats, bit for bit (negating is exact, and ``dl / 8 * 8 (g + d)`` is the same real
number as ``dl (g + d)``).

- IQ2_XXS, IQ3_XXS, IQ3_S and IQ1_S scale 32 weights at a time: Q8_0 blocks (1.125 bytes a
  weight, against 4 for fp32 and 0.21-0.43 in the file).
- IQ2_XS and IQ2_S scale 16 at a time: the kernels' Q6_K blocks (32 int8 codes, the fp32 scales
  of their two halves: 1.25 bytes a weight).

IQ1_M is not among them: gguf-py, through which transformers reads it, applies its shift with
the opposite sign to llama.cpp's, so there is no one exact reference to keep.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import torch

IQ2_XXS = 16  # GGML's type ids
IQ2_XS = 17
IQ3_XXS = 18
IQ1_S = 19
IQ3_S = 21
IQ2_S = 22
SUPER_BLOCK = 256
# Bytes a super-block, and the weights each scale covers (32: Q8_0 blocks; 16: the kernels' Q6_K blocks).
LAYOUTS = {IQ2_XXS: (66, 32), IQ2_XS: (74, 16), IQ3_XXS: (98, 32), IQ1_S: (50, 32), IQ3_S: (110, 32), IQ2_S: (82, 16)}
TYPES = frozenset(LAYOUTS)
_QUANTS = {
    IQ2_XXS: gguf.quants.IQ2_XXS, IQ2_XS: gguf.quants.IQ2_XS, IQ3_XXS: gguf.quants.IQ3_XXS, IQ1_S: gguf.quants.IQ1_S,
    IQ3_S: gguf.quants.IQ3_S, IQ2_S: gguf.quants.IQ2_S,
}


@functools.cache
def _grid(qtype: int) -> np.ndarray:
    """The type's grid as gguf-py unpacks it: ``[entries, values]`` of small integers (as fp32)."""
    quant = _QUANTS[qtype]
    quant.init_grid()
    return np.asarray(quant.grid).reshape(quant.grid_shape)


def _bits(values: np.ndarray, count: int) -> np.ndarray:
    """Bits 0..count-1 of each value, along a new last axis."""
    return (values[..., None] >> np.arange(count, dtype=values.dtype)) & 1


def _signs_from_ksigns(indices: np.ndarray) -> np.ndarray:
    """7-bit indices into IQ2_XXS's ``ksigns`` (shared by IQ2_XS and IQ3_XXS) as eight signs, ±1."""
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    return np.where(_bits(ksigns[indices], 8) == 0, 1, -1)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes of two 4-bit values (low first) as those values."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32)


def codes_and_scales(blocks: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """Super-blocks ``[n, bytes]`` of ``qtype`` as int8 codes ``[n, 256]`` and fp32 scales
    ``[n, 256 / LAYOUTS[qtype][1]]``: weight ``i`` is ``scales[i // per_scale] * codes[i]``."""
    n = blocks.shape[0]
    grid = _grid(qtype)
    d = blocks[:, :2].view(np.float16).astype(np.float32)  # every one of these types starts with it
    if qtype == IQ1_S:
        qs, qh = blocks[:, 2:34], blocks[:, 34:50].view(np.uint16)
        dl = d * (2 * ((qh >> 12) & 7) + 1)  # [n, 8]
        shift = np.where((qh & 0x8000) == 0, 1, -1)  # 8 * delta
        index = qs.astype(np.uint16).reshape(n, 8, 4) | (((qh[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7) << 8)
        codes = 8 * grid[index].reshape(n, 8, 32) + shift[..., None]
        return codes.reshape(n, SUPER_BLOCK).astype(np.int8), dl / 8
    if qtype in (IQ2_XXS, IQ3_XXS):  # 32 grid bytes (or 64 for IQ3_XXS), then a word per 32 weights: 4 sign indices, a 4-bit scale
        words = blocks[:, 2:].view(np.uint32).reshape(n, 8, 2)[..., 1] if qtype == IQ2_XXS else blocks[:, 66:98].view(np.uint32)
        index = blocks[:, 2:].view(np.uint32).reshape(n, 8, 2)[..., 0].copy().view(np.uint8) if qtype == IQ2_XXS else blocks[:, 2:66]
        db = d * (np.float32(0.5) + (words >> 28).astype(np.float32)) * np.float32(0.25 if qtype == IQ2_XXS else 0.5)
        signs = _signs_from_ksigns(((words[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F).astype(np.uint8))
        values = grid[index.reshape(n, -1)].reshape(n, 8, 4, 8)
        return (values * signs.reshape(n, 8, 4, 8)).reshape(n, SUPER_BLOCK).astype(np.int8), db
    if qtype == IQ2_XS:  # a 16-bit word per 8 weights: a 9-bit grid index, a 7-bit sign index; 4-bit scales per 16
        qs = blocks[:, 2:66].view(np.uint16)
        db = d * (np.float32(0.5) + _nibbles(blocks[:, 66:74])) * np.float32(0.25)
        values = grid[qs & 511] * _signs_from_ksigns((qs >> 9).astype(np.uint8))
        return values.reshape(n, SUPER_BLOCK).astype(np.int8), db
    if qtype == IQ2_S:  # 8-bit grid indices with 2 high bits apart, a sign bit a weight; 4-bit scales per 16
        qs, sign_bytes, qh = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74]
        db = d * (np.float32(0.5) + _nibbles(blocks[:, 74:82])) * np.float32(0.25)
        index = qs.astype(np.uint16) | ((((qh[..., None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).astype(np.uint16) << 8).reshape(n, 32))
        values = grid[index] * np.where(_bits(sign_bytes, 8) == 0, 1, -1)
        return values.reshape(n, SUPER_BLOCK).astype(np.int8), db
    if qtype == IQ3_S:  # 8-bit grid indices with a high bit apart, a sign bit a weight; 4-bit scales per 32
        qs, qh, sign_bytes = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106]
        db = d * (1 + 2 * _nibbles(blocks[:, 106:110]))
        index = qs.astype(np.uint16) | (_bits(qh, 8).astype(np.uint16).reshape(n, 64) << 8)
        values = grid[index].reshape(n, SUPER_BLOCK) * np.where(_bits(sign_bytes, 8) == 0, 1, -1).reshape(n, SUPER_BLOCK)
        return values.astype(np.int8), db
    raise ValueError(f"GGUF type {qtype} is not an i-quant kept as blocks ({sorted(TYPES)})")


def from_iq(rows: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-blocks ``[out, n, bytes]`` as the kernels' blocks: int8 codes viewed as bytes
    ``[out, 256 n]`` and fp32 scales ``[out, 256 n / per_scale]``."""
    out, n = rows.shape[:2]
    codes, scales = codes_and_scales(rows.reshape(out * n, -1).cpu().numpy(), qtype)
    codes = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.uint8).reshape(out, -1).to(rows.device)
    return codes, torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).reshape(out, -1).to(rows.device)
