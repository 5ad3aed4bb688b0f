"""How the products' inputs are quantized before them, per Linear, as a checkpoint that ships
quantized says (W8A8's and FP8's schemes): a ``kernels.w8a8`` scheme name for a dynamic one (each
row's own scale), a ``StaticInput`` for a static one (the checkpoint's calibrated ``input_scale``
and ``input_zero_point`` for the whole tensor; the parts of a fused product read one input, so
they must share them). Read at load by ``duet.models.loader``."""

from __future__ import annotations

from pathlib import Path

import torch

from duet.errors import DamagedCheckpointError, UnsupportedCheckpointError
from duet.kernels.w8a8 import FLOAT8_STATIC, INT8_STATIC, StaticInput
from duet.models.packed import PackedScheme


def input_schemes(
    linears: dict[str, list[str]], state: dict[str, torch.Tensor], path: Path, scheme: PackedScheme | None, packed
) -> dict[str, object]:
    """How each Linear whose weight ships quantized (``packed``) quantizes its input first, by
    module name (``linears``: each Linear's checkpoint weights): none for weight-only schemes. (A
    quantized weight that is no Linear's, a MoE's experts, is refused where it is found packed.)"""
    if scheme is None or scheme.activations is None:
        return {}
    quantized = {name: parts for name, parts in linears.items() if name in packed}
    if scheme.activations not in (INT8_STATIC, FLOAT8_STATIC):
        return {name: scheme.activations for name in quantized}
    statics = static_inputs(state, quantized, scheme, path)
    missing = sorted(set(quantized) - set(statics))
    if missing:
        raise DamagedCheckpointError(f"{path}: no input_scale for {', '.join(quantized[missing[0]])}, which a static scheme needs")
    return statics


def static_inputs(state: dict[str, torch.Tensor], linears: dict[str, list[str]], scheme: PackedScheme, path: Path) -> dict[str, StaticInput]:
    """Each Linear's ``StaticInput`` (by module name; ``linears``: the checkpoint weights each is
    made of) from its parts' calibrated ``input_scale`` (and ``input_zero_point``), taken out of
    ``state``: a fused product's parts read one input, so they must share them. A static scale
    left over (a weight duet computes from floats) is refused."""
    inputs = {}
    for name, parts in linears.items():
        bases = [part.removesuffix(".weight") for part in parts]
        if not any(base + ".input_scale" in state for base in bases):
            continue
        found = []
        for suffix in (".input_scale", ".input_zero_point"):
            tensors = [state.pop(base + suffix, None) for base in bases]
            if suffix == ".input_scale" and any(tensor is None or tensor.numel() != 1 for tensor in tensors):
                raise DamagedCheckpointError(f"{path}: {', '.join(bases)} need one input_scale each for a static scheme a tensor")
            if any((tensor is None) != (tensors[0] is None) or (tensor is not None and not torch.equal(tensor, tensors[0])) for tensor in tensors):
                raise UnsupportedCheckpointError(f"{path}: {', '.join(bases)} quantize their one input with different {suffix[1:]}s, and are computed as one product")
            found.append(None if tensors[0] is None else tensors[0].reshape(()))
        inputs[name] = StaticInput(scheme.activations, found[0], found[1] if scheme.activations == INT8_STATIC else None)
    stray = sorted(name for name in state if name.endswith((".input_scale", ".input_zero_point")))
    if stray:
        raise UnsupportedCheckpointError(f"{path}: {stray[0]} quantizes an input that duet computes in floats (quantized experts are not built)")
    return inputs
