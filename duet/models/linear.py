"""Linear layer without bias, with CPU fast paths for the small row counts of decode steps.

On CPU, oneDNN with a weight reordered once into its blocked layout runs the
``[rows, in] x [in, out]`` products of decode steps (2 to ~128 rows) about 1.25x faster in
fp32, and 1.4-2x in bf16, than ``F.linear``. Both are kept, and each call picks by rows. At
the two ends of fp32's range the winner depends on the CPU: on an AVX-512 Xeon ``F.linear``
(MKL) is as fast for a single row and for long prompt chunks; on an AMD EPYC (Zen, AVX-512)
it took 8.1 ms for a SmolLM2 step's 120 products at one row against oneDNN's 5.1, and 2.3-2.8x
oneDNN's time at 256 to 2,048 rows. So whether oneDNN also serves one row, and rows past 128,
is measured once per process (``_packed_wins``).

A weight that came from a GGUF file may also keep its blocks (``attach_gguf``): products of
up to ``GGUF_FLOAT_MAX_ROWS`` fp32 rows (per instruction set) then read the quantized codes
(0.75 byte a weight for Q4_1, 1.125 for Q8_0, scales included, against 4) through
``kernels.gguf``, which dequantizes them exactly to the float weights the other paths use (in
registers for a few rows, by panels kept in cache for a decode batch); longer products, prompt
chunks, keep oneDNN's float paths.

A weight quantized at load time (``quantization: int8 | int4``, ``duet.models.quantize``) keeps
its blocks alone (``weight`` is None): longer products dequantize it for the call, which
measures faster than the block kernels from about 128 rows (prompt chunks) and costs a
fraction of the product there. Rows of another dtype (bf16) go through the kernels in fp32.

An LM head whose rows only need their greedy token (``argmax``) skips writing its logits: for
SmolLM2 at 32 rows, 6.3 MB written and read again by ``torch.argmax`` (1.4 ms a step).
"""

from __future__ import annotations

import functools
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from duet.config import cpu_has_fast_bf16
from duet.kernels.fused import greedy_argmax
from duet.kernels.gguf import GGUFWeight
from duet.models.module import Module

# Row-count window where the reordered oneDNN weight wins, measured per dtype on
# AVX-512 CPUs (see benchmarks/offline.py for the end-to-end effect).
_PACKED_ROWS = {torch.float32: (2, 128), torch.bfloat16: (1, 128)}
_PACK_BATCH_HINT = 32
# oneDNN takes single fp32 rows, and prompt chunks, only where it is clearly faster (a margin
# that a noisy measurement on a CPU where both paths tie does not cross: the choice stays put).
_PACKED_MARGIN = 1.25
_CHUNK_ROWS = 512  # a prompt chunk's rows, for that measurement
# Rows up to which reading GGUF blocks beats the float weights, by the instruction set the
# kernels were built for (``isa()``; "gpu" for the Triton kernels, not measured there). On two
# AVX-512 cores (a Xeon), SmolLM2's 121 products take 2.7 ms from its Q4_1/Q8_0 codes at 1 row
# against 8.1 (F.linear); 21.7 against 39.9 (oneDNN, packed) at 16 rows; 30.7 against 38 at 32
# (by panels, ``csrc/gguf_ops.cpp``); 44 against 48 at 48; 55 against 50 at 56; 69 against 54 at
# 64. On an AVX2-only EPYC, one core (a replica's): 20 against 34 (packed) at 1 row, 45 against
# 63 at 8, even at 16 (95), 129 against 118 at 24, 236 against 170 at 40; on its two cores 46
# against 55 at 16, 115 against 88 at 32. Without AVX2 (not measured) only single rows, where a
# product is bound by the bytes it reads.
GGUF_FLOAT_MAX_ROWS = {"avx512": 48, "avx2": 16, "scalar": 1, "gpu": 48}
# The same for a bf16 model's products (bf16 rows, weights rounded to bf16 from the blocks, on
# CPUs with AVX512_BF16), against oneDNN's packed bf16 weights: a SmolLM2 step's products take
# 6.0 ms from the blocks against 11.6 at 1 row, 8.6 against 12.3 at 4, 15.7 against 11.1 at 8.
GGUF_BF16_MAX_ROWS = 6
# Weights kept as blocks alone (quantized at load) have no packed float weight to fall back
# on: past this many rows they dequantize for the call.
GGUF_MAX_ROWS = 64


class Linear(Module):
    """``y = x @ W.T``; ``W`` is ``[out_features, in_features]`` as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.packed_weight: torch.Tensor | None = None
        self._packed_rows = (0, -1)
        self.gguf: GGUFWeight | None = None
        self._block_rows = -1  # products of up to this many rows read the GGUF blocks (none: not even empty ones)

    def pack_for_cpu(self) -> None:
        """Reorder the weight for oneDNN once, if this CPU and dtype benefit."""
        rows = _PACKED_ROWS.get(self.weight.dtype)
        if rows is None or self.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return
        if self.weight.dtype == torch.bfloat16 and not cpu_has_fast_bf16():
            return  # oneDNN would emulate bf16 on AVX2-only CPUs; the plain path is the safe one
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_BATCH_HINT)
        low, high = rows
        if self.weight.dtype == torch.float32:
            low, high = (1 if _packed_wins(1) else low), (sys.maxsize if _packed_wins(_CHUNK_ROWS) else high)
        self._packed_rows = (low, high)

    def attach_gguf(self, weight: GGUFWeight) -> None:
        """Serve small products from ``weight``; the float weight stays for the rest and must be
        ``weight`` dequantized (and rounded to bf16, for a bf16 model)."""
        self.gguf = weight
        isa = weight.ops.isa() if hasattr(weight.ops, "isa") else "gpu"
        self._block_rows = GGUF_FLOAT_MAX_ROWS[isa] if self.weight.dtype == torch.float32 else GGUF_BF16_MAX_ROWS

    def keep_blocks_only(self) -> None:
        """Drop the float weight (and its packed copy): the attached blocks are the weight."""
        self.weight = None
        self.packed_weight = None
        self._packed_rows = (0, -1)
        self._block_rows = GGUF_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # quantized at load time
            if x.shape[0] > self._block_rows:
                return F.linear(x, self.gguf.dequantize().to(x.dtype))
            return self.gguf.matmul(x.float()).to(x.dtype)
        if x.shape[0] <= self._block_rows:  # blocks attached to a float32 or bfloat16 model
            return self.gguf.matmul(x)
        low, high = self._packed_rows
        if low <= x.shape[0] <= high:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return F.linear(x, self.weight)

    def plan(self) -> tuple:
        """What ``forward`` chooses from, for the C++ decoder stack (``duet.models.decoder_stack``)
        to choose the same way: ``(weight, packed_weight, packed_low, packed_high, codes, scales,
        qtype, block_rows)``, None for what this layer lacks."""
        blocks = self.gguf
        low, high = self._packed_rows
        if blocks is None:
            return (self.weight, self.packed_weight, low, high, None, None, 0, self._block_rows)
        return (self.weight, self.packed_weight, low, high, blocks.codes, blocks.scales, blocks.qtype, self._block_rows)

    def argmax(self, x: torch.Tensor, excluded_token_ids: torch.Tensor) -> torch.Tensor:
        """``greedy_argmax(self(x).float(), excluded_token_ids)``: an LM head's greedy tokens.
        fp32 rows the GGUF blocks serve never write their products out (the kernel keeps each
        row's best as it goes: the same products, so the same tokens)."""
        if x.dtype == torch.float32 and x.shape[0] <= self._block_rows:
            return self.gguf.matmul_argmax(x, excluded_token_ids)
        return greedy_argmax(self(x).float(), excluded_token_ids)


@functools.cache
def _packed_wins(rows: int) -> bool:
    """Whether oneDNN's packed weight multiplies ``rows`` fp32 rows at least ``_PACKED_MARGIN``
    times faster than ``F.linear`` on this CPU, by the best of 5 interleaved rounds each way (about
    0.1 s, once per process). One row is bound by reading the weight, so it is timed on a weight
    past the caches that matter (16 MB; 4 MB measured 1.5x where 16 MB measured 2.5x); a chunk is
    bound by compute, timed on a small weight."""
    side, calls = (2048, 10) if rows == 1 else (512, 2)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(side, side, generator=generator)
    x = torch.randn(rows, side, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    ways = {
        "plain": lambda: F.linear(x, weight),
        "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    best = {name: float("inf") for name in ways}
    for _ in range(5):
        for name, product in ways.items():
            started = time.perf_counter()
            for _ in range(calls):
                product()
            best[name] = min(best[name], time.perf_counter() - started)
    return best["plain"] >= _PACKED_MARGIN * best["packed"]
