"""Checkpoints as llm-compressor leaves them, written by compressed-tensors itself
(``make_compressed_checkpoint``).

compressed-tensors 0.20 (the test extras') no longer writes activation ordering by group
(``actorder: group``: GPTQ quantizes the input features in the order of their activations' energy
and groups them in that order, a ``weight_g_idx`` per weight giving each feature's group), which
checkpoints published with it still carry. Such a checkpoint is written by 0.18.0, the last
release that writes it (installed into the test cache, ``tests.tool_install``), running this
file as a script in a child process whose path starts there: not the repository root, where
``kernels/`` would stand for the Hugging Face package transformers probes for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

GROUP_ORDER_TOOLS = ("compressed-tensors==0.18.0",)  # the last release that writes weight_g_idx


def make_compressed_checkpoint(
    source: Path, target: Path, num_bits: int = 4, group_size: int | None = 32, dtype=torch.float32, symmetric: bool = True,
    w8a8: str | None = None, actorder: str | None = None, static_inputs: bool | str = False,
) -> Path:
    """``source`` quantized as llm-compressor leaves a W4A16 / W8A16 checkpoint: compressed-tensors
    itself applies the scheme, computes each group's scale from its min and max (as its min-max
    observer does), packs the codes (``pack-quantized``) and writes ``quantization_config``.
    ``group_size=None`` gives a scale per output channel; the scales take ``dtype``. ``w8a8``:
    llm-compressor's W8A8 schemes instead, inputs quantized per token at run time: ``"int"``
    (INT8: int8 codes saved as they are, ``int-quantized``) or ``"float"`` (FP8_DYNAMIC: float8
    weights, ``float-quantized``). ``actorder``: the weights' activation ordering as GPTQ's
    calibration records it (``"weight"``: groups stay in order; ``"group"``: each weight's input
    features grouped in the order of their inputs' energy on a few prompts, largest first, as
    GPTQ orders them, written by compressed-tensors 0.18.0 in a child process). ``static_inputs``
    (with ``w8a8``): the inputs at one scale a tensor, calibrated as a min-max observer does on a
    few prompts (llm-compressor's static schemes, FP8's default); ``"asymmetric"``: with a zero
    point (int8)."""
    settings = dict(
        source=str(source), target=str(target), num_bits=num_bits, group_size=group_size, dtype=str(dtype).removeprefix("torch."),
        symmetric=symmetric, w8a8=w8a8, actorder=actorder, static_inputs=static_inputs,
    )
    if actorder != "group":
        _write(**settings)
        return target
    from tests.tool_install import tools_dir

    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tools_dir("compressed-tensors-0.18", GROUP_ORDER_TOOLS)), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-P", __file__, json.dumps(settings)], env=env, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"compressed-tensors failed to write {target}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return target


def _write(source: str, target: str, num_bits: int, group_size: int | None, dtype: str, symmetric: bool, w8a8: str | None,
           actorder: str | None, static_inputs: bool | str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    observed = _observed_inputs(model) if static_inputs or actorder == "group" else {}
    args = QuantizationArgs(
        num_bits=num_bits, type=w8a8 or "int", symmetric=symmetric, strategy="group" if group_size else "channel", group_size=group_size,
        actorder=actorder,
    )
    inputs = None
    if w8a8 and static_inputs:
        inputs = QuantizationArgs(num_bits=8, type=w8a8, symmetric=static_inputs != "asymmetric", strategy="tensor", dynamic=False)
    elif w8a8:
        inputs = QuantizationArgs(num_bits=8, type=w8a8, symmetric=True, strategy="token", dynamic=True)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, input_activations=inputs)}, ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                weight = module.weight
                if actorder == "group":  # GPTQ's order: the largest input energy first; groups of features in it
                    order = torch.argsort(observed[name][2], descending=True, stable=True)
                    g_idx = torch.empty_like(order, dtype=torch.int32)
                    g_idx[order] = (torch.arange(len(order)) // group_size).to(torch.int32)
                    module.weight_g_idx.copy_(g_idx)
                    weight = weight[:, order]
                groups = weight.reshape(weight.shape[0], -1, group_size or weight.shape[1])
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
                module.weight_scale.copy_(scale.view_as(module.weight_scale))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero_point.view_as(module.weight_zero_point))
        for name, (low, high, _) in observed.items() if static_inputs else ():
            module = model.get_submodule(name)
            scale, zero_point = calculate_qparams(low.reshape(1), high.reshape(1), inputs)
            module.input_scale.copy_(scale.view_as(module.input_scale))
            if hasattr(module, "input_zero_point"):
                module.input_zero_point.copy_(zero_point.view_as(module.input_zero_point))
    quantization_format = {None: "pack-quantized", "int": "int-quantized", "float": "float-quantized"}[w8a8]
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=quantization_format)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    if actorder == "group":  # the reference: compressed-tensors 0.18's own dequantization (0.20 refuses the config)
        from safetensors.torch import save_file

        save_file(reference_weights(Path(target)), reference_file(Path(target)))


def reference_file(target: Path) -> str:
    """Where a group-ordered checkpoint's reference weights are (``reference_weights``)."""
    return str(target.parent / f"{target.name}-dequantized.safetensors")


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """Each packed weight of the checkpoint at ``path`` as compressed-tensors' own code
    dequantizes it (float-quantized ones as they ship, scaled; a group-ordered one's by its
    ``weight_g_idx``)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    state = load_file(str(path / "model.safetensors"))
    weights = {}
    for name in state:
        if state[name].dtype == torch.float8_e4m3fn:  # float-quantized: the weight as it ships
            weights[name] = dequantize(state[name], state[name + "_scale"], args=args)
        elif state[name].dtype == torch.int8 and name + "_scale" in state:  # int-quantized: int8 codes as they are
            g_idx = state.get(name + "_g_idx")
            weights[name] = dequantize(
                state[name], state[name + "_scale"], state.get(name + "_zero_point"), args=args, **({} if g_idx is None else dict(g_idx=g_idx)),
            )
        elif name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            shape = torch.Size(state[base + "_shape"].tolist())
            codes = unpack_from_int32(state[name], args.num_bits, shape)
            zero_point = None
            if base + "_zero_point" in state:  # packed along the output features
                zero_shape = (shape[0], state[base + "_scale"].shape[1])
                zero_point = unpack_from_int32(state[base + "_zero_point"], args.num_bits, zero_shape, packed_dim=0)
            g_idx = state.get(base + "_g_idx")
            weights[base] = dequantize(codes, state[base + "_scale"], zero_point, args=args, **({} if g_idx is None else dict(g_idx=g_idx)))
    return weights


def _observed_inputs(model) -> dict:
    """Each linear layer's (but the LM head's) smallest and largest input value over a few
    calibration prompts, as llm-compressor's min-max observer records them (zero included), and
    each input feature's energy (its inputs' sum of squares: GPTQ's Hessian diagonal)."""
    observed, hooks = {}, []

    def observe(name):
        def hook(module, args):
            x = args[0].detach().float()
            low, high, energy = observed.get(name, (torch.zeros(()), torch.zeros(()), torch.zeros(x.shape[-1])))
            observed[name] = (torch.minimum(low, x.amin()), torch.maximum(high, x.amax()), energy + x.square().reshape(-1, x.shape[-1]).sum(0))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            hooks.append(module.register_forward_pre_hook(observe(name)))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (4, 48), generator=generator))
    for hook in hooks:
        hook.remove()
    return observed


if __name__ == "__main__":
    _write(**json.loads(sys.argv[1]))


def quantize_inputs_as_compressed_tensors(path: Path):
    """A ``hf_greedy`` ``prepare`` for a float twin of the checkpoint at ``path``: every Linear but
    the LM head quantizes its input by the checkpoint's ``input_activations`` in compressed-tensors'
    own forward (``set_forward_quantized``), as a W8A8 checkpoint's own does; its weights are left
    as they are (already dequantized). For a checkpoint compressed-tensors no longer loads (groups
    out of order)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    inputs = QuantizationArgs(**config["config_groups"]["group_0"]["input_activations"])
    if not inputs.dynamic:
        raise ValueError("static input scales live in the checkpoint's modules, which a float twin lacks")

    def prepare(model) -> None:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.quantization_scheme = QuantizationScheme(targets=["Linear"], input_activations=inputs)
                module.quantization_status = QuantizationStatus.FROZEN
                set_forward_quantized(module)

    return prepare
