"""The small per-layer ops of a Llama block, fused on CPU, plain torch elsewhere.

Each function has one torch implementation (the reference, used on GPU and wherever the
C++ kernels are unavailable) and, on CPU, one call into ``cpu_ops``. Numerics follow
transformers: fp32 maths, rounded to the model dtype where transformers rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from duet.kernels import cpu_ops
from duet.kernels.kv_quant import is_quantized, rotate


def _native(x: torch.Tensor):
    return cpu_ops.load() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _native(x)
    if ops is None:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    out = x.contiguous().clone()
    ops.rms_norm(out, out, weight, eps, False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place; returns the normalised new residual (may reuse ``x``'s memory)."""
    ops = _native(x)
    if ops is None:
        residual.add_(x)
        return weight * F.rms_norm(residual.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    x = x.contiguous()
    ops.rms_norm(x, residual, weight, eps, True)
    return x


def greedy_argmax(logits: torch.Tensor, excluded_token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's argmax once its ``excluded_token_ids`` (``[rows, E]``, -1 for none) are -inf:
    the token greedy sampling takes (the first of equal logits, as ``torch.argmax``)."""
    rows, columns = (excluded_token_ids >= 0).nonzero(as_tuple=True)
    if rows.numel():
        logits = logits.index_put((rows, excluded_token_ids[rows, columns]), logits.new_tensor(float("-inf")))
    return logits.argmax(dim=-1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over ``x``'s first ``2 * cos.shape[-1]`` features (all of a head, or its rotary part)."""
    rotary = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary].float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:].float()), dim=-1).to(x.dtype)


def rope_and_write_kv(q, k, v, positions, cos_table, sin_table, key_cache, value_cache, slot_mapping):
    """Apply RoPE to ``q`` and ``k`` in place and store ``k``, ``v`` at their cache slots; with a
    quantized cache, ``q`` leaves in the cache's Hadamard basis (``kv_quant.rotate``), where
    ``paged_attention`` reads it."""
    ops = _native(q)
    if ops is not None:
        ops.rope_and_cache(q, k, v, positions, cos_table, sin_table, key_cache, value_cache, slot_mapping)
        return
    from duet.kernels import write_kv_cache

    cos = cos_table[positions][:, None, :]
    sin = sin_table[positions][:, None, :]
    q.copy_(rotate_half(q, cos, sin))
    k.copy_(rotate_half(k, cos, sin))
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
    if is_quantized(key_cache):
        q.copy_(rotate(q))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]``."""
    width = x.shape[-1] // 2
    ops = _native(x)
    if ops is None:
        return F.silu(x[..., :width]) * x[..., width:]
    out = torch.empty(x.shape[0], width, dtype=x.dtype)
    ops.silu_and_mul(out, x.contiguous())
    return out
