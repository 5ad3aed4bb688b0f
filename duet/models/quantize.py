"""Weights quantized at load time (``quantization: int8 | int4 | w8a8``) for any model loaded from floats.

Each ``Linear`` (attention and MLP projections, the LM head) becomes rows of 32-weight blocks in
GGUF's own layouts, computed by the same kernels as a GGUF checkpoint's blocks
(``kernels.gguf``: C++ on CPU, Triton on a GPU), and its float weight is dropped:

- ``int8``: Q8_0, symmetric, one fp16 scale per 32 weights: 1.125 bytes a weight resident (the
  scales widened to fp32 once, ``kernels.gguf``). Finer than a scale per output channel for an
  eighth of a byte more, and the decode kernels already read it.
- ``int4``: Q4_1, a scale and a minimum (fp16) per 32 weights: 0.75 byte a weight resident.
- ``w8a8``: llm-compressor's W8A8 scheme, computed as a checkpoint of it is (``duet.models.
  packed``): int8 codes with one scale per output channel (its largest magnitude over 127.5, as
  compressed-tensors' min-max observer has it) and each product's input quantized per token at
  run time, so that the products go in integers where the CPU measured that faster
  (``kernels.w8a8``). The LM head stays in floats, as llm-compressor's recipes leave it.

The int8 and int4 blocks are made by ``gguf.quants`` (llama.cpp's reference quantizers). The
token embedding stays in floats (a step reads one row of it per token), as do a mixture of
experts' experts.
"""

from __future__ import annotations

import logging

import torch

from duet.kernels.gguf import BLOCK, Q4_1, Q8_0, GGUFWeight
from duet.kernels.w8a8 import INT8_PER_TOKEN, per_token_codes
from duet.models.linear import Linear

LOAD_TIME_QUANTIZATIONS = {"int8": Q8_0, "int4": Q4_1, "w8a8": Q8_0}

logger = logging.getLogger(__name__)


class QuantizationError(ValueError):
    """The model or machine cannot run this quantization; the message says what to change."""


def quantize_blocks(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """An ``[out, in]`` float weight as GGUF rows of blocks (uint8 ``[out, in / 32 * block bytes]``)."""
    import gguf

    rows = weight.detach().float().cpu().numpy()
    return torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType(qtype)))


def per_channel_int8(weight: torch.Tensor, backend) -> GGUFWeight:
    """An ``[out, in]`` float weight as W8A8 quantizes it: each output channel's row as
    ``per_token_codes`` quantizes an input row in fp32 (the same min-max rule), as Q8_0 blocks
    whose every block of a row has the row's scale."""
    codes, scale = per_token_codes(weight.detach().float(), INT8_PER_TOKEN)
    in_features = weight.shape[1]
    return GGUFWeight(codes.to(torch.int8).view(torch.uint8), scale.expand(-1, in_features // BLOCK).contiguous(), Q8_0, in_features, backend)


def quantize_linears(model: torch.nn.Module, quantization: str, backend) -> int:
    """Replace every Linear's float weight by its ``quantization`` blocks, computed with ``backend``
    (``cpu_ops.load_gguf()`` or ``kernels.triton_gguf``), but W8A8's LM head; the number of weights
    quantized."""
    qtype = LOAD_TIME_QUANTIZATIONS[quantization]
    count = 0
    for name, linear in model.named_modules():
        if not isinstance(linear, Linear) or (quantization == "w8a8" and name == "lm_head"):
            continue
        if linear.in_features % BLOCK:
            raise QuantizationError(f"quantization={quantization!r}: {name} has {linear.in_features} input features, not a multiple of {BLOCK}")
        if quantization == "w8a8":
            linear.attach_gguf(per_channel_int8(linear.weight, backend))
        else:
            blocks = quantize_blocks(linear.weight, qtype).to(linear.weight.device)
            linear.attach_gguf(GGUFWeight.from_blocks(blocks, qtype, linear.in_features, backend))
        linear.keep_blocks_only()
        if quantization == "w8a8":
            linear.input_quantization = INT8_PER_TOKEN
            linear.use_int8_products()
        count += linear.out_features * linear.in_features
    logger.info("quantized %d weights to %s (GGUF type %d) at load time", count, quantization, qtype)
    return count
