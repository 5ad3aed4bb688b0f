"""Weights kept as a GGUF file's quantized blocks, and products computed from them.

A GGUF tensor of type Q4_1 or Q8_0 is rows of 32-weight blocks: an fp16 scale ``d`` (and for
Q4_1 a min ``m``) followed by the codes (16 bytes of nibbles, or 32 int8). ``GGUFWeight`` keeps
the codes (Q4_1's nibbles reordered within their block, ``q4_1_words``, so that vectors
unpack them by shifts alone) and the scales widened to fp32 (exact: every fp16 is an fp32),
beside them rather than between them, so that a step never converts a scale. The kernels —
C++ on CPU (``csrc/gguf_ops.cpp``), Triton on a GPU (``triton_gguf.py``) — dequantize each
block in registers, to the very floats gguf's own dequantizer gives, and multiply in fp32.

A Q4_0 block (fp16 ``d``, codes ``q``: ``d * (q - 8)``) becomes a Q4_1 block with min ``-8 d``,
exact, its codes as they are. Q5_0 and Q5_1 blocks (a fifth bit per code in 4 bytes before the
nibbles) become the kernels' Q5_K blocks below, their codes a byte each: Q5_1's ``d`` and ``m``
as they are, Q5_0's ``d * (q - 16)`` with min ``-16 d`` (exact, as Q4_0's; ``d * q`` of an
fp16 and a 5-bit code is exact in fp32, so the kernels' fma rounds where gguf's sum does).

K-quants come in super-blocks of 256 weights whose 32- or 16-weight sub-blocks have integer
scales of a super-block scale; ``from_blocks`` rewrites them into the kernels' 32-weight blocks,
exactly: a Q4_K sub-block's ``d * sc`` and ``dmin * m`` are
fp16 times 6-bit integers, exact in fp32, so it becomes a Q4_1 block (codes, scale ``d * sc``,
min ``-dmin * m``: gguf's ``d * sc * q - dmin * m`` rounds once, as the kernels' fma does); a
Q5_K block the same with its 5-bit codes a byte each (``Q5_K``'s layout in the kernels); a
Q6_K block of 32 keeps its codes less 32 as int8 and the fp32 scales ``d * sc`` of its two
halves (``Q6_K``'s layout in the kernels: fp16 times int8 times a 6-bit code is exact in fp32),
and a Q3_K block the same with its codes less 4 and the scales ``d * (sc - 32)``. A Q2_K
block of 32 (``Q2_K``'s layout in the kernels) keeps its 2-bit codes a byte each and the scale
and min of each half, ``d * sc`` and ``-dmin * m`` (fp16 times 4-bit integers: exact), its weights
one fma each, rounded once as gguf's ``d * sc * q - dmin * m``. The codes stay 2- to 6-bit
values; only their container widens (Q4_K: 0.75 byte a weight against 0.5625 in the file; Q5_K:
1.25 against 0.6875; Q6_K: 1.25 against 0.82; Q3_K: 1.25 against 0.43; Q2_K: 1.5 against 0.33).

The non-linear 4-bit types map each 4-bit index through a fixed table of sixteen int8 values
(``IQ4_VALUES``): an IQ4_NL block of 32 (fp16 ``d``, 16 bytes of indices: weight j low, 16 + j
high) is ``d * v``, and an IQ4_XS super-block's 32-weight sub-blocks ``d * (ls - 32) * v`` (6-bit
``ls``, low nibbles in 4 bytes and high pairs in a 16-bit word, before the indices). Each becomes
a Q8_0 block of the looked-up values with scale ``d`` or ``d * (ls - 32)`` (fp16 times a 6-bit
integer: exact), rounded once as gguf's own products are (1.125 bytes a weight against 0.5625
and 0.53). The 1- to 3-bit i-quants become Q8_0 or Q6_K blocks of their grids' signed values
(``gguf_iq``).
"""

from __future__ import annotations

import dataclasses

import gguf
import torch

from duet.kernels import gguf_iq

Q2_K = 10  # GGML's type ids
Q4_0 = 2
Q4_1 = 3
Q5_0 = 6
Q5_1 = 7
Q8_0 = 8
Q3_K = 11
Q4_K = 12
Q5_K = 13
Q6_K = 14
IQ4_NL = 20
IQ4_XS = 23
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl
_LAYOUTS = {Q4_0: (1, 16), Q4_1: (2, 16), Q5_0: (1, 20), Q5_1: (2, 20), Q8_0: (1, 32), IQ4_NL: (1, 16)}  # per block: fp16 scales (d[, m]), code bytes
# Not GGML types: float8 (e4m3fn) weights with a scale a block (compressed-tensors' FP8: ``float8_blocks``),
# and 8-bit codes with a scale and a zero point a block (compressed-tensors' asymmetric 8 bits: ``zero_point_blocks``).
# And a checkpoint's bf16 weights as they are, for a model computing in fp32 (``bf16_blocks``).
F8 = 1000
Q8Z = 1001
BF16 = 1002
_KERNEL_LAYOUTS = {Q4_1: (2, 16), Q8_0: (1, 32), Q5_K: (2, 32), Q6_K: (2, 32), F8: (1, 32), Q2_K: (4, 32), Q8Z: (2, 32), BF16: (0, 64)}  # per block in the kernels: fp32 scales, code bytes
# What the kernels read (most rewritten at load; the 1- to 3-bit i-quants in ``gguf_iq``).
TYPES = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS}) | gguf_iq.TYPES
BLOCK = 32
PANEL_WIDTH = 32  # output features a panel of the AVX-512 kernels holds (``lay_out_panels``)
SUPER_BLOCK = 256  # weights of a K-quant super-block
# weights and bytes of a super-block
_K_LAYOUTS = {
    Q2_K: (SUPER_BLOCK, 84), Q3_K: (SUPER_BLOCK, 110), Q4_K: (SUPER_BLOCK, 144), Q5_K: (SUPER_BLOCK, 176), Q6_K: (SUPER_BLOCK, 210),
    IQ4_XS: (SUPER_BLOCK, 136),
} | {qtype: (SUPER_BLOCK, size) for qtype, (size, _) in gguf_iq.LAYOUTS.items()}


def _iq4_values(indices: torch.Tensor) -> torch.Tensor:
    """Bytes of two 4-bit indices each, ``[..., 16]`` (weight j low, 16 + j high), as the 32
    int8 values they look up, viewed as bytes ``[..., 32]``."""
    table = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=indices.device)
    both = torch.cat([indices & 0x0F, indices >> 4], dim=-1).long()
    return table[both].view(torch.uint8)


def _from_iq4_xs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS super-blocks ``[out, n, 136]`` (fp16 d, a 16-bit word of the scales' high pairs, 4
    bytes of their low nibbles, 128 bytes of indices) as 8n Q8_0 blocks: the 32 looked-up values
    and the scale ``d * (ls - 32)`` (exact)."""
    out, n = rows.shape[:2]
    device = rows.device
    d = rows[..., 0:2].contiguous().view(torch.float16).float()
    high = rows[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    high = (high >> (2 * torch.arange(8, dtype=torch.int32, device=device))) & 0x03  # [out, n, 8]
    low = (rows[..., 4:8].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8, device=device)) & 0x0F  # [out, n, 4, 2]
    ls = (low.reshape(out, n, 8).to(torch.int32) | (high << 4)) - 32
    codes = _iq4_values(rows[..., 8:136].reshape(out, n, 8, 16))
    return codes.reshape(out, -1).contiguous(), (d * ls.float()).reshape(out, -1).contiguous()


def q4_1_words(codes: torch.Tensor) -> torch.Tensor:
    """A Q4_1 block's 16 code bytes (byte j: weight j's code low, weight 16 + j's high) as four
    32-bit words D0..D3 holding weight 4L + k's code at bits 4L of Dk and weight 16 + 4L + k's
    at bits 16 + 4L: each 32-bit lane of a vector then finds its weight's code by a shift."""
    low = (codes & 0x0F).to(torch.int32).unflatten(-1, (4, 4))  # [..., L, k]: weight 4L + k
    high = (codes >> 4).to(torch.int32).unflatten(-1, (4, 4))  # weight 16 + 4L + k
    shifts = (4 * torch.arange(4, dtype=torch.int32, device=codes.device)).view(4, 1)
    words = ((low << shifts) | (high << (shifts + 16))).sum(dim=-2, dtype=torch.int32)  # disjoint bits: sum = or
    return words.view(torch.uint8)


def _k_scales_and_low_codes(rows: torch.Tensor, codes_at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of Q4_K or Q5_K super-blocks ``[out, n, bytes]`` (fp16 d and dmin, 12 bytes of 6-bit
    scales and mins, ..., 128 bytes of nibbles from ``codes_at``): the fp32 scales of their 8n
    blocks (``d * sc``, ``-dmin * m``: both exact) and the blocks' 4-bit codes, ``[out, 8n, 32]``."""
    out, n = rows.shape[:2]
    d = rows[..., 0:2].contiguous().view(torch.float16).float()
    dmin = rows[..., 2:4].contiguous().view(torch.float16).float()
    sc, mins = (  # the 6-bit scales and mins, unpacked by gguf itself
        torch.from_numpy(part).to(rows.device).view(out, n, 8).float()
        for part in gguf.quants.Q4_K.get_scale_min(rows[..., 4:16].reshape(-1, 12).cpu().numpy())
    )
    scales = torch.stack([d * sc, -(dmin * mins)], dim=-1).reshape(out, -1).contiguous()  # [out, n, 8, 2]
    nibbles = rows[..., codes_at : codes_at + 128].reshape(out, n, 4, 1, 32)
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3).reshape(out, n * 8, 32)  # sub-block 2i low, 2i + 1 high
    return scales, codes


def _from_q4_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks ``[out, n, 144]`` (fp16 d and dmin, 12 bytes of 6-bit scales and mins,
    128 of nibbles) as Q4_1 codes and fp32 scales (``d * sc``, ``-dmin * m``) of 8n blocks."""
    scales, codes = _k_scales_and_low_codes(rows, 16)
    q4_1_bytes = codes[..., :16] | (codes[..., 16:] << 4)  # Q4_1's own byte order: weight j low, 16 + j high
    return q4_1_words(q4_1_bytes).reshape(rows.shape[0], -1).contiguous(), scales


def _from_q5_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K super-blocks ``[out, n, 176]`` (as Q4_K's, with 32 bytes of fifth bits before the
    nibbles: block j's is bit j of each) as 8n blocks of 32 codes (0-31, a byte each) and fp32
    scales (``d * sc``, ``-dmin * m``)."""
    out, n = rows.shape[:2]
    scales, low = _k_scales_and_low_codes(rows, 48)
    bits = torch.arange(8, dtype=torch.uint8, device=rows.device).view(1, 1, 8, 1)
    high = (rows[..., 16:48].reshape(out, n, 1, 32) >> bits) & 0x01  # [out, n, 8 blocks, 32]
    codes = low | (high.reshape(out, n * 8, 32) << 4)
    return codes.reshape(out, -1).contiguous(), scales


def _five_bit_codes(codes: torch.Tensor) -> torch.Tensor:
    """Q5_0 or Q5_1 blocks' code bytes ``[..., 20]`` (a little-endian 32-bit word whose bit j is
    weight j's fifth bit, then Q4_1's nibbles: byte j holds weight j low, 16 + j high) as their 32
    codes, 0-31 a byte each."""
    high_word = codes[..., :4].contiguous().view(torch.int32)  # [..., 1]
    bits = torch.arange(32, dtype=torch.int32, device=codes.device)
    high = ((high_word >> bits) & 1).to(torch.uint8)
    nibbles = codes[..., 4:]
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1) | (high << 4)


def _from_q6_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks ``[out, n, 210]`` (128 bytes of low nibbles, 64 of high 2-bit pairs, 16
    int8 scales, fp16 d) as 8n blocks of 32 int8 codes (less 32) and the fp32 scales
    ``d * sc`` of their two halves."""
    out, n = rows.shape[:2]
    shifts_low = torch.tensor([0, 4], dtype=torch.uint8, device=rows.device).view(1, 1, 1, 2, 1)
    shifts_high = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=rows.device).view(1, 1, 1, 4, 1)
    low = (rows[..., :128].reshape(out, n, 2, 1, 64) >> shifts_low) & 0x0F
    high = (rows[..., 128:192].reshape(out, n, 2, 1, 32) >> shifts_high) & 0x03
    codes = (low.reshape(out, n, 8, 32) | (high.reshape(out, n, 8, 32) << 4)).to(torch.int8) - 32
    d = rows[..., 208:210].contiguous().view(torch.float16).float()
    scales = d * rows[..., 192:208].contiguous().view(torch.int8).float()  # [out, n, 16]: exact
    return codes.view(torch.uint8).reshape(out, -1).contiguous(), scales.reshape(out, -1).contiguous()


def _from_q3_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K super-blocks ``[out, n, 110]`` (32 bytes of third bits, inverted: bit j of byte i is
    weight 32j + i's; 64 bytes of 2-bit pairs; 12 bytes of sixteen 6-bit scales; fp16 d) as
    Q6_K's kernel blocks: 8n blocks of 32 int8 codes (-4 to 3) and the fp32 scales
    ``d * (sc - 32)`` of their two halves (exact)."""
    out, n = rows.shape[:2]
    device = rows.device
    packed = rows[..., 96:108]
    low = (packed[..., :8].reshape(out, n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8, device=device).view(1, 1, 2, 1)) & 0x0F
    high = (packed[..., 8:].reshape(out, n, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device).view(1, 1, 4, 1)) & 0x03
    sc = (low.reshape(out, n, 16) | (high.reshape(out, n, 16) << 4)).float() - 32.0
    d = rows[..., 108:110].contiguous().view(torch.float16).float()
    pairs = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device).view(1, 1, 1, 4, 1)
    low_bits = (rows[..., 32:96].reshape(out, n, 2, 1, 32) >> pairs) & 0x03  # [out, n, half, pair, 32]
    third = (rows[..., :32].reshape(out, n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=device).view(1, 1, 8, 1)) & 0x01
    codes = low_bits.reshape(out, n, 256).to(torch.int8) - ((third.reshape(out, n, 256) ^ 1) << 2).to(torch.int8)
    return codes.view(torch.uint8).reshape(out, -1).contiguous(), (d * sc).reshape(out, -1).contiguous()


def float8_blocks(weight: torch.Tensor, scales: torch.Tensor, ops) -> GGUFWeight:
    """Float8 (e4m3fn) weights ``[out, in]`` and their fp32 scales, one per 32-weight block
    ``[out, in / 32]``, as the kernels' F8 blocks: the codes' bytes as they are, beside the scales.
    The kernels' weight is ``w.float() * s`` rounded once (``csrc/gguf_blocks.h``), compressed-tensors'
    own dequantization; a byte a weight plus 4 a block (1.125), against 4 (fp32) or 2 (bf16)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.float8_e4m3fn or in_features % BLOCK or scales.shape != (out_features, in_features // BLOCK):
        raise ValueError(f"float8 blocks take e4m3fn weights [out, in] (in a multiple of {BLOCK}) and a scale a block, not {weight.dtype} "
                         f"{tuple(weight.shape)} with scales {tuple(scales.shape)}")
    return GGUFWeight(weight.contiguous().view(torch.uint8), scales.float().contiguous(), F8, in_features, ops)


def bf16_blocks(weight: torch.Tensor, ops) -> GGUFWeight:
    """A checkpoint's bf16 weight ``[out, in]`` (in a multiple of 32) as the kernels' BF16 blocks,
    for a model that computes in fp32: its bytes, paired (below), no scale. The kernels widen each
    weight to fp32 exactly (a bf16 is the upper half of its fp32: each 16 weights are paired so
    that a shift or a mask widens 8 at a time, ``csrc/gguf_blocks.h``), so the products are those
    of ``weight.float()``, from 2 bytes a weight instead of 4."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or in_features % BLOCK:
        raise ValueError(f"bf16 blocks take bf16 weights [out, in] (in a multiple of {BLOCK}), not {weight.dtype} {tuple(weight.shape)}")
    # Each 16 weights paired as the kernels read them: 32-bit word j holds weight j (low half) and 8 + j (high).
    pairs = weight.contiguous().view(torch.int16).reshape(out_features, in_features // 16, 2, 8).transpose(2, 3)
    codes = pairs.contiguous().view(torch.uint8).reshape(out_features, 2 * in_features)
    return GGUFWeight(codes, torch.empty(out_features, 0, dtype=torch.float32, device=weight.device), BF16, in_features, ops)


def _from_q2_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K super-blocks ``[out, n, 84]`` (16 bytes of 4-bit scales, low, and mins, high; 64 bytes
    of 2-bit codes: weight 128h + 32j + i at bits 2j of byte 32h + i; fp16 d and dmin) as 8n
    blocks of 32 codes (0-3, a byte each) and the fp32 scale and min of each half, ``d * sc``
    and ``-dmin * m`` (exact)."""
    out, n = rows.shape[:2]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=rows.device).view(1, 1, 1, 4, 1)
    codes = (rows[..., 16:80].reshape(out, n, 2, 1, 32) >> shifts) & 0x03  # [out, n, h, j, i]
    d = rows[..., 80:82].contiguous().view(torch.float16).float()
    dmin = rows[..., 82:84].contiguous().view(torch.float16).float()
    packed = rows[..., :16]
    scales = torch.stack([d * (packed & 0x0F).float(), -(dmin * (packed >> 4).float())], dim=-1)  # [out, n, 16 halves, 2]
    return codes.reshape(out, -1).contiguous(), scales.reshape(out, -1).contiguous()


def zero_point_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, ops) -> GGUFWeight:
    """8-bit codes ``u`` ``[out, in]`` (uint8, 0-255) with a scale ``s`` and a zero point ``z`` (an
    integer, held in fp32) per 32-weight block, ``[out, in / 32]`` each, as the kernels' Q8Z blocks:
    weight ``(u - z) * s``, rounded once (``u - z`` spans 9 bits, exact in fp32): 1.25 bytes a weight."""
    out_features, in_features = codes.shape
    if codes.dtype != torch.uint8 or in_features % BLOCK or scales.shape != zeros.shape or scales.shape != (out_features, in_features // BLOCK):
        raise ValueError(f"zero-point blocks take uint8 codes [out, in] and a scale and zero a block, not {codes.dtype} {tuple(codes.shape)}")
    block_scales = torch.stack([scales.float(), zeros.float()], dim=-1).reshape(out_features, -1)
    return GGUFWeight(codes.contiguous(), block_scales.contiguous(), Q8Z, in_features, ops)


@dataclasses.dataclass
class GGUFWeight:
    """An ``[out_features, in_features]`` weight as codes ``[out, blocks * code bytes]`` (uint8)
    and scales ``[out, blocks * scales]`` (fp32), computed with ``ops``: ``cpu_ops.load_gguf()``
    for CPU tensors, the module ``kernels.triton_gguf`` for GPU ones (the same two functions)."""

    codes: torch.Tensor
    scales: torch.Tensor
    qtype: int
    in_features: int
    ops: object
    # The same codes and scales laid out for AVX-512's panels (``lay_out_panels``), or None.
    panel_codes: torch.Tensor | None = None
    panel_scales: torch.Tensor | None = None
    # Products of at least this many rows go by panels, given the layout (-1: the process's rule;
    # 1: every product, each output summed over k in one order whatever the rows: batch_invariant;
    # NEVER, without the layout: every product by tiles of rows, in one order too: batch_invariant).
    panel_min_rows: int = -1

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: int, in_features: int, ops) -> GGUFWeight:
        """From the file's rows of blocks (uint8 ``[out_features, blocks * block bytes]``)."""
        if qtype not in TYPES:
            supported = (
                f"Q4_0 = {Q4_0}, Q4_1 = {Q4_1}, Q5_0 = {Q5_0}, Q5_1 = {Q5_1}, Q8_0 = {Q8_0}, Q2_K = {Q2_K}, Q3_K = {Q3_K}, Q4_K = {Q4_K}, "
                f"Q5_K = {Q5_K}, Q6_K = {Q6_K}, IQ4_NL = {IQ4_NL}, IQ4_XS = {IQ4_XS}, and the i-quants {sorted(gguf_iq.TYPES)}"
            )
            raise ValueError(f"GGUF type {qtype} is not supported ({supported})")
        block, per_block = _K_LAYOUTS[qtype] if qtype in _K_LAYOUTS else (BLOCK, 2 * _LAYOUTS[qtype][0] + _LAYOUTS[qtype][1])
        if in_features % block or blocks.dim() != 2 or blocks.shape[1] != in_features // block * per_block:
            raise ValueError(f"GGUF blocks of shape {tuple(blocks.shape)} do not hold rows of {in_features} weights of type {qtype}")
        rows = blocks.reshape(blocks.shape[0], in_features // block, per_block)
        if qtype == Q4_K:
            return cls(*_from_q4_k(rows), Q4_1, in_features, ops)
        if qtype == Q5_K:
            return cls(*_from_q5_k(rows), Q5_K, in_features, ops)
        if qtype == Q6_K:
            return cls(*_from_q6_k(rows), Q6_K, in_features, ops)
        if qtype == Q3_K:
            return cls(*_from_q3_k(rows), Q6_K, in_features, ops)
        if qtype == Q2_K:
            return cls(*_from_q2_k(rows), Q2_K, in_features, ops)
        if qtype == IQ4_XS:
            return cls(*_from_iq4_xs(rows), Q8_0, in_features, ops)
        if qtype in gguf_iq.TYPES:  # a scale a 32 weights: Q8_0 blocks; a 16: Q6_K's kernel blocks
            return cls(*gguf_iq.from_iq(rows, qtype), Q8_0 if gguf_iq.LAYOUTS[qtype][1] == BLOCK else Q6_K, in_features, ops)
        num_scales = _LAYOUTS[qtype][0]
        scales = rows[..., : 2 * num_scales].contiguous().view(torch.float16).float()
        codes = rows[..., 2 * num_scales :]
        if qtype == IQ4_NL:  # d * v: a Q8_0 block of the looked-up values
            codes, qtype = _iq4_values(codes), Q8_0
        if qtype == Q4_0:  # d * (q - 8): a Q4_1 block with min -8 d, exact (a power of two times d)
            scales, qtype = torch.cat([scales, -8.0 * scales], dim=-1), Q4_1
        if qtype in (Q5_0, Q5_1):  # the kernels' Q5_K blocks: codes a byte each, d and m (Q5_0's -16 d)
            scales = torch.cat([scales, -16.0 * scales], dim=-1) if qtype == Q5_0 else scales
            codes, qtype = _five_bit_codes(codes), Q5_K
        if qtype == Q4_1:
            codes = q4_1_words(codes)
        return cls(codes.reshape(blocks.shape[0], -1).contiguous(), scales.reshape(blocks.shape[0], -1), qtype, in_features, ops)

    def shard(self, rows: list[slice], columns: slice | None = None) -> GGUFWeight:
        """The weight of these output features (row ranges, concatenated) and, with ``columns``,
        only these input features: a tensor-parallel rank's part, dequantizing to the same slice
        of the float weight. Columns must fall on block boundaries."""
        codes = torch.cat([self.codes[part] for part in rows])
        scales = torch.cat([self.scales[part] for part in rows])
        in_features = self.in_features
        if columns is not None:
            start, stop, _ = columns.indices(self.in_features)
            if start % BLOCK or stop % BLOCK:
                raise ValueError(f"input features [{start}, {stop}) do not fall on {BLOCK}-weight block boundaries")
            num_scales, code_bytes = _KERNEL_LAYOUTS[self.qtype]
            codes = codes[:, start // BLOCK * code_bytes : stop // BLOCK * code_bytes]
            scales = scales[:, start // BLOCK * num_scales : stop // BLOCK * num_scales]
            in_features = stop - start
        return GGUFWeight(codes.contiguous(), scales.contiguous(), self.qtype, in_features, self.ops)

    def lay_out_panels(self) -> None:
        """Keep a copy of the codes and scales laid out for the CPU kernels' panels, where this
        build's panels read one (AVX-512) and the weight has a multiple of 32 output features:
        without it, products of many rows (fp32 or bf16) go by tiles of rows. As many bytes again
        as the codes and scales."""
        needs = getattr(self.ops, "panels_need_layout", None)
        if needs is None or not needs() or self.codes.shape[0] % PANEL_WIDTH or self.panel_codes is not None:
            return
        self.panel_codes, self.panel_scales = self.ops.gguf_panel_layout(self.codes, self.scales, self.qtype, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for rows ``x`` ``[M, in_features]``: fp32, or bf16 (on CPUs whose kernels
        have ``has_bf16()``) against the weights rounded to bf16, as a bf16 model holds them,
        accumulated in fp32 and rounded to bf16 once."""
        if x.dtype == torch.bfloat16:
            products = self.ops.gguf_matmul_bf16(
                x, self.codes, self.scales, self.qtype, self.panel_min_rows, self.panel_codes, self.panel_scales
            )
            return products.to(torch.bfloat16)
        if self.panel_codes is not None or self.panel_min_rows != -1:  # (the CPU kernels')
            return self.ops.gguf_matmul(x, self.codes, self.scales, self.qtype, self.panel_min_rows, self.panel_codes, self.panel_scales)
        return self.ops.gguf_matmul(x, self.codes, self.scales, self.qtype)

    def matmul_argmax(self, x: torch.Tensor, excluded_token_ids: torch.Tensor) -> torch.Tensor:
        """``greedy_argmax(self.matmul(x).float(), excluded_token_ids)`` (``kernels.fused``),
        without the ``[M, out_features]`` products where the kernels fuse the two (on CPU; bf16
        rows there too)."""
        if self.panel_codes is not None or self.panel_min_rows != -1:
            return self.ops.gguf_matmul_argmax(
                x, self.codes, self.scales, self.qtype, excluded_token_ids, self.panel_min_rows, self.panel_codes, self.panel_scales
            )
        return self.ops.gguf_matmul_argmax(x, self.codes, self.scales, self.qtype, excluded_token_ids)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the products use, ``[out_features, in_features]``."""
        return self.ops.gguf_dequantize(self.codes, self.scales, self.qtype, self.in_features)
