"""A worker: one rank's model, KV cache and runner, and the workers' side of the KV connector.

The engine's scheduler never touches tensors; an executor hands each step's ``SchedulerOutput``
to its workers (in this process, or as Ray actors) and returns the last rank's ``RunnerOutput``.
A worker builds its own model from the config; one of several tensor-parallel ranks keeps its
shard of it (``duet.models.tensor_parallel``) and talks to the others over a process group.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from duet.config import ConfigError, KVOffloadConfig, KVTransferConfig, SpeculativeConfig, import_object
from duet.dtypes import resolve_dtype, resolve_kv_cache_dtype
from duet.kv_tier import KVTierStore
from duet.messages import KVEndpoint
from duet.outputs import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker builds its part of the engine from: scalars and paths, picklable."""

    model_path: str
    dtype: str
    device: str
    max_model_len: int
    quantization: str | None
    num_blocks: int
    block_size: int
    eos_token_id: int | None
    seed: int = 0
    kv_cache_dtype: str = "auto"
    speculative_config: SpeculativeConfig | None = None
    draft_model_path: str | None = None
    kv_transfer: KVTransferConfig | None = None
    kv_offload: KVOffloadConfig | None = None  # a second KV tier of ``kv_tier_blocks`` blocks
    kv_tier_blocks: int = 0
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter folder) of each adapter requests may name
    max_lora_rank: int = 64
    max_loras: int = 4  # the first of lora_modules held from the start (the others are checked, then loaded when used)
    max_cpu_loras: int = 4  # adapters kept in host memory, the held ones included (``Worker.load_lora``)
    rank: int = 0
    world_size: int = 1  # tensor_parallel_size x pipeline_parallel_size
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # a mixture of experts' ranks hold whole experts (else a share of each)
    # With several ranks: the store they meet at (the executor hosts it), the address this
    # rank's collectives listen on, the bound on any wait for the others, and its threads.
    parallel_store: tuple[str, int] | None = None
    ranks_share_memory: bool = False  # every rank on this machine: collectives through shared memory
    host: str = "127.0.0.1"
    collective_timeout_s: float = 60.0
    num_threads: int | None = None
    batch_invariant: bool = False  # duet.models.batch_invariant
    cascade_attention: str = "off"  # auto | on | off (duet.kernels.cascade)
    cuda_graph_max_num_seqs: int = 0  # the largest decode batch captured in CUDA graphs (duet.cuda_graphs); 0: none

    @property
    def tensor_parallel_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    @property
    def stage_and_rank(self) -> tuple[int, int]:
        """This rank's pipeline stage, and its rank among the stage's tensor-parallel ranks."""
        return divmod(self.rank, self.tensor_parallel_size)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype) -> int:
    """What one block costs across all layers, K and V (a quantized row carries its scale)."""
    from duet.kernels.kv_quant import row_width

    return num_layers * 2 * num_kv_heads * block_size * row_width(head_dim, kv_dtype) * kv_dtype.itemsize


def _parallel_groups(config: WorkerConfig):
    """This rank's tensor-parallel group (the ranks of its pipeline stage; None alone) and its
    pipeline group (None without stages)."""
    from duet.distributed import PipelineGroup, TensorParallelGroup, connect_store

    host, port = config.parallel_store
    store = connect_store(host, port, config.collective_timeout_s)
    use_cuda, timeout_s = config.device.startswith("cuda"), config.collective_timeout_s
    tensor_parallel_size = config.tensor_parallel_size
    stage, rank_in_stage = config.stage_and_rank
    tensor_group = pipeline = None
    if tensor_parallel_size > 1:
        tensor_group = TensorParallelGroup(
            store, rank_in_stage, tensor_parallel_size, use_cuda, config.host, timeout_s, config.ranks_share_memory, name=f"tp/{stage}",
            ordered_sums=config.batch_invariant,
        )
    if config.pipeline_parallel_size > 1:
        pipeline = PipelineGroup(store, config.rank, config.world_size, tensor_parallel_size, use_cuda, config.host, timeout_s)
    return tensor_group, pipeline


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        from duet.model_runner import ModelRunner
        from duet.models.llama import narrow_windows
        from duet.models.loader import load_model
        from duet.models.pipeline_parallel import PipelineStage
        from duet.models.tensor_parallel import apply_tensor_parallel
        from duet.pipeline_runner import PipelineRunner

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)  # the same on every rank: each samples the same tokens
        self.config = config
        dtype = resolve_dtype(config.dtype, config.device)
        model = load_model(Path(config.model_path), dtype, config.device, config.max_model_len, config.quantization)
        arch = model.arch  # the whole model's; a rank's own shape replaces it below
        self.group = self.pipeline = None  # this rank's tensor-parallel and pipeline groups
        if config.world_size > 1:
            self.group, self.pipeline = _parallel_groups(config)
        if self.group is not None:
            apply_tensor_parallel(model, self.group, config.enable_expert_parallel)
        if config.batch_invariant:
            from duet.models.batch_invariant import make_batch_invariant

            make_batch_invariant(model)
        if self.pipeline is not None:
            model = PipelineStage(model, self.pipeline.stage, self.pipeline.num_stages)
        draft = None
        if config.draft_model_path is not None:
            # A draft checkpoint need not be a GGUF one: by default it follows the target's choice
            # only where that applies to any model (floats kept, or quantized at load time).
            draft_quantization = config.speculative_config.quantization
            if draft_quantization is None and config.quantization in ("dequantized", "int8", "int4", "w8a8"):
                draft_quantization = config.quantization
            draft = load_model(Path(config.draft_model_path), dtype, config.device, config.max_model_len, draft_quantization)
            if arch.kv_window is not None:  # the blocks before the target's window go (``KVCacheManager``)
                narrow_windows(draft, arch.kv_window)
        runner_args = (
            config.num_blocks, config.block_size, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype), config.device, config.eos_token_id,
            config.max_model_len, config.speculative_config, draft,
        )
        if self.pipeline is None:
            self.runner = ModelRunner(model, *runner_args, tokenizer_path=config.model_path, cascade_attention=config.cascade_attention)
        else:
            self.runner = PipelineRunner(
                model, self.pipeline, *runner_args, tokenizer_path=config.model_path, cascade_attention=config.cascade_attention
            )
        # Adapters unloaded, kept in host memory (``max_cpu_loras``), by (name, folder, files' stamp);
        # the folder of each held one; and how many were read from a folder.
        self._unloaded_loras: OrderedDict[tuple, object] = OrderedDict()
        self._lora_paths: dict[str, str] = {}
        self.num_lora_reads = 0
        for index, (name, path) in enumerate(config.lora_modules):
            adapter = self.load_lora(name, path)  # checked now, whether held or not
            if index < config.max_loras:
                self.runner.add_lora(adapter)
                self._lora_paths[name] = path
            else:
                self._keep_unloaded(name, path, adapter)
        self._trim_unloaded()
        if config.device == "cpu":
            from duet.kernels import cpu_ops

            cpu_ops.load()  # compile (once per machine) now, not inside the first step
        self.kv_tier = None
        if config.kv_offload is not None:
            self.kv_tier = KVTierStore(self.runner.kv_cache, config.kv_tier_blocks, config.kv_offload.path, config.kv_offload.quantized)
        self.kv_connector = None
        if config.kv_transfer is not None:
            self.kv_connector = import_object(config.kv_transfer.connector)(self.runner.kv_cache, arch, config)
        if config.cuda_graph_max_num_seqs:
            reason = self.runner.capture_decode_graphs(config.cuda_graph_max_num_seqs)
            if reason is not None:
                logger.warning("decode steps run eagerly, without CUDA graphs: %s", reason)

    def kv_endpoint(self) -> KVEndpoint | None:
        return None if self.kv_connector is None else self.kv_connector.endpoint

    def on_kv_results(self, wake) -> None:
        """``KVConnectorWorker.on_results``, where the connector has it (another, configured by
        ``kv_transfer_config.connector``, is polled each step as before)."""
        on_results = getattr(self.kv_connector, "on_results", None)
        if on_results is not None:
            on_results(wake)

    def load_lora(self, name: str, path: str):
        """The adapter at ``path``, checked against this model (``duet.lora.LoRAError``: why it does not
        fit): kept in host memory since it was unloaded (``unload_lora``), if its files are unchanged,
        else read from its folder."""
        from duet.lora import load_adapter

        key = (name, path, _adapter_stamp(path))
        kept = self._unloaded_loras.pop(key, None)
        if kept is not None:
            return kept.to(self.config.device)
        self.num_lora_reads += 1
        return load_adapter(name, path, self.runner.model, self.config.max_lora_rank)

    def check_lora(self, name: str, path: str) -> None:
        """Raise ``duet.lora.LoRAError`` if the adapter at ``path`` does not fit this model (read
        from its folder; nothing is kept, nor returned: a Ray actor's answer would ship it)."""
        from duet.lora import load_adapter

        load_adapter(name, path, self.runner.model, self.config.max_lora_rank)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; keep the newest ``max_cpu_loras - max_loras`` unloaded ones
        in host memory, by folder and files, for the next load."""
        adapter, path = self.runner.loras.pop(name, None), self._lora_paths.pop(name, None)
        if adapter is not None and path is not None:
            self._keep_unloaded(name, path, adapter)

    def _keep_unloaded(self, name: str, path: str, adapter) -> None:
        if self.config.max_cpu_loras > self.config.max_loras:
            self._unloaded_loras[(name, path, _adapter_stamp(path))] = adapter.to("cpu")

    def _trim_unloaded(self) -> None:
        """Down to the newest ``max_cpu_loras - max_loras``: after a step's loads and unloads, so
        that one unloaded to make room does not push out one the same step loads."""
        while len(self._unloaded_loras) > self.config.max_cpu_loras - self.config.max_loras:
            self._unloaded_loras.popitem(last=False)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for name, path in scheduler_output.lora_ops:  # the engine's loads and unloads (``duet.lora.LoRASlots``)
            self.unload_lora(name)
            if path is not None:
                try:
                    self.runner.add_lora(self.load_lora(name, path))
                    self._lora_paths[name] = path
                except ConfigError as error:  # changed since the engine checked it: its requests fail, not the step's others
                    logger.error("could not load LoRA adapter %r from %s: %s", name, path, error)
        if scheduler_output.lora_ops:
            self._trim_unloaded()
        if scheduler_output.kv_tier:  # first: blocks this step's transfers and forward write or read
            self.kv_tier.apply(scheduler_output.kv_tier)
        connector = self.kv_connector
        if connector is None:
            return self.runner.execute(scheduler_output)
        connector.start_step(scheduler_output.kv_connector, lambda request_id: self.runner.requests[request_id].block_ids)
        output = self.runner.execute(scheduler_output, connector.on_layer_done if connector.streaming else None)
        connector.end_step(dict(zip(output.request_ids, output.sampled_token_ids)))
        output.kv_results = connector.poll()
        return output

    def collective_stats(self) -> tuple[float, int]:
        """Seconds spent in, and number of, this rank's tensor-parallel collectives and pipeline
        waits (for the stage before's hidden states, the sends to the next, the sampled tokens) so far."""
        groups = [group for group in (self.group, self.pipeline) if group is not None]
        return sum(group.seconds for group in groups), sum(group.calls for group in groups)

    def forget(self, request_ids) -> None:
        """Drop the runner's state of these requests (a failed step): they are sent whole again."""
        self.runner.forget(request_ids)

    def close(self) -> None:
        if self.runner.grammar is not None:
            self.runner.grammar.close()
        if self.kv_connector is not None:
            self.kv_connector.close()


def _adapter_stamp(path: str) -> tuple:
    """What tells an adapter's files changed: each one's size and modification time."""
    stamp = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            info = (Path(path) / name).stat()
            stamp.append((info.st_size, info.st_mtime_ns))
        except OSError:
            stamp.append(None)
    return tuple(stamp)
