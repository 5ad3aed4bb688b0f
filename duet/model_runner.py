"""Turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

The runner keeps its own copy of each request's tokens and block table, updated from the
scheduler's diffs, so it can later live on a worker actor of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from duet.kernels import AttentionMetadata
from duet.outputs import RunnerOutput, SchedulerOutput
from duet.sampler import Sampler, advance_generator, build_sampling_metadata, make_generator
from duet.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_request_ids: list[str]


class ModelRunner:
    """Owns the model, the paged KV cache and the sampler."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: str,
        eos_token_id: int | None,
    ) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos_token_id = eos_token_id
        self.vocab_size = arch.vocab_size
        shape = (arch.num_layers, 2, arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.kv_caches = [(self.kv_cache[layer, 0], self.kv_cache[layer, 1]) for layer in range(arch.num_layers)]
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        # Called as (layer index, ids of requests whose prompt KV completes this step).
        self.layer_listener: Callable[[int, list[str]], None] | None = None

    @staticmethod
    def kv_bytes_per_block(arch, block_size: int, kv_dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=kv_dtype).element_size()
        return arch.num_layers * 2 * arch.num_kv_heads * block_size * arch.head_dim * element

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = make_generator(params.seed, self.device)
                # A request resumed (after preemption, or on a decode replica) continues its
                # random stream where it stopped: one draw per token already sampled.
                if not params.greedy:
                    advance_generator(generator, self.vocab_size, len(new.output_token_ids))
            self.requests[new.request_id] = CachedRequestState(
                new.request_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                params,
                list(new.block_ids),
                new.num_computed_tokens,
                generator,
            )
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_lens, seq_lens, logits_indices, sampling_ids = [], [], [], []
        block_rows = []
        offset = 0
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            input_ids.extend(state.token_slice(start, end))
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(state.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(num_tokens)
            seq_lens.append(end)
            block_rows.append(table)
            offset += num_tokens
            if end == state.num_tokens:
                logits_indices.append(offset - 1)
                sampling_ids.append(request_id)
        max_blocks = max(len(row) for row in block_rows)
        block_tables = np.zeros((len(block_rows), max_blocks), dtype=np.int32)
        for row, table in enumerate(block_rows):
            block_tables[row, : len(table)] = table
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(block_tables).to(device),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(np.concatenate(positions)).to(device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            sampling_request_ids=sampling_ids,
        )

    def _sampling_metadata(self, request_ids: list[str]):
        states = [self.requests[request_id] for request_id in request_ids]
        forbidden = []
        for state in states:
            params = state.sampling_params
            if len(state.output_token_ids) < params.min_tokens:
                stop_ids = tuple(params.stop_token_ids)
                forbidden.append(stop_ids + (() if self.eos_token_id is None else (self.eos_token_id,)))
            else:
                forbidden.append(())
        return build_sampling_metadata(
            params=[state.sampling_params for state in states],
            prompt_token_ids=[state.prompt_token_ids for state in states],
            output_token_ids=[state.output_token_ids for state in states],
            generators=[state.generator for state in states],
            forbidden_token_ids=forbidden,
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _layer_callback(self, scheduler_output: SchedulerOutput) -> Callable[[int], None] | None:
        if self.layer_listener is None:
            return None
        completing = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            if state.num_computed_tokens < len(state.prompt_token_ids) <= state.num_computed_tokens + num_tokens:
                completing.append(request_id)
        if not completing:
            return None
        listener = self.layer_listener
        return lambda layer: listener(layer, completing)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self._update_states(scheduler_output)
        request_ids = list(scheduler_output.num_scheduled_tokens)
        if not request_ids:
            return RunnerOutput([], [])
        inputs = self._prepare_inputs(scheduler_output)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        logits = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, inputs.logits_indices,
            self._layer_callback(scheduler_output),
        )
        if inputs.sampling_request_ids:
            result = self.sampler(logits, self._sampling_metadata(inputs.sampling_request_ids))
            for row, request_id in enumerate(inputs.sampling_request_ids):
                token_id = result.sampled_token_ids[row]
                self.requests[request_id].output_token_ids.append(token_id)
                sampled[request_id] = [token_id]
                if result.logprobs is not None and result.logprobs[row] is not None:
                    logprobs[request_id] = [result.logprobs[row]]
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        return RunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=[sampled.get(request_id, []) for request_id in request_ids],
            logprobs=[logprobs.get(request_id, []) for request_id in request_ids] if logprobs else None,
        )
