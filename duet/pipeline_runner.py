"""A pipeline stage's runner (one rank of it, with tensor parallelism inside the stage): the
step's requests go through the stages in micro-batches, so that while stage s computes
micro-batch m, stage s - 1 computes m + 1; the last stage samples (verifying drafts, with
n-gram speculation) and every rank learns the tokens. Each rank keeps the same per-request
state as a whole runner (its own copy, updated from the same ``SchedulerOutput``s and the
shared tokens); the last stage proposes the next step's drafts. A prompt's KV leaves each
stage (for another replica) once the stage has run all its micro-batches."""

from __future__ import annotations

import time

import torch

from duet.distributed import PipelineGroup
from duet.lora import applied
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
        started = time.perf_counter()
        num_parts, num_requests = min(self.group.num_stages, len(request_ids)), len(request_ids)
        parts = [request_ids[index * num_requests // num_parts : (index + 1) * num_requests // num_parts] for index in range(num_parts)]
        prepared = [self._prepare_inputs(scheduler_output, part) for part in parts]
        row_owners = [owner for _, _, owners, _ in prepared for owner in owners]
        spec_token_ids = scheduler_output.scheduled_spec_token_ids
        # The last stage samples: its masks fill beside its forward passes (on a GPU).
        masks = self._start_masks(row_owners, spec_token_ids) if self.stage.last else None
        logits, sends = [], []
        for index, (batch, logits_rows, _, _) in enumerate(prepared):
            received = None
            if not self.stage.first:
                shape = (2, batch.input_ids.shape[0], self.stage.arch.hidden_size)
                received = self.group.recv_previous(torch.empty(shape, dtype=self.kv_cache.dtype, device=self.device), index)
            with applied(self._lora_step(scheduler_output, parts[index])):  # the micro-batch's rows by adapter
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
        sampled, logprobs = {}, {}
        if self.stage.last and row_owners:
            sampled, logprobs = self._sample(torch.cat(logits), row_owners, spec_token_ids, masks)
        if row_owners:
            sampled = self._share(sampled, list(dict.fromkeys(row_owners)), len(row_owners))
        self._advance(scheduler_output, sampled)
        drafts = self._propose(scheduler_output, sampled, started) if self.stage.last else {}
        return self._output(request_ids, sampled, logprobs, drafts)

    def _share(self, sampled: dict[str, list[int]], owners: list[str], num_rows: int) -> dict[str, list[int]]:
        """The last stage's tokens on every rank (at most one per logits row of each of
        ``owners``): how many each request took, then the tokens, in one broadcast."""
        shared = torch.zeros(len(owners) + num_rows, dtype=torch.long, device=self.device)  # NCCL moves device tensors
        if self.stage.last:
            tokens = [token for owner in owners for token in sampled.get(owner, [])]
            shared[: len(owners)] = torch.tensor([len(sampled.get(owner, [])) for owner in owners])
            shared[len(owners) : len(owners) + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.group.broadcast_from_last(shared)
        if self.stage.last:
            return sampled
        counts, tokens = shared[: len(owners)].tolist(), shared[len(owners) :].tolist()
        sampled, start = {}, 0
        for owner, count in zip(owners, counts):
            if count:
                sampled[owner] = tokens[start : start + count]
                self.requests[owner].output_token_ids.extend(sampled[owner])
            start += count
        return sampled
