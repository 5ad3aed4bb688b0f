"""Which CPU path a ``Linear`` product of so many rows takes: the rules that choose between
oneDNN's reordered weight and ``F.linear`` (``packed_wins``), the float panels
(``float_panel_rows``) and the GGUF blocks (``gguf_float_max_rows``; ``blocks_only_max_rows``
where they are the weight), each timed over sample
weights of a SmolLM2 MLP's shape once per machine and thread count (``kernels.cpu_rules``), or
given by ``DUET_CPU_RULES`` (``measured_cpu_rules``: what a process hands the ones it starts);
and the float panels' layout they time (``float_panels``). Figures: docs/benchmarks.md, "GGUF
products and the measured rules".
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from duet.kernels import cpu_ops
from duet.kernels.cpu_ops import SAMPLE_IN_FEATURES, SAMPLE_OUT_FEATURES, SAMPLE_WEIGHTS, best_times, sample_q4_1_weights
from duet.kernels.gguf import Q4_1, GGUFWeight
from duet.kernels.w8a8 import RULE as INT8_RULE, int8_min_rows

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 32  # the rows oneDNN's reordered weight is laid out for
# oneDNN takes single fp32 rows, and prompt chunks, only where it is clearly faster (a margin
# that a noisy measurement on a CPU where both paths tie does not cross: the choice stays put).
_PACKED_MARGIN = 1.25
CHUNK_ROWS = 512  # a prompt chunk's rows, for that measurement
# Rows up to which reading GGUF blocks beats the float weights (fp32; bf16 on CPUs with
# AVX512_BF16, against oneDNN's packed bf16 weights), measured once per machine on this CPU
# (``gguf_float_max_rows``) at these row counts: the blocks serve every count up to the first
# where oneDNN's packed float weight is ``_FLOAT_MARGIN`` times faster (a tie goes to the blocks).
GGUF_FLOAT_ROWS = (4, 8, 16, 24, 32, 48, 64)
_FLOAT_MARGIN = 1.05
# Weights kept as blocks alone (quantized at load, a quantized checkpoint's packed weights,
# ``quantization: bf16``) have no packed float weight to fall back on: past so many rows they
# dequantize for the call. Up to GGUF_MAX_ROWS they read the blocks; an fp32 model's on CPU up to
# ``blocks_only_max_rows``, timed at each of BLOCKS_ONLY_ROWS.
GGUF_MAX_ROWS = 64
BLOCKS_ONLY_ROWS = (128, 256, 512, 1024)
BLOCKS_ONLY_RULE = "gguf_blocks_only_max_rows"


def float_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``weight`` ``[out, in]`` as ``invariant_linear`` reads it: ``[ceil(out / width), in, width]``,
    output features padded with zeros."""
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // width) * width, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    return padded.view(-1, width, in_features).transpose(1, 2).contiguous()


# Row counts at which fp32 products by panels race the other float paths (``float_panel_rows``),
# and the margin by which another must win to take over (panels that tie keep the rows: they
# replace oneDNN's copy where they serve every row count it would, and sum in one order).
FLOAT_PANEL_ROWS = (1, 32, 128, 512)
_PANEL_MARGIN = 1.05


@functools.cache
def float_panel_rows() -> int:
    """The most fp32 rows a product takes by panels on this CPU: the panels, oneDNN's packed
    weight and ``F.linear`` are timed at ``FLOAT_PANEL_ROWS``, best of 3 interleaved rounds each
    way, over 16 weights of a SmolLM2 MLP's shape (56 MB, read from memory as a step reads a
    model's; 2 of them from 256 rows, where the products are bound by arithmetic); the panels
    serve every count up to the first where the faster of the others is ``_PANEL_MARGIN`` times
    faster than they are. 0 where the C++ kernels are unavailable. Once per machine
    (``cpu_rules``), under a second and 170 MB for that moment."""
    ops = cpu_ops.load_gguf()
    if ops is None or not torch.backends.mkldnn.is_available():
        return 0
    return cpu_ops.rule("float_panel_rows", lambda: _timed_float_panel_rows(ops))


def _timed_float_panel_rows(ops) -> int:
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(SAMPLE_OUT_FEATURES, SAMPLE_IN_FEATURES, generator=generator) for _ in range(16)]
    panels = [float_panels(weight, ops.invariant_panel_width()) for weight in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) for weight in weights]
    chosen = 0
    for rows in FLOAT_PANEL_ROWS:
        count = 16 if rows <= 128 else 2
        x = torch.randn(rows, SAMPLE_IN_FEATURES, generator=generator)
        times = best_times(
            {
                "panels": lambda: [ops.invariant_linear(x, p, SAMPLE_OUT_FEATURES) for p in panels[:count]],
                "packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed[:count]],
                "plain": lambda: [F.linear(x, w) for w in weights[:count]],
            },
            rounds=3,
        )
        if _PANEL_MARGIN * min(times["packed"], times["plain"]) < times["panels"]:
            break
        chosen = rows
    logger.info("fp32 products of up to %d rows go by panels on this CPU", chosen)
    return chosen


@functools.cache
def packed_wins(rows: int) -> bool:
    """Whether oneDNN's packed weight multiplies ``rows`` fp32 rows at least ``_PACKED_MARGIN``
    times faster than ``F.linear`` on this CPU, by the best of 5 interleaved rounds each way (about
    0.1 s, once per machine: ``cpu_rules``). One row is bound by reading the weight, so it is
    timed on a weight past the caches that matter (16 MB; 4 MB measured 1.5x where 16 MB measured
    2.5x); a chunk is bound by compute, timed on a small weight."""
    return bool(cpu_ops.rule(f"packed_wins_{rows}_rows", lambda: _timed_packed_wins(rows)))


def _timed_packed_wins(rows: int) -> bool:
    side, calls = (2048, 10) if rows == 1 else (512, 2)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(side, side, generator=generator)
    x = torch.randn(rows, side, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    times = best_times(
        {"plain": lambda: F.linear(x, weight), "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")},
        calls=calls,
    )
    return times["plain"] >= _PACKED_MARGIN * times["packed"]


@functools.cache
def blocks_only_max_rows() -> int:
    """The most fp32 rows a product of weights kept as blocks alone reads the blocks for on this
    CPU, past which it dequantizes the weight for the call and multiplies by ``F.linear``: at least
    ``GGUF_MAX_ROWS``; then each of ``BLOCKS_ONLY_ROWS`` up to the first where the dequantized way
    is ``_FLOAT_MARGIN`` times faster (best of 3 interleaved rounds each way over a quarter of
    ``SAMPLE_WEIGHTS`` Q4_1 weights of a SmolLM2 MLP's shape), ``NEVER`` where the blocks won at
    every count timed (both ways grow alike with the rows past them). On a 2-core AMD EPYC with
    AVX-512, a W4A16 SmolLM2's 3,072 x 576 products of 512 rows took 6.4 ms by panels against
    13.0 dequantized for the call (docs/benchmarks.md). Once per machine, or as ``DUET_CPU_RULES``
    gives it (``cpu_rules``)."""
    return cpu_ops.rule(BLOCKS_ONLY_RULE, _timed_blocks_only_max_rows)


def _timed_blocks_only_max_rows() -> int:
    ops = cpu_ops.load_gguf()
    if ops is None:
        return GGUF_MAX_ROWS
    weights = []
    for codes, scales in sample_q4_1_weights(SAMPLE_WEIGHTS // 4):
        blocks = GGUFWeight(codes, scales, Q4_1, SAMPLE_IN_FEATURES, ops)
        blocks.lay_out_panels()
        weights.append(blocks)
    generator = torch.Generator().manual_seed(2)
    served = GGUF_MAX_ROWS
    for rows in BLOCKS_ONLY_ROWS:
        x = torch.randn(rows, SAMPLE_IN_FEATURES, generator=generator)
        ways = {
            "blocks": lambda: [weight.matmul(x) for weight in weights],
            "dequantized": lambda: [F.linear(x, weight.dequantize()) for weight in weights],
        }
        times = best_times(ways, rounds=3)
        if times["blocks"] > _FLOAT_MARGIN * times["dequantized"]:
            break
        served = rows
    else:
        served = cpu_ops.NEVER
    up_to = "any number of" if served == cpu_ops.NEVER else served
    logger.info("fp32 products of weights kept as blocks alone read them for up to %s rows on this CPU", up_to)
    return served


def measured_cpu_rules() -> dict[str, int]:
    """This process's CPU rules as ``DUET_CPU_RULES`` takes them (``cpu_rules``), measured where
    neither the environment nor this machine's rules file gives them; none without the C++ kernels."""
    ops = cpu_ops.load_gguf()
    if ops is None:
        return {}
    rules = {"gguf_panel_min_rows": ops.panel_min_rows(), "float_panel_rows": float_panel_rows(),
             "gguf_float_max_rows": gguf_float_max_rows(ops), INT8_RULE: int8_min_rows(), BLOCKS_ONLY_RULE: blocks_only_max_rows()}
    if ops.has_bf16():
        rules["gguf_bf16_max_rows"] = gguf_float_max_rows(ops, torch.bfloat16)
        rules["gguf_bf16_panel_min_rows"] = ops.bf16_panel_min_rows()
    return rules | ({"gguf_bf16_amx_min_rows": ops.bf16_amx_min_rows()} if ops.has_amx() else {})


def gguf_float_max_rows(ops, dtype: torch.dtype = torch.float32, device: str = "cpu") -> int:
    """``_cached_gguf_float_max_rows``, once per process, ``ops``, dtype and device, defaults
    passed or not (``functools.cache`` keys on the arguments as written)."""
    return _cached_gguf_float_max_rows(ops, dtype, device)


@functools.cache
def _cached_gguf_float_max_rows(ops, dtype: torch.dtype, device: str) -> int:
    """The most rows of ``dtype`` (fp32; bf16 on CPUs with AVX512_BF16, elsewhere -1: none) a
    product reads GGUF blocks for, on this CPU (``GGUF_FLOAT_ROWS``): the blocks (``ops``, by the
    process's rule for tiles and panels) and the float weights' path for those rows (oneDNN's
    packed weight) are timed, best of 3 interleaved rounds each way, over Q4_1 weights of a
    SmolLM2 MLP's shape:
    127 MB of float weights (``SAMPLE_WEIGHTS`` in fp32, twice as many in bf16), read from memory
    as a step reads a model's (in cache, where they are bound by arithmetic alone, they measured
    a third as many rows for the blocks as a SmolLM2 step does). On a CPU once per machine and
    dtype (``cpu_rules``: ``gguf_float_max_rows``, ``gguf_bf16_max_rows``), about 0.3 s and 250 MB.

    On a GPU (``device``; ``ops``: the Triton kernels) the same race runs there against
    ``F.linear`` (cuBLAS), from one row, and 0 means the blocks serve none (as on an H200)."""
    gpu = device != "cpu"
    if dtype == torch.bfloat16 and not gpu and not ops.has_bf16():
        return -1  # the blocks take no bf16 rows on a CPU without AVX512_BF16 (nor would oneDNN's packing)
    rule = {torch.float32: "gguf_float_max_rows", torch.bfloat16: "gguf_bf16_max_rows"}.get(dtype)
    if rule is not None and not gpu:
        return cpu_ops.rule(rule, lambda: _timed_gguf_float_max_rows(ops, dtype, device))
    return _timed_gguf_float_max_rows(ops, dtype, device)


def _timed_gguf_float_max_rows(ops, dtype: torch.dtype, device: str) -> int:
    gpu = device != "cpu"
    packed = not gpu and torch.backends.mkldnn.is_available()
    weights = []
    for codes, scales in sample_q4_1_weights(SAMPLE_WEIGHTS * 4 // dtype.itemsize):
        blocks = GGUFWeight(codes.to(device), scales.to(device), Q4_1, SAMPLE_IN_FEATURES, ops)
        blocks.lay_out_panels()
        weight = blocks.dequantize().to(dtype)
        weights.append((blocks, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) if packed else weight))

    def floats(x):
        for _, weight in weights:
            if packed:
                torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
            else:
                F.linear(x, weight)
        if gpu:
            torch.cuda.synchronize(device)

    def blocks(x):
        for weight, _ in weights:
            weight.matmul(x)
        if gpu:
            torch.cuda.synchronize(device)

    generator = torch.Generator().manual_seed(1)
    chosen = 0 if gpu else 1
    for rows in ((1,) if gpu else ()) + GGUF_FLOAT_ROWS:
        x = torch.randn(rows, SAMPLE_IN_FEATURES, generator=generator).to(dtype).to(device)
        times = best_times({"blocks": lambda: blocks(x), "floats": lambda: floats(x)}, rounds=3)
        if times["blocks"] > _FLOAT_MARGIN * times["floats"]:
            break
        chosen = rows
    logger.info("%s products of up to %d rows read the GGUF blocks on %s, longer ones the float weights", dtype, chosen, device)
    return chosen
