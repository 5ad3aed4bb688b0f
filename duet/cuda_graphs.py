"""The decode step on a GPU replayed from CUDA graphs, one per batch-size bucket, as vLLM does.

A small model's decode step on a GPU is mostly kernel launches: SmolLM2's 30 layers launch some
three hundred kernels a step, each costing the host more than the GPU takes to run it. A graph
captured once per bucket (1, 2, 4, then every 8 up to the engine's ``max_num_seqs``, at most
``MAX_CAPTURED``) launches them all at once. The graphs read their inputs from static buffers:
a step of ``n`` decode tokens copies its token ids, positions, cache slots, sequence lengths and
block tables into the first ``n`` rows and replays the smallest bucket that holds them. The
rows past ``n`` write their K/V nowhere (slot -1, which the KV write skips), attend to one key
and their logits are never read, so a request's logits are those of the eager forward.

Only steps whose every sequence brings one token (decode, or a prompt's last token) and needs
its logits replay a graph; prompt chunks, draft verification, LoRA rows and prompt logprobs run
eagerly. Models whose forward a graph cannot hold (host-side decisions per step: experts'
routing, sliding windows and soft-caps in torch, RoPE that depends on a sequence's length, a
quantized KV cache's torch write) and parallel ranks run eagerly too (``unsupported``).
"""

from __future__ import annotations

from collections import Counter

import torch

from duet.kernels import AttentionMetadata
from duet.kernels.kv_quant import is_quantized

MAX_CAPTURED = 256  # the largest batch captured; larger decode steps run eagerly


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The buckets captured: 1, 2, 4, then multiples of 8, up to ``max_num_seqs`` (itself a
    bucket, so that every decode step the engine can schedule has one) and ``MAX_CAPTURED``."""
    limit = min(max_num_seqs, MAX_CAPTURED)
    sizes = [size for size in (1, 2, 4, *range(8, limit + 1, 8)) if size <= limit]
    return sizes if sizes[-1] == limit else [*sizes, limit]


def unsupported(model: torch.nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why ``model``'s decode step cannot be captured, or None if it can."""
    from duet.models.llama import LlamaForCausalLM

    if not kv_cache.is_cuda:
        return "the model is not on a CUDA device"
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__}'s forward decides on the host each step (experts' routing, pipeline stages)"
    arch = model.arch
    if arch.attn_softcap is not None or any(arch.window(layer) is not None for layer in range(arch.num_layers)):
        return "soft-capped or sliding-window attention runs in torch on a GPU, planned on the host"
    if model.rotary.switch_len is not None or model.local_rotary is not None:
        return "its RoPE depends on each sequence's length"
    if is_quantized(kv_cache):
        return "a quantized KV cache is written by torch, which has no slot to skip padding rows"
    return None


class DecodeGraphs:
    """The graphs of ``model``'s decode step over ``kv_caches``, one per ``capture_sizes``
    bucket; ``run`` replays one for a step that ``takes``."""

    def __init__(self, model: torch.nn.Module, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, device: str) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.replays: Counter[int] = Counter()  # steps served by each bucket's graph
        rows = self.sizes[-1]
        with torch.cuda.device(device):
            self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
            self.positions = torch.zeros(rows, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
            self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token a sequence
            self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
            self.logits_indices = torch.arange(rows, dtype=torch.long, device=device)
            self.logits = torch.zeros(rows, model.arch.vocab_size, dtype=torch.float32, device=device)
            self.max_seq_len = max_blocks_per_seq * kv_caches[0][0].shape[2]
            self.graphs = self._capture(device)

    def _metadata(self, size: int) -> AttentionMetadata:
        # The host-side lengths are bounds here, not this step's: the captured kernels (Triton's)
        # read the device tensors, and the models captured plan nothing from the host copies.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens=[1] * size,
            seq_lens_list=[self.max_seq_len] * size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def _forward(self, size: int) -> None:
        logits = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size), self.logits_indices[:size])
        self.logits[:size].copy_(logits)

    @torch.inference_mode()
    def _capture(self, device: str) -> dict[int, torch.cuda.CUDAGraph]:
        """Largest bucket first, so that the smaller ones fit in the memory pool it leaves."""
        graphs, pool = {}, None
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # compile Triton's kernels and pick cuBLAS's outside the capture
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads may use CUDA meanwhile
                self._forward(size)
            pool = graph.pool()
            graphs[size] = graph
        torch.cuda.synchronize(device)
        return graphs

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds ``num_seqs`` sequences, or None."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def takes(self, metadata: AttentionMetadata, num_logits_rows: int) -> bool:
        """Whether a step is one a graph computes: one token per sequence, each needing logits,
        in a captured size, with block tables no wider than the captured ones."""
        return (
            metadata.max_query_len == 1
            and num_logits_rows == metadata.num_seqs
            and self.bucket(metadata.num_seqs) is not None
            and metadata.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The step's fp32 logits, ``[num_seqs, vocab]``: a view of the graphs' output buffer,
        valid until the next replay."""
        count, size = metadata.num_seqs, self.bucket(metadata.num_seqs)
        self.input_ids[:count].copy_(input_ids, non_blocking=True)
        self.positions[:count].copy_(positions, non_blocking=True)
        self.slot_mapping[:count].copy_(metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[count:size].fill_(-1)
        self.seq_lens[:count].copy_(metadata.seq_lens, non_blocking=True)
        self.seq_lens[count:size].fill_(1)
        self.block_tables[:count, : metadata.block_tables.shape[1]].copy_(metadata.block_tables, non_blocking=True)
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.logits[:count]
