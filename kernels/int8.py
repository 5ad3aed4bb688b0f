"""W8A8's products in integers: the input's int8 codes (quantized per token, as
compressed-tensors quantizes them: ``duet.models.packed.per_token_codes``) times the weight's
int8 codes, summed in int32 by ``torch._int_mm`` (oneDNN's int8 kernels: AMX-INT8 tiles or
VNNI where the CPU has them), then scaled by the row's and the output channel's scales,
``y = float(sum_k qx * qw) * sx * sw``, as vLLM computes W8A8 on CPUs. The sums are exact, so no
batch, split or order of additions changes them; compressed-tensors' own forward multiplies
the dequantized floats instead, which rounds at every addition: the two differ in the outputs'
last bits.

Taken for a weight with one scale per output channel (a grouped scheme keeps the Q8_0 blocks'
float products), on CPUs where this process found ``torch._int_mm`` exact at the codes'
extremes (a kernel that sums pairs in int16 saturates there), and from as many rows as it
measured the integer path faster than the blocks' (``int8_min_rows``, once per process).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from duet.kernels import cpu_ops
from duet.kernels.cpu_ops import NEVER, SAMPLE_IN_FEATURES, SAMPLE_OUT_FEATURES, SAMPLE_WEIGHTS, best_times
from duet.kernels.gguf import BLOCK, Q8_0, GGUFWeight

logger = logging.getLogger(__name__)

RULE = "int8_min_rows"
INT8_ROWS = (1, 2, 4, 8, 16, 32)  # row counts the two paths are timed at
_MARGIN = 1.05  # by which the integer path must win to take the rows (a noisy tie keeps the blocks)


@dataclasses.dataclass
class Int8Weight:
    """A weight's int8 codes ``[out_features, in_features]`` and its fp32 scale per output channel."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_blocks(cls, blocks: GGUFWeight) -> Int8Weight | None:
        """The Q8_0 blocks' own codes (a view: no copy) where every block of a row has the row's
        scale; None for other blocks, grouped scales or a GPU's."""
        if blocks.qtype != Q8_0 or blocks.codes.device.type != "cpu":
            return None
        scales = blocks.scales
        if not bool((scales == scales[:, :1]).all()):
            return None
        return cls(blocks.codes.view(torch.int8), scales[:, 0].contiguous())


def int8_product(codes: torch.Tensor, row_scales: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``float(codes @ weight.codes.T) * row_scales * weight.scales`` in fp32: ``codes`` int8
    ``[rows, in_features]``, ``row_scales`` ``[rows, 1]``."""
    sums = torch._int_mm(codes, weight.codes.t())
    return sums.float() * row_scales.float() * weight.scales


@functools.cache
def int8_min_rows() -> int:
    """The fewest rows from which W8A8's products go by ``int8_product`` on this CPU, or
    ``NEVER``: never where ``torch._int_mm`` is not exact here (``exact_int_mm``); else the first
    of ``INT8_ROWS`` from which it is ``_MARGIN`` times faster than the Q8_0 blocks' float
    products at every count measured, timed over ``SAMPLE_WEIGHTS`` per-channel int8 weights of a
    SmolLM2 MLP's shape (32 MB, read from memory as a step reads a model's), best of 3
    interleaved rounds each way. ``DUET_CPU_RULES`` may give it (``cpu_ops.pinned_rule``)."""
    if (pinned := cpu_ops.pinned_rule(RULE)) is not None:
        return pinned
    ops = cpu_ops.load_gguf()
    if ops is None or not exact_int_mm():
        logger.info("W8A8 products go by the Q8_0 blocks on this CPU: torch._int_mm is %s", "not exact" if ops else "beside no C++ kernels")
        return NEVER
    generator = torch.Generator().manual_seed(4)
    weights = []
    for _ in range(SAMPLE_WEIGHTS):
        codes = torch.randint(-127, 128, (SAMPLE_OUT_FEATURES, SAMPLE_IN_FEATURES), dtype=torch.int8, generator=generator)
        scales = torch.rand(SAMPLE_OUT_FEATURES, 1, generator=generator) * 0.01
        blocks = GGUFWeight(codes.view(torch.uint8), scales.expand(-1, SAMPLE_IN_FEATURES // BLOCK).contiguous(), Q8_0, SAMPLE_IN_FEATURES, ops)
        blocks.lay_out_panels()
        weights.append((blocks, Int8Weight.from_blocks(blocks)))
    wins = []
    for rows in INT8_ROWS:
        x = torch.randn(rows, SAMPLE_IN_FEATURES, generator=generator)
        x_codes = torch.randint(-128, 128, (rows, SAMPLE_IN_FEATURES), dtype=torch.int8, generator=generator)
        x_scales = torch.rand(rows, 1, generator=generator)
        times = best_times(
            {
                "blocks": lambda: [blocks.matmul(x) for blocks, _ in weights],
                "int8": lambda: [int8_product(x_codes, x_scales, weight) for _, weight in weights],
            },
            rounds=3,
        )
        wins.append(times["blocks"] >= _MARGIN * times["int8"])
    chosen = NEVER
    for rows, win in zip(reversed(INT8_ROWS), reversed(wins)):
        if not win:
            break
        chosen = rows
    logger.info("W8A8 products go by %s on this CPU", "the Q8_0 blocks" if chosen == NEVER else f"int8 sums from {chosen} rows")
    return chosen


@functools.cache
def exact_int_mm() -> bool:
    """Whether ``torch._int_mm`` gives the exact int32 sums here, at the codes' extremes (-128 and
    127 in every pairing, over 4,096 features: sums to 2^26) and on random codes, for one row
    and for many."""
    generator = torch.Generator().manual_seed(5)
    features = 4096
    x = torch.randint(-128, 128, (37, features), dtype=torch.int8, generator=generator)
    w = torch.randint(-128, 128, (48, features), dtype=torch.int8, generator=generator)
    x[0], x[1], x[2, ::2], x[2, 1::2] = -128, 127, -128, 127
    w[0], w[1], w[2, ::2], w[2, 1::2] = -128, 127, 127, -128
    try:
        sums = [torch._int_mm(x[:1].contiguous(), w.t()), torch._int_mm(x, w.t())]
    except RuntimeError:
        return False
    exact = x.long() @ w.long().t()
    return sums[0].dtype == torch.int32 and torch.equal(sums[0].long(), exact[:1]) and torch.equal(sums[1].long(), exact)
