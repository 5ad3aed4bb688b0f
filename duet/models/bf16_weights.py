"""``quantization: bf16``: a bf16 checkpoint on a CPU that computes in fp32 keeps its linear
weights in bf16.

Every bf16 is an fp32 (its upper 16 bits), so widening the weights at load time, as duet does by
default, changes no value but doubles their memory. With this setting each ``Linear`` (attention
and MLP projections, the LM head) whose checkpoint parts are all bf16 keeps them as the C++
kernels' BF16 blocks (``kernels.gguf.bf16_blocks``), widened in registers as each product reads
them: the products are those of the widened weights, at half the memory. Products of more rows
than the blocks serve (``Linear.keep_blocks_only``) widen the weight for the call, as quantized
weights do. The token embedding (a row a token), Linears whose input features are not a whole
number of 32-weight blocks and a mixture of experts' experts stay widened. It is for memory, not
speed, and not the default: on a 2-core AMD EPYC (Zen 4, AVX2) the blocks decoded one stream at
0.83-1.10x the widened weights' speed (by which ran first), a batch of 32 at 0.68-0.74x and a
512-token prompt at 0.84-0.87x (docs/benchmarks.md): two cores' fp32 products of that model are
bound by their arithmetic more than by the bytes they read.
"""

from __future__ import annotations

import torch

from duet.kernels.gguf import BLOCK, bf16_blocks
from duet.models.linear import Linear


def bf16_linears(model: torch.nn.Module, raw_state: dict[str, torch.Tensor], parts: dict[str, list[str]], dtype: torch.dtype,
                 device: str, quantization: str | None, skip=()) -> list[str]:
    """The Linears (by module name; ``parts``: each one's checkpoint tensors) that keep their bf16
    weights under ``quantization: bf16``: all of their parts bf16 and their input features a whole
    number of blocks; ``skip``: those that already have blocks of their own. ``QuantizationError``
    where the setting cannot apply (its message says why)."""
    if quantization != "bf16":
        return []
    from duet.kernels import cpu_ops
    from duet.models.quantize import QuantizationError

    if dtype != torch.float32 or device != "cpu":
        raise QuantizationError(
            f"quantization='bf16' keeps a bf16 checkpoint's weights for a model that computes in float32 on CPU, not {dtype} on {device}; "
            "with dtype bfloat16 the weights are bf16 already"
        )
    if cpu_ops.load_gguf() is None:
        raise QuantizationError("quantization='bf16' computes on duet's C++ kernels, which are off (DUET_CPU_OPS=0) or did not build here")
    names = [
        name for name, module in model.named_modules()
        if isinstance(module, Linear) and name not in skip and module.in_features % BLOCK == 0
        and all(part in raw_state and raw_state[part].dtype == torch.bfloat16 for part in parts[name])
    ]
    if not names:
        dtypes = sorted({str(raw_state[part].dtype).removeprefix("torch.") for name in parts for part in parts[name] if part in raw_state})
        raise QuantizationError(f"quantization='bf16' keeps bf16 weights, and this checkpoint's linear weights are {', '.join(dtypes)}")
    return names


def keep_bf16(linear: Linear, weight: torch.Tensor) -> None:
    """Make ``weight`` (bf16, ``[out, in]``) the Linear's only weight, as BF16 blocks."""
    from duet.kernels import cpu_ops

    linear.attach_gguf(bf16_blocks(weight, cpu_ops.load_gguf()))
    linear.keep_blocks_only(torch.float32)  # (bf16_linears keeps them for fp32 models alone)
