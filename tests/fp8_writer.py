"""Hugging Face FP8 checkpoints (``quant_method: fp8``, as Qwen 3's and DeepSeek's FP8 releases
ship) written by transformers' own FP8 quantizer: ``Fp8Quantize``, the operation transformers
quantizes a model with for ``FineGrainedFP8Config`` (a scale per block of ``weight_block_size``
weights, stored as ``x.weight_scale_inv``), applied to each decoder linear weight of a float
checkpoint, and the config's own ``to_dict()`` as ``quantization_config``. transformers quantizes
only on a GPU through ``from_pretrained``; the operation itself is plain torch and runs here.
Weights whose shape is no whole number of blocks it leaves in floats, as it does on a GPU."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import torch


def make_hf_fp8_checkpoint(source: Path, target: Path, block: tuple[int, int] | None = (128, 128)) -> Path:
    """``source`` (a float checkpoint of one ``model.safetensors``) with its decoder's linear
    weights quantized by transformers' ``Fp8Quantize`` (``block=None``: a scale per tensor)."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=list(block) if block is not None else None)
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    state = load_file(str(source / "model.safetensors"))
    quantized = {}
    for name, tensor in state.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            quantized.update(quantize.convert({name: tensor}))
        else:
            quantized[name] = tensor
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, target / file.name)
    model_config = json.loads((source / "config.json").read_text())
    model_config["quantization_config"] = json.loads(json.dumps(config.to_dict(), default=str))
    model_config["quantization_config"]["quant_method"] = "fp8"
    (target / "config.json").write_text(json.dumps(model_config, indent=2))
    save_file({name: tensor.contiguous() for name, tensor in quantized.items()}, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
