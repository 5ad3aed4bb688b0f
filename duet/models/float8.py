"""Float8 (e4m3fn) checkpoints, their weights kept as float8 (``kernels.gguf.float8_blocks``):

- compressed-tensors' ``float-quantized`` (llm-compressor's FP8 and FP8_DYNAMIC, W8A8): a scale
  per output channel or per tensor (``x.weight_scale``), inputs quantized to float8 too, per token
  or at a calibrated scale (``duet.models.packed``'s activation schemes);
- Hugging Face's own ``quant_method: fp8`` (transformers' ``FineGrainedFP8Config``: Qwen 3's and
  DeepSeek's FP8 releases): a scale per block of ``weight_block_size`` weights (128 x 128 as they
  ship; ``x.weight_scale_inv``, the factor the weights are multiplied by), or one per tensor
  without it. Their ``activation_scheme: dynamic`` quantizes each input per token and group of
  128 features where a GPU computes in float8; on a CPU transformers dequantizes the weights and
  multiplies the inputs as they are, and so does duet, on any device: the inputs stay in floats.

Either way the weight is ``w.float() * s`` rounded once, the scale widened to fp32 (exact) and
laid beside each block of 32 input features it covers: what transformers (and compressed-tensors)
compute from these checkpoints on a CPU, bit for bit. A NaN code (0x7F, 0xFF), which no
quantizer writes, is refused as damage.
"""

from __future__ import annotations

from pathlib import Path

import torch

from duet.errors import DamagedCheckpointError, UnsupportedCheckpointError
from duet.kernels.gguf import BLOCK, GGUFWeight, float8_blocks

COMPRESSED_TENSORS = "float-quantized"  # compressed-tensors' format name
HUGGING_FACE = "fp8"  # transformers' quant_method


def check_compressed_tensors(args: dict, refuse) -> None:
    """compressed-tensors' FP8 weight args: e4m3, symmetric, a scale per channel or per tensor."""
    checks = (
        ("type", args.get("type") == "float", "'float'"), ("num_bits", args.get("num_bits") == 8, "8"),
        ("symmetric", args.get("symmetric") is True, "true"), ("strategy", args.get("strategy") in ("channel", "tensor"), "'channel' or 'tensor'"),
        ("dynamic", not args.get("dynamic"), "false"),
    )
    for field, ok, wanted in checks:
        if not ok:
            refuse(f"weights.{field}", args.get(field), wanted)


def hugging_face_block(config: dict, refuse) -> tuple[int, int] | None:
    """The weight block of a ``quant_method: fp8`` config (rows, input features; None: a scale per
    tensor), after refusing what duet does not compute as transformers does on a CPU."""
    if config.get("fmt", "e4m3") != "e4m3":
        refuse("fmt", config.get("fmt"), "'e4m3' float8 weights")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        refuse("activation_scheme", config.get("activation_scheme"), "'dynamic' (inputs computed in floats, as transformers on a CPU)")
    if config.get("scale_fmt") not in (None, "float", "ue8m0"):
        refuse("scale_fmt", config.get("scale_fmt"), "'float' or 'ue8m0' scales")
    block = config.get("weight_block_size")
    if block is None:
        return None
    if len(block) != 2 or any(not isinstance(size, int) or size <= 0 for size in block) or block[1] % BLOCK:
        refuse("weight_block_size", block, f"[rows, columns] with columns a multiple of {BLOCK}")
    return block[0], block[1]


def float8_weight(state: dict[str, torch.Tensor], parts: list[str], scheme, path: Path, ops) -> GGUFWeight:
    """The float8 weights ``parts`` (rows of one product) as the kernels' float8 blocks, each part's
    scales beside its rows' blocks. ``scheme``: the checkpoint's (``PackedScheme``: its format, and
    ``float8_block`` for Hugging Face's)."""
    suffix = "_scale_inv" if scheme.format == HUGGING_FACE else "_scale"
    weights, scales = [], []
    for part in parts:
        if part + suffix not in state:
            raise DamagedCheckpointError(f"{path}: tensor {part}{suffix} is missing")
        weight, scale = state[part], state[part + suffix].float()
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise UnsupportedCheckpointError(f"{path}: {part} has {in_features} input features, not a multiple of {BLOCK}")
        if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():
            raise DamagedCheckpointError(f"{path}: {part} holds NaN codes, which no quantizer writes")
        weights.append(weight)
        scales.append(_block_scales(scale, out_features, in_features, scheme, f"{path}: {part}{suffix}"))
    return float8_blocks(torch.cat(weights), torch.cat(scales), ops)


def _block_scales(scale: torch.Tensor, out_features: int, in_features: int, scheme, name: str) -> torch.Tensor:
    """A weight's scales (one per channel or tensor; Hugging Face's: one per block of
    ``float8_block``, the last blocks of a row or column partial) as one per 32-weight block,
    ``[out, in / 32]``."""
    num_blocks = in_features // BLOCK
    block = getattr(scheme, "float8_block", None)
    if scheme.format == HUGGING_FACE and block is not None:
        rows, columns = block
        grid = (-(-out_features // rows), -(-in_features // columns))
        if scale.shape != grid:
            raise DamagedCheckpointError(f"{name} has shape {tuple(scale.shape)} where blocks of {rows} x {columns} give {grid}")
        return scale.repeat_interleave(rows, dim=0)[:out_features].repeat_interleave(columns // BLOCK, dim=1)[:, :num_blocks].contiguous()
    if scale.numel() == 1 or (scheme.format != HUGGING_FACE and scale.numel() == out_features):
        return scale.reshape(-1, 1).expand(out_features, num_blocks)
    wanted = "not one scale" if scheme.format == HUGGING_FACE else "neither one scale nor one a channel"
    raise DamagedCheckpointError(f"{name} has shape {tuple(scale.shape)}: {wanted}")
