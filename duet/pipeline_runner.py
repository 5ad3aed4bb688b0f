"""A pipeline stage's runner (one rank of it, with tensor parallelism inside the stage): the
step's requests go through the stages in micro-batches, so that while stage s computes
micro-batch m, stage s - 1 computes m + 1; the last stage samples and every rank learns the
tokens. Each rank keeps the same per-request state as a whole runner (its own copy, updated
from the same ``SchedulerOutput``s and the shared tokens). A prompt's KV leaves each stage (for
another replica) once the stage has run all its micro-batches."""

from __future__ import annotations

import torch

from duet.distributed import PipelineGroup
from duet.model_runner import ModelRunner
from duet.models.pipeline_parallel import PipelineStage
from duet.outputs import RunnerOutput, SchedulerOutput


class PipelineRunner(ModelRunner):
    def __init__(self, stage: PipelineStage, group: PipelineGroup, *args, **kwargs) -> None:
        super().__init__(stage, *args, **kwargs)
        self.stage = stage
        self.group = group

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, on_layer_done=None) -> RunnerOutput:
        self._update_states(scheduler_output)
        request_ids = list(scheduler_output.num_scheduled_tokens)
        if not request_ids:
            return RunnerOutput([], [])
        num_parts, num_requests = min(self.group.num_stages, len(request_ids)), len(request_ids)
        parts = [request_ids[index * num_requests // num_parts : (index + 1) * num_requests // num_parts] for index in range(num_parts)]
        prepared = [self._prepare_inputs(scheduler_output, part) for part in parts]
        row_owners = [owner for _, _, owners in prepared for owner in owners]
        # The last stage samples: its masks fill beside its forward passes (on a GPU).
        masks = self._start_masks(row_owners, {}) if self.stage.last else None
        logits, sends = [], []
        for index, (batch, logits_rows, _) in enumerate(prepared):
            received = None
            if not self.stage.first:
                shape = (2, batch.input_ids.shape[0], self.stage.arch.hidden_size)
                received = self.group.recv_previous(torch.empty(shape, dtype=self.kv_cache.dtype, device=self.device), index)
            out = self.stage(batch.input_ids, batch.positions, self.kv_caches, batch.metadata, logits_rows, received)
            if self.stage.last:
                logits.append(out)
            else:
                sends.append((self.group.send_next(out, index), out))
        if on_layer_done is not None:  # a stage's layers are done once all its micro-batches are through them
            for layer in range(self.stage.arch.num_layers):
                on_layer_done(layer)
        for work, _ in sends:
            self.group.wait(work)
        token_ids = torch.empty(len(row_owners), dtype=torch.long)
        sampled, logprobs = {}, {}
        if self.stage.last and row_owners:
            sampled, logprobs = self._sample(torch.cat(logits), row_owners, {}, masks)
            token_ids = torch.tensor([sampled[owner][0] for owner in row_owners], dtype=torch.long)
        if row_owners:
            self.group.broadcast_from_last(token_ids)
        if not self.stage.last:
            sampled = {owner: [token] for owner, token in zip(row_owners, token_ids.tolist())}
            for request_id, tokens in sampled.items():
                self.requests[request_id].output_token_ids.extend(tokens)
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        return RunnerOutput(
            request_ids=request_ids,
            sampled_token_ids=[sampled.get(request_id, []) for request_id in request_ids],
            logprobs=[logprobs.get(request_id, []) for request_id in request_ids] if logprobs else None,
            errors=self.grammar.take_failures() if self.grammar is not None else {},
        )
