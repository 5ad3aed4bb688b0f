"""W8A8's products: each input row quantized per token at run time (``per_token_codes``, to
the bit as compressed-tensors' forward does), and, in integers, the input's int8 codes times the
weight's int8 codes, summed exactly in int32 by oneDNN's int8 product over the weight packed once
in its layout (``onednn::qlinear_pointwise``, as PyTorch's x86 quantization runs it: AMX-INT8
tiles or VNNI where the CPU has them), then scaled by the row's and the output channel's scales,
``y = float(sum_k qx * qw) * sx * sw``, as vLLM computes W8A8 on CPUs. The sums are exact, so no
batch, split or order of additions changes them; compressed-tensors' own forward multiplies
the dequantized floats instead, which rounds at every addition: the two differ in the outputs'
last bits.

Taken for a weight with one scale per output channel (a grouped scheme keeps the Q8_0 blocks'
float products), on CPUs where this process found the product exact at the codes' extremes (a
kernel that adds pairs in int16 saturates there), and from as many rows as it measured the
integer path faster than the blocks' (``int8_min_rows``, once per machine). The packed copy is
a byte a weight beside the blocks' (kept for tensor-parallel sharding and fewer rows).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from duet.kernels import cpu_ops
from duet.kernels.cpu_ops import NEVER, SAMPLE_IN_FEATURES, SAMPLE_OUT_FEATURES, SAMPLE_WEIGHTS, best_times
from duet.kernels.gguf import BLOCK, Q8_0, GGUFWeight

logger = logging.getLogger(__name__)

INT8_PER_TOKEN = "int8-per-token"  # W8A8's inputs (``Linear.input_quantization``)
FLOAT8_PER_TOKEN = "float8-per-token"  # FP8 W8A8's
INT8_STATIC = "int8-static"  # a checkpoint's inputs at one calibrated scale a tensor (a ``StaticInput`` each Linear)
FLOAT8_STATIC = "float8-static"
FLOAT8_MAX = 448.0  # e4m3's largest finite value
RULE = "int8_min_rows"
INT8_ROWS = (1, 2, 4, 8, 16, 32)  # row counts the two paths are timed at
_MARGIN = 1.05  # by which the integer path must win to take the rows (a noisy tie keeps the blocks)
_PROBE_LOSS = 4.0  # slower than the blocks by this much on one weight at the most rows: no race


@dataclasses.dataclass
class Int8Weight:
    """A weight's int8 codes packed for oneDNN's int8 product (``[in, out]`` in its layout), its
    fp32 scale per output channel, and the unit scales and zero points the product is called with
    (so that it gives the sums themselves)."""

    packed: torch.Tensor
    scales: torch.Tensor
    unit_scales: torch.Tensor
    zero_points: torch.Tensor

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
        """From int8 codes ``[out, in]`` and a scale per output channel."""
        out_features = codes.shape[0]
        return cls(
            torch.ops.onednn.qlinear_prepack(codes, None), scales.float().contiguous(), torch.ones(out_features),
            torch.zeros(out_features, dtype=torch.int64),
        )

    @classmethod
    def from_blocks(cls, blocks: GGUFWeight) -> Int8Weight | None:
        """From Q8_0 blocks whose every block of a row has the row's scale; None for other blocks,
        grouped scales or a GPU's."""
        if blocks.qtype != Q8_0 or blocks.codes.device.type != "cpu":
            return None
        scales = blocks.scales
        if not bool((scales == scales[:, :1]).all()):
            return None
        return cls.from_codes(blocks.codes.view(torch.int8), scales[:, 0])


def int8_sums(codes: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``codes @ W.T`` for int8 ``codes`` ``[rows, in]``: the exact int32 sums, as fp32."""
    return torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, 0, weight.packed, weight.unit_scales, weight.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


def int8_product(codes: torch.Tensor, row_scales: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``float(codes @ W.T) * row_scales * weight.scales`` in fp32: ``codes`` int8
    ``[rows, in_features]``, ``row_scales`` ``[rows, 1]``."""
    return int8_sums(codes, weight) * row_scales.float() * weight.scales


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """A product's input quantized at the checkpoint's own calibrated scale ``s`` (and zero point
    ``z``, int8 only) for the whole tensor (llm-compressor's static schemes: FP8's and W8A8's with
    ``dynamic: false``, ``strategy: tensor``), to the bit as compressed-tensors' forward does
    (``_quantize_dequantize``): ``(round(clamp(x / s + z)) - z) * s``, rounded to an integer half
    to even (int8, clamped to -128..127) or to e4m3 (float8, clamped to +-448), the codes taken
    to the scale's dtype before ``z`` and ``s`` are applied."""

    kind: str  # INT8_STATIC or FLOAT8_STATIC
    scale: torch.Tensor  # one element
    zero_point: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_one_call and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
            ops = cpu_ops.load_gguf()
            if ops is not None:  # the same bits in one C++ call (csrc/int8_rows.cpp's float8_rows)
                return ops.float8_rows(x, self.scale)
        return self.in_torch(x)

    @property
    def in_one_call(self) -> bool:
        """Whether fp32 or bf16 rows on CPU take ``float8_rows`` (a float8 scheme, one fp32 or bf16
        scale on CPU: what the C++ call takes)."""
        return self.kind == FLOAT8_STATIC and self.scale.device.type == "cpu" and self.scale.dtype in (torch.float32, torch.bfloat16)

    def in_torch(self, x: torch.Tensor) -> torch.Tensor:
        """``__call__`` composed of torch's own operations (the reference)."""
        scaled = x / self.scale
        if self.zero_point is not None:
            scaled = scaled + self.zero_point.to(x.dtype)
        if self.kind == INT8_STATIC:
            codes = torch.round(torch.clamp(scaled, -128, 127))
        else:
            codes = torch.clamp(scaled, -FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn).to(scaled.dtype)
        values = codes.to(self.scale.dtype)
        if self.zero_point is not None:
            values = values - self.zero_point.to(self.scale.dtype)
        return (values * self.scale).to(x.dtype)

    def to(self, device) -> StaticInput:
        zero_point = None if self.zero_point is None else self.zero_point.to(device)
        return StaticInput(self.kind, self.scale.to(device), zero_point)


def quantize_input(x: torch.Tensor, scheme, row_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``x`` as a product's input scheme quantizes it: a ``StaticInput``'s own scale, or each
    row's (``dynamic_per_token``); ``row_max`` only matters to the latter."""
    if isinstance(scheme, StaticInput):
        return scheme(x)
    return dynamic_per_token(x, scheme, row_max)


def dynamic_per_token(x: torch.Tensor, scheme: str, row_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``x``'s rows as W8A8 quantizes a product's input before it, to the bit as compressed-tensors'
    forward does (``compute_dynamic_scales_and_zp`` then ``fake_quantize``): ``codes * scale`` of
    ``per_token_codes``; float8 rows on CPU in one C++ call (``csrc/int8_rows.cpp``'s
    ``float8_rows``, the same bits) where the kernels are built."""
    if scheme == FLOAT8_PER_TOKEN and row_max is None and x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
        ops = cpu_ops.load_gguf()
        if ops is not None:
            return ops.float8_rows(x)
    codes, scale = per_token_codes(x, scheme, row_max)
    return codes * scale


def per_token_codes(
    x: torch.Tensor, scheme: str, row_max: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes W8A8 quantizes ``x``'s rows to, and each row's scale ``s`` (``[rows, 1]``), both
    in ``x``'s dtype: ``s`` is the row's largest magnitude (zero counted) over half the codes'
    range (127.5 for int8, 448 for float8; the eps of ``x``'s dtype where that is 0), and the
    codes are ``x / s`` clamped to the codes' range, rounded to one (int8: to an integer, half to
    even; float8: to e4m3). ``row_max``: where ``x`` holds part of each row's features (a
    row-parallel shard's), the largest magnitudes over the whole rows from those of this part."""
    zero = torch.zeros((), dtype=x.dtype)
    low, high = torch.minimum(x.amin(-1, keepdim=True), zero), torch.maximum(x.amax(-1, keepdim=True), zero)
    half_range = 127.5 if scheme == INT8_PER_TOKEN else FLOAT8_MAX
    largest = torch.maximum(low.abs(), high.abs())
    if row_max is not None:
        largest = row_max(largest)
    scale = largest / torch.tensor(half_range, dtype=x.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    if scheme == INT8_PER_TOKEN:
        return torch.round(torch.clamp(x / scale, -128, 127)), scale
    return torch.clamp(x / scale, -FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn).to(x.dtype), scale


def int8_linear(x: torch.Tensor, weight: Int8Weight, row_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """W8A8's product of ``x``'s rows in integers, in ``x``'s dtype: in one C++ call
    (``csrc/int8_rows.cpp``), or where ``row_max`` gives the row scales over other ranks'
    features too, by ``per_token_codes`` and ``int8_product``."""
    if row_max is None:
        return cpu_ops.load_gguf().int8_linear(x, weight.packed, weight.scales, weight.unit_scales, weight.zero_points)
    codes, scales = per_token_codes(x, INT8_PER_TOKEN, row_max)
    return int8_product(codes.to(torch.int8), scales, weight).to(x.dtype)


@functools.cache
def int8_min_rows() -> int:
    """The fewest rows from which W8A8's products go in integers on this CPU, or ``NEVER``: never
    where oneDNN's int8 product is not exact here (``exact_int8_sums``); else the first of ``INT8_ROWS``
    from which ``int8_linear`` is ``_MARGIN`` times faster than the Q8_0 blocks' float products
    of the quantized rows at every count measured, over ``SAMPLE_WEIGHTS`` per-channel int8
    weights of a SmolLM2 MLP's shape (32 MB, read from memory as a step reads a model's), best
    of 3 interleaved rounds each way. Once per machine, or as ``DUET_CPU_RULES`` gives it (``cpu_rules``)."""
    return cpu_ops.rule(RULE, _timed_int8_min_rows)


def _timed_int8_min_rows() -> int:
    ops = cpu_ops.load_gguf()
    if ops is None or not exact_int8_sums():
        logger.info("W8A8 products go by the Q8_0 blocks on this CPU: oneDNN's int8 product is %s", "not exact" if ops else "beside no C++ kernels")
        return NEVER
    generator = torch.Generator().manual_seed(4)
    weights = []
    for _ in range(SAMPLE_WEIGHTS):
        codes = torch.randint(-127, 128, (SAMPLE_OUT_FEATURES, SAMPLE_IN_FEATURES), dtype=torch.int8, generator=generator)
        scales = torch.rand(SAMPLE_OUT_FEATURES, 1, generator=generator) * 0.01
        blocks = GGUFWeight(codes.view(torch.uint8), scales.expand(-1, SAMPLE_IN_FEATURES // BLOCK).contiguous(), Q8_0, SAMPLE_IN_FEATURES, ops)
        blocks.lay_out_panels()
        weights.append((blocks, Int8Weight.from_blocks(blocks)))
    # The rows from which the integers win at every count: raced from the most rows down, the
    # first loss settles it. A probe of one weight first: where oneDNN runs its int8 product by
    # reference loops (a Zen 4 measured 9.5 ms a row against the blocks' 0.5 ms for 8 rows),
    # the whole race took 66 s, once per machine, at a W8A8 model's first load.
    x = torch.randn(INT8_ROWS[-1], SAMPLE_IN_FEATURES, generator=generator)
    first_blocks, first_weight = weights[0]
    probe = best_times(
        {"blocks": lambda: first_blocks.matmul(dynamic_per_token(x, INT8_PER_TOKEN)), "int8": lambda: int8_linear(x, first_weight)}, rounds=2
    )
    chosen = NEVER
    if probe["int8"] <= _PROBE_LOSS * probe["blocks"]:
        for rows in reversed(INT8_ROWS):
            x = torch.randn(rows, SAMPLE_IN_FEATURES, generator=generator)
            times = best_times(
                {
                    "blocks": lambda: [blocks.matmul(dynamic_per_token(x, INT8_PER_TOKEN)) for blocks, _ in weights],
                    "int8": lambda: [int8_linear(x, weight) for _, weight in weights],
                },
                rounds=3,
            )
            if times["blocks"] < _MARGIN * times["int8"]:
                break
            chosen = rows
    logger.info("W8A8 products go by %s on this CPU", "the Q8_0 blocks" if chosen == NEVER else f"int8 sums from {chosen} rows")
    return chosen


@functools.cache
def exact_int8_sums() -> bool:
    """Whether oneDNN's int8 product (``int8_sums``) gives the exact sums here (``sums_are_exact``)."""
    try:
        return sums_are_exact(lambda x, w: int8_sums(x, Int8Weight.from_codes(w, torch.ones(w.shape[0]))))
    except (RuntimeError, AttributeError):  # no oneDNN, or no int8 product in it
        return False


def sums_are_exact(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``product(x, w)`` (int8 codes ``[rows, in]`` and ``[out, in]``) gives ``x @ w.T``'s
    exact sums as fp32, at the codes' extremes (-128 and 127 in every pairing, over 4,096
    features: sums to 2^26) and on random codes, for one row and for many."""
    generator = torch.Generator().manual_seed(5)
    features = 4096
    x = torch.randint(-128, 128, (37, features), dtype=torch.int8, generator=generator)
    w = torch.randint(-128, 128, (48, features), dtype=torch.int8, generator=generator)
    x[0], x[1], x[2, ::2], x[2, 1::2] = -128, 127, -128, 127
    w[0], w[1], w[2, ::2], w[2, 1::2] = -128, 127, 127, -128
    exact = (x.long() @ w.long().t()).float()
    return torch.equal(product(x[:1].contiguous(), w), exact[:1]) and torch.equal(product(x, w), exact)
