"""GPTQ and AWQ checkpoints written by GPTQModel itself, as they are published:
``gptq_checkpoints`` quantizes float checkpoints with GPTQModel's own GPTQ or AWQ (calibrated on
random token ids) and saves it in the format it ships in (``gptq``; AWQ's ``gemm`` or
``gemv``), then writes each quantized linear's weight as GPTQModel's own code dequantizes it (the
reference for the format's conventions: packing order, zero offsets, groups).

GPTQModel has no dequantization of AWQ's ``gemv`` and ``gemv_fast`` layouts (nor llm-awq's,
``gemv_fast``'s packing), and refuses to write them for a CPU device (its kernels for them are
CUDA's; the packing is torch's, on any device): such a job lifts that device check and also
writes a ``gemm`` twin from the same source in the same process, whose codes, zeros and scales
come out the same (AWQ's search is deterministic on a CPU, from the same seed), and the twin's
dequantization is the reference. Both load the source in fp16, the only dtype GPTQModel's
``gemv`` and ``gemv_fast`` layers take.

GPTQModel requires a newer torch than duet pins, and a CUDA one from the index; its CPU path
needs none of that. So it is installed once, without its dependencies, into a folder of the
test cache with the few pure-Python ones it imports (``TOOLS``, ``tests.tool_install``), and runs
in a child process (this file as a script) whose path starts there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

TOOLS = (
    "gptqmodel==7.7.0", "pypcre==0.6.4", "logbar==0.4.15", "threadpoolctl==3.8.0", "device-smi==0.5.7", "tokenicer==0.0.14",
    "defuser==0.0.28",
)


@dataclass(frozen=True)
class Quantization:
    """One checkpoint to write: ``source`` quantized by GPTQModel's ``method`` (gptq, awq) into
    ``target`` (``group_size`` -1: a scale per output channel); its dequantized weights, by
    GPTQModel, in ``reference``."""

    source: Path
    target: Path
    reference: Path
    bits: int
    group_size: int
    sym: bool
    desc_act: bool = False
    method: str = "gptq"
    format: str = "gemm"  # AWQ's: gemm, gemv, gemv_fast or llm-awq


def gptq_checkpoints(quantizations: list[Quantization], logs: Path) -> None:
    """Write each checkpoint, all in one child process (GPTQModel takes seconds to import);
    GPTQModel's logs go to ``logs``."""
    from tests.tool_install import tools_dir

    settings = [{name: str(value) if isinstance(value, Path) else value for name, value in asdict(job).items()} for job in quantizations]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(tools_dir("gptqmodel", TOOLS)), os.environ.get("PYTHONPATH", "")]),
        "GPTQMODEL_CPU_WORKERS": "2",  # its thread pools want two at least, whatever the machine has
    }
    logs.mkdir(parents=True, exist_ok=True)
    # -P: not this file's folder first on the path, where tests/kernels/ would stand for the
    # Hugging Face `kernels` that transformers imports.
    run = subprocess.run(  # GPTQModel writes its logs to ./logs
        [sys.executable, "-P", __file__, json.dumps(settings)], env=env, cwd=logs, capture_output=True, text=True, timeout=1800,
    )
    if run.returncode != 0:
        targets = ", ".join(job["target"] for job in settings)
        raise RuntimeError(f"GPTQModel failed to write {targets}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")


def _write(settings: dict) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import save_file

    awq = settings["method"] == "awq"
    gemv = awq and settings["format"] != "gemm"  # a gemv layout: written beside its gemm twin
    if gemv:
        _quantize(settings | {"target": settings["target"] + "-gemm-twin", "format": "gemm"}, torch.float16)
    _quantize(settings, torch.float16 if gemv else None)
    weights = {}
    if awq:  # its functional dequantization, on the tensors as saved (a gemv checkpoint's gemm twin's)
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
        from safetensors.torch import load_file

        state = load_file(str(Path(settings["target"] + ("-gemm-twin" if gemv else "")) / "model.safetensors"))
        for name in state:
            if name.endswith(".qweight"):
                base = name[: -len("qweight")]
                tensors = (state[base + suffix] for suffix in ("qweight", "qzeros", "scales"))
                weights[base + "weight"] = dequantize_gemm(*tensors, settings["bits"], settings["group_size"]).T.contiguous()
    else:  # the weights its torch kernel computes with
        quantized = GPTQModel.load(settings["target"], device="cpu", backend=BACKEND.GPTQ_TORCH)
        for name, module in quantized.model.named_modules():
            if isinstance(module, BaseQuantLinear):
                weights[name + ".weight"] = module.dequantize_weight().T.contiguous().cpu()
    Path(settings["reference"]).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(settings["reference"]) / "dequantized.safetensors"))


def _quantize(settings: dict, dtype) -> None:
    """``settings["source"]`` quantized by GPTQModel and saved to ``settings["target"]``, loaded in
    ``dtype`` (None: the checkpoint's)."""
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization import FORMAT, METHOD

    torch.manual_seed(0)
    awq = settings["method"] == "awq"
    if awq and settings["format"] != "gemm":
        from gptqmodel.models._const import DEVICE
        from gptqmodel.nn_modules.qlinear.gemv_awq import AwqGEMVLinear
        from gptqmodel.nn_modules.qlinear.gemv_fast_awq import AwqGEMVFastLinear, LLMAwqLinear

        for layer in (AwqGEMVLinear, AwqGEMVFastLinear, LLMAwqLinear):
            if DEVICE.CPU not in layer.SUPPORTS_DEVICES:
                layer.SUPPORTS_DEVICES = [*layer.SUPPORTS_DEVICES, DEVICE.CPU]
    # GPTQ's act_group_aware is on by default, where its other settings allow it.
    gptq = dict(desc_act=settings["desc_act"], act_group_aware=settings["group_size"] > 0 and not settings["desc_act"])
    method = dict(quant_method=METHOD.AWQ, format=FORMAT(settings["format"])) if awq else gptq
    config = QuantizeConfig(bits=settings["bits"], group_size=settings["group_size"], sym=settings["sym"], **method)
    model = GPTQModel.load(settings["source"], config, device="cpu", **({} if dtype is None else dict(dtype=dtype)))
    vocab = model.model.config.vocab_size
    calibration = [
        {"input_ids": torch.randint(3, vocab, (1, 64)), "attention_mask": torch.ones(1, 64, dtype=torch.long)} for _ in range(16)
    ]
    model.quantize(calibration, batch_size=1)
    model.save(settings["target"])


if __name__ == "__main__":
    for job in json.loads(sys.argv[1]):
        _write(job)
