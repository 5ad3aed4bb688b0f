"""Engine configuration: frozen dataclasses, validated at construction, never mutated.

Each component receives the scalars it needs, not these objects; derived values are
returned by methods, not written back.
"""

from __future__ import annotations

import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from duet.dtypes import resolve_dtype, resolve_kv_cache_dtype
from duet.errors import ConfigError


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


def _known_settings(cls, name: str, settings: dict) -> dict:
    """``settings`` if each is a field of the dataclass ``cls``; a ``ConfigError`` naming the others."""
    unknown = sorted(set(settings) - set(cls.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"{name}: unknown settings {unknown}; known are {sorted(cls.__dataclass_fields__)}")
    return settings


SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, from the ``speculative_config`` dict (vLLM's names).

    ``ngram`` copies what followed an earlier occurrence of the context's last tokens;
    ``draft_model`` runs a smaller model sharing the tokenizer (``model``); ``layer_skip`` runs
    the target's first ``num_draft_layers`` layers with its final norm and LM head. The draft
    model's weights follow ``quantization`` (as the engine's; default: the target's int8/int4
    or float choice).
    With ``adaptive`` each request drafts, each step, the number of tokens (0 to
    ``num_speculative_tokens``) that maximises expected tokens per second, from the measured
    cost of a step and its own acceptance so far (see ``duet.spec_decode.policy``); without it
    every request drafts ``num_speculative_tokens``. No request speculates while
    ``disable_by_batch_size`` or more are running.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and (self.method != "draft_model" or self.quantization not in QUANTIZATIONS):
            raise ConfigError(
                f"speculative_config.quantization={self.quantization!r}: a draft_model's weights take one of "
                f"{', '.join(str(q) for q in QUANTIZATIONS[1:])}"
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method={self.method!r}: use one of {', '.join(SPECULATIVE_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model (the draft's alias or path) is required for, and only for, method 'draft_model'")
        if (self.method == "layer_skip") != (self.num_draft_layers is not None):
            raise ConfigError("speculative_config.num_draft_layers is required for, and only for, method 'layer_skip'")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ConfigError(f"speculative_config.num_draft_layers must be at least 1, got {self.num_draft_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(f"speculative_config.disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_dict(cls, settings: dict) -> SpeculativeConfig:
        _known_settings(cls, "speculative_config", settings)
        if "method" not in settings or "num_speculative_tokens" not in settings:
            raise ConfigError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**settings)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a proposer writes while drafting (n-gram writes none)."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens


@dataclass(frozen=True)
class KVTransferConfig:
    """The KV connector: how this engine's prompt KV goes to, or comes from, other replicas
    (vLLM's ``kv_transfer_config``). ``name`` tells this engine apart in transfer pair keys;
    ``host`` is the address its workers listen on (``auto``: the Ray node's); ``timeout_s`` bounds
    every wait on data that must come. ``connector`` is the workers' side, by import path."""

    name: str = "engine"
    host: str = "127.0.0.1"
    timeout_s: float = 30.0
    connector: str = "duet.kv_transfer.connector:KVConnectorWorker"
    stream_layers: bool = True  # a prompt's KV goes as the forward writes each layer (False: once it is done)
    shared_memory: bool = True  # between replicas on one machine, through /dev/shm rather than a socket (kv_transfer/shm.py)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"kv_transfer_config.timeout_s must be positive, got {self.timeout_s}")

    @classmethod
    def from_dict(cls, settings: dict) -> KVTransferConfig:
        return cls(**_known_settings(cls, "kv_transfer_config", settings))


KV_OFFLOAD_TIERS = ("cpu", "disk")
KV_OFFLOAD_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class KVOffloadConfig:
    """A second KV tier behind the paged pool (``duet.kv_tier``), from the ``kv_offload`` dict:
    ``tier`` cpu (host memory) or disk (a file under ``path``), ``size_gib`` per rank, ``dtype``
    auto (the pool's bytes, exact) or int8 (a float pool's rows as the int8 KV cache stores them:
    about 4x the blocks of fp32, not exact)."""

    tier: str = "cpu"
    size_gib: float = 1.0
    path: str | None = None
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.tier not in KV_OFFLOAD_TIERS:
            raise ConfigError(f"kv_offload.tier={self.tier!r}: use one of {', '.join(KV_OFFLOAD_TIERS)}")
        if not isinstance(self.size_gib, (int, float)) or isinstance(self.size_gib, bool) or self.size_gib <= 0:
            raise ConfigError(f"kv_offload.size_gib must be a positive number, got {self.size_gib!r}")
        if (self.tier == "disk") != (self.path is not None):
            raise ConfigError("kv_offload.path (a folder for the tier's file) is required for, and only for, tier 'disk'")
        if self.dtype not in KV_OFFLOAD_DTYPES:
            raise ConfigError(f"kv_offload.dtype={self.dtype!r}: use one of {', '.join(KV_OFFLOAD_DTYPES)}")

    @property
    def quantized(self) -> bool:
        """Whether the tier keeps the pool's rows as int8 ones (a float pool's: ``EngineArgs`` refuses others)."""
        return self.dtype == "int8"

    def check_fits(self) -> None:
        """A ``ConfigError`` naming the setting unless the tier fits where it goes on this node:
        its size in the memory available, or its folder writable with room for it."""
        size = self.size_gib * 2**30
        if self.tier == "cpu":
            available = _available_memory_bytes()
            if available is not None and size > available:
                raise ConfigError(
                    f"kv_offload.size_gib={self.size_gib} does not fit this node's available memory ({available / 2**30:.1f} GiB)"
                )
            return
        if not os.path.isdir(self.path) or not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"kv_offload.path={self.path!r} is not a folder this process can write")
        free = shutil.disk_usage(self.path).free
        if size > free:
            raise ConfigError(f"kv_offload.size_gib={self.size_gib} does not fit the {free / 2**30:.1f} GiB free under {self.path}")

    def num_blocks(self, bytes_per_block: int) -> int:
        """The blocks of ``bytes_per_block`` (one rank's) that ``size_gib`` holds."""
        return int(self.size_gib * 2**30) // bytes_per_block

    @classmethod
    def from_dict(cls, settings: dict) -> KVOffloadConfig:
        return cls(**_known_settings(cls, "kv_offload", settings))


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


EXECUTOR_BACKENDS = {"uni": "duet.executor:UniprocExecutor", "ray": "duet.cluster.ray_executor:RayExecutor"}


def import_object(import_path: str):
    """``module:attribute``: a plugin the config names (an executor, a KV connector), loaded
    only when used, as vLLM names its connectors."""
    module, _, attribute = import_path.partition(":")
    return getattr(importlib.import_module(module), attribute)


QUANTIZATIONS = (None, "gguf", "dequantized", "bf16", "int8", "int4", "w8a8")


@dataclass(frozen=True)
class EngineArgs:
    """Everything ``LLM(...)`` accepts, with vLLM's names. Model-dependent limits are checked by the engine."""

    model: str = "smollm2"
    dtype: str = "float32"
    # None: compute from a GGUF checkpoint's own blocks where that is exact and runs here (CPU,
    # float32); "gguf": insist on it; "dequantized": the float weights alone; "bf16": a bf16
    # checkpoint's linear weights kept in bf16 while the model computes in float32 on CPU (half
    # the memory, the same tokens: duet.models.bf16_weights); "int8" / "int4" /
    # "w8a8": linear weights (and for w8a8 their inputs) quantized at load time, any model
    # (duet.models.quantize).
    quantization: str | None = None
    device: str = "cpu"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8_e4m3 (fp8)
    enable_prefix_caching: bool = True
    speculative_config: dict | None = None
    kv_transfer_config: dict | None = None
    kv_offload: dict | None = None  # a second KV tier: {tier: cpu | disk, size_gib: N, path: folder}
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # a mixture of experts' ranks hold whole experts (else a share of each)
    # None: in this process for one rank, Ray actors for several.
    distributed_executor_backend: str | None = None
    lora_modules: dict | None = None  # LoRA adapters requests may name: {name: PEFT adapter folder} (duet.lora)
    max_lora_rank: int = 64
    max_loras: int = 4  # LoRA adapters held at once; another is loaded in place of the least recently used
    # Adapters kept in host memory, those held included (vLLM's): an adapter unloaded for another is read
    # again from there, not from its folder, while the newest max_cpu_loras - max_loras are kept. None: max_loras.
    max_cpu_loras: int | None = None
    batch_invariant: bool = False  # a request's values the same whatever shares its steps (duet.models.batch_invariant)
    enforce_eager: bool = False  # on a GPU: no CUDA graphs of the decode step (duet.cuda_graphs)
    # Decode rows that share a prefix's blocks attend to them once for the group (duet.kernels.cascade):
    # auto where this CPU measured it faster, on for every group, off (vLLM's --disable-cascade-attn).
    cascade_attention: str = "auto"

    def __post_init__(self) -> None:
        for name in ("batch_invariant", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.cascade_attention not in ("auto", "on", "off"):
            raise ConfigError(f"cascade_attention must be auto, on or off, got {self.cascade_attention!r}")
        if self.cascade_attention == "on" and self.batch_invariant:
            raise ConfigError(
                "cascade_attention='on' adds a row's attention in an order that depends on the batch, which batch_invariant "
                "forbids: leave cascade_attention at auto (off under batch_invariant) or set batch_invariant=False"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be an alias such as 'smollm2' or a path to a Hugging Face model directory")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device={self.device!r} is not supported; use 'cpu' or 'cuda[:N]'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ConfigError(
                f"distributed_executor_backend={self.distributed_executor_backend!r}: use one of {', '.join(EXECUTOR_BACKENDS)}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be a positive integer, got {self.pipeline_parallel_size!r}")
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size={self.pipeline_parallel_size} runs "
                "a worker per rank: use distributed_executor_backend='ray' (or leave it unset)"
            )
        if self.pipeline_parallel_size > 1:
            speculative = self.speculative()
            if speculative is not None and speculative.method != "ngram":
                raise ConfigError(
                    f"pipeline parallelism with speculative_config.method={speculative.method!r} is not built yet (its draft "
                    "would run beside the stages); use method 'ngram'"
                )
        resolve_kv_cache_dtype(self.kv_cache_dtype, resolve_dtype(self.dtype, self.device))
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r} is not supported; use one of {QUANTIZATIONS}")
        self.cache_config()
        self.speculative()
        self.kv_transfer()
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ConfigError(f"max_loras must be a positive integer, got {self.max_loras!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
            raise ConfigError(f"max_cpu_loras must be an integer of at least max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in self.lora_modules.items()):
                raise ConfigError("lora_modules must map adapter names to PEFT adapter folders")
            for name, path in self.lora_modules.items():
                if not (Path(path) / "adapter_config.json").is_file():
                    raise ConfigError(f"lora_modules.{name}: no PEFT adapter at {path} (its adapter_config.json)")
        offload = self.kv_offload_config()
        if offload is not None:
            if not self.enable_prefix_caching:
                raise ConfigError("kv_offload keeps blocks the prefix cache evicts: it needs enable_prefix_caching")
            if offload.dtype == "int8" and self.kv_cache_dtype != "auto":  # one byte a value already
                raise ConfigError(f"kv_offload.dtype=int8 compresses a float KV cache; kv_cache_dtype={self.kv_cache_dtype!r} is not one")
            offload.check_fits()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def executor(self) -> str:
        """The executor's import path: the one named, else in-process for one rank, Ray actors for several."""
        backend = self.distributed_executor_backend or ("uni" if self.world_size == 1 else "ray")
        return EXECUTOR_BACKENDS[backend]

    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    def kv_transfer(self) -> KVTransferConfig | None:
        return None if self.kv_transfer_config is None else KVTransferConfig.from_dict(self.kv_transfer_config)

    def kv_offload_config(self) -> KVOffloadConfig | None:
        return None if self.kv_offload is None else KVOffloadConfig.from_dict(self.kv_offload)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory_gib, self.enable_prefix_caching)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """Scheduler limits; ``max_model_len`` defaults to, and may not exceed, the model's own."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ConfigError(f"max_model_len={max_model_len} exceeds the model's maximum of {model_max_len} positions")
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len, self.enable_chunked_prefill)
