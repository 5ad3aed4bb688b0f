"""Engine configuration: frozen dataclasses, validated at construction, never mutated.

Each component receives the scalars it needs, not these objects; derived values are
returned by methods, not written back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


class ConfigError(ValueError):
    """A setting is out of range or inconsistent; the message says what to change."""


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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: blocks of ``block_size`` tokens, ``num_kv_blocks`` of them or as many as fit ``kv_cache_memory_gib``."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")

    def num_blocks(self, bytes_per_block: int) -> int:
        """Blocks to allocate, given what one block costs across all layers."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_memory_gib * 2**30) // bytes_per_block)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: at most ``max_num_seqs`` running and ``max_num_batched_tokens`` computed."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_model_len={self.max_model_len}, or a long prompt could never be scheduled"
            )


@dataclass(frozen=True)
class EngineArgs:
    """Everything ``LLM(...)`` accepts, with vLLM's names. Model-dependent limits are checked by the engine."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be an alias such as 'smollm2' or a path to a Hugging Face model directory")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device={self.device!r} is not supported; use 'cpu' or 'cuda[:N]'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        resolve_dtype(self.dtype, self.device)
        self.cache_config()

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory_gib, self.enable_prefix_caching)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """Scheduler limits; ``max_model_len`` defaults to, and may not exceed, the model's own."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={max_model_len} exceeds the model's maximum of {model_max_len} positions")
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len, self.enable_chunked_prefill)
