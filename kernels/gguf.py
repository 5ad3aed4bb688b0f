"""Weights kept as a GGUF file's quantized blocks, and products computed from them.

A GGUF tensor of type Q4_1 or Q8_0 is rows of 32-weight blocks: an fp16 scale ``d`` (and for
Q4_1 a min ``m``) followed by the codes (16 bytes of nibbles, or 32 int8). ``GGUFWeight`` keeps
the codes (Q4_1's nibbles reordered within their block, ``_q4_1_words``, so that vectors
unpack them by shifts alone) and the scales widened to fp32 (exact: every fp16 is an fp32),
beside them rather than between them, so that a step never converts a scale. The kernels —
C++ on CPU (``csrc/gguf_ops.cpp``), Triton on a GPU (``triton_gguf.py``) — dequantize each
block in registers, to the very floats gguf's own dequantizer gives, and multiply in fp32.
"""

from __future__ import annotations

import dataclasses

import torch

Q4_1 = 3  # GGML's type ids
Q8_0 = 8
_LAYOUTS = {Q4_1: (2, 16), Q8_0: (1, 32)}  # per block: fp16 scales (d[, m]), then code bytes
TYPES = frozenset(_LAYOUTS)  # what the kernels read
BLOCK = 32


def _q4_1_words(codes: torch.Tensor) -> torch.Tensor:
    """A Q4_1 block's 16 code bytes (byte j: weight j's code low, weight 16 + j's high) as four
    32-bit words D0..D3 holding weight 4L + k's code at bits 4L of Dk and weight 16 + 4L + k's
    at bits 16 + 4L: each 32-bit lane of a vector then finds its weight's code by a shift."""
    low = (codes & 0x0F).to(torch.int32).unflatten(-1, (4, 4))  # [..., L, k]: weight 4L + k
    high = (codes >> 4).to(torch.int32).unflatten(-1, (4, 4))  # weight 16 + 4L + k
    shifts = (4 * torch.arange(4, dtype=torch.int32, device=codes.device)).view(4, 1)
    words = ((low << shifts) | (high << (shifts + 16))).sum(dim=-2, dtype=torch.int32)  # disjoint bits: sum = or
    return words.view(torch.uint8)


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

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: int, in_features: int, ops) -> GGUFWeight:
        """From the file's rows of blocks (uint8 ``[out_features, blocks * block bytes]``)."""
        if qtype not in _LAYOUTS:
            raise ValueError(f"GGUF type {qtype} is not supported (Q4_1 = {Q4_1}, Q8_0 = {Q8_0})")
        num_scales, code_bytes = _LAYOUTS[qtype]
        per_block = 2 * num_scales + code_bytes
        if in_features % BLOCK or blocks.dim() != 2 or blocks.shape[1] != in_features // BLOCK * per_block:
            raise ValueError(f"GGUF blocks of shape {tuple(blocks.shape)} do not hold rows of {in_features} weights of type {qtype}")
        rows = blocks.reshape(blocks.shape[0], in_features // BLOCK, per_block)
        scales = rows[..., : 2 * num_scales].contiguous().view(torch.float16).float()
        codes = rows[..., 2 * num_scales :]
        if qtype == Q4_1:
            codes = _q4_1_words(codes)
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
            num_scales, code_bytes = _LAYOUTS[self.qtype]
            codes = codes[:, start // BLOCK * code_bytes : stop // BLOCK * code_bytes]
            scales = scales[:, start // BLOCK * num_scales : stop // BLOCK * num_scales]
            in_features = stop - start
        return GGUFWeight(codes.contiguous(), scales.contiguous(), self.qtype, in_features, self.ops)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for fp32 rows ``x`` ``[M, in_features]``."""
        return self.ops.gguf_matmul(x, self.codes, self.scales, self.qtype)

    def matmul_argmax(self, x: torch.Tensor, excluded_token_ids: torch.Tensor) -> torch.Tensor:
        """``greedy_argmax(x @ W.T, excluded_token_ids)`` (``kernels.fused``), without the
        ``[M, out_features]`` products where the kernels fuse the two (on CPU)."""
        return self.ops.gguf_matmul_argmax(x, self.codes, self.scales, self.qtype, excluded_token_ids)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the products use, ``[out_features, in_features]``."""
        return self.ops.gguf_dequantize(self.codes, self.scales, self.qtype, self.in_features)
