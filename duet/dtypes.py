"""The dtypes an engine computes and keeps its KV cache in, from the names users give them,
and whether this CPU multiplies bf16 natively."""

from __future__ import annotations

import functools

import torch

from duet.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when this CPU does bf16 matmuls natively (AVX512_BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """Map a user's dtype name to a torch dtype for ``device``; ``auto`` picks the fast one."""
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
    if dtype == "float16" and not device.startswith("cuda"):
        raise ConfigError("dtype='float16' needs a GPU; on CPU use float32 or bfloat16")
    return _DTYPES[dtype]


# vLLM's names; "fp8" is e4m3, as there. Quantized caches are laid out by ``kernels.kv_quant``.
_KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype: the model's for ``auto``, else one-byte codes with a scale per row."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of auto, {', '.join(_KV_CACHE_DTYPES)}")
    return _KV_CACHE_DTYPES[kv_cache_dtype]
