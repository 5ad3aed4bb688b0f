"""Token-budget scheduler: continuous batching, chunked prefill, prefix hits, preemption.

There is no prefill phase and no decode phase. Each request has ``num_computed_tokens``
and catches up to ``num_tokens`` within the step's token budget; running requests go
first, then waiting ones in arrival order. A request with draft tokens schedules them after
its own, so verification counts against the same budget.

A step that fails is rolled back (``reset_step``, in ``duet.scheduler_recovery``): its
requests start over from the prefix cache, one at a time, until the one that fails alone is
found and failed; the others go on.

Prompt KV computed on another replica arrives through the KV connector (``duet.kv_connector``):
such a request waits, with its blocks reserved, until its KV is in, then joins the batch with
its first token. A request whose KV goes to another replica stops after its first token.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from duet.kv_cache_manager import KVCacheManager
from duet.kv_connector import KVConnectorScheduler
from duet.messages import SchedulerStats
from duet.outputs import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from duet.request import Request, RequestStatus
from duet.scheduler_moves import SequenceMoves
from duet.scheduler_recovery import StepRecovery
from duet.spec_decode.stats import SpecDecodingStats

if TYPE_CHECKING:
    from duet.lora import LoRASlots

logger = logging.getLogger(__name__)


class Scheduler(SequenceMoves, StepRecovery):
    """Decides, each step, which requests compute how many tokens."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_lookahead_tokens: int = 0,
        loras: LoRASlots | None = None,
        rope_recompute_past: int | None = None,
        rope_cache_key: Callable[[int], int | None] | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.loras = loras  # the LoRA adapters the worker holds (None: the engine serves none)
        self.kv_connector = KVConnectorScheduler(kv_cache_manager)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # KV slots past a step's tokens for a proposer that writes KV while drafting.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodingStats()
        # Phi-3's longrope (``LlamaArch.rope_recompute``): a sequence computed short is computed
        # again, whole, past this length, under the cache key of its new length.
        self.rope_recompute_past = rope_recompute_past
        self.rope_cache_key = rope_cache_key
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Requests whose prompt KV arrived from a prefill replica: admitted before waiting ones.
        self.prefilled: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests of a failed step, rerun alone in this order until each has passed a step.
        self.suspects: list[str] = []
        self._finished_ids: set[str] = set()
        self._runner_known: set[str] = set()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_remote_request(self, request: Request, transfer_id: int) -> bool:
        """A request whose prompt KV another replica computes and sends as ``transfer_id``: its blocks, and its
        first step's (its next token or a pull's rest, and drafts), are reserved now (False: no room)."""
        first_step = max(1, request.num_tokens - request.num_transfer_tokens) + self.num_lookahead_tokens
        num_next_slots = max(0, min(first_step, self.max_model_len - request.num_transfer_tokens))
        if not self.kv_connector.reserve(request, transfer_id, num_next_slots):
            return False
        self.requests[request.request_id] = request
        return True

    def stats(self) -> SchedulerStats:
        """The queues, read off the engine thread: snapshots, and blocks looked up leniently."""
        waiting, running, prefilled = list(self.waiting), list(self.running), list(self.prefilled)
        queued = (*waiting, *running, *prefilled)  # a pull's prompt is computed after its KV came
        decoding = [request for request in (*running, *prefilled) if request.num_computed_tokens >= request.num_prompt_tokens]
        return SchedulerStats(
            num_running=len(running),
            num_waiting=len(waiting) + len(prefilled),
            num_preemptions=self.num_preemptions,
            prompt_tokens_pending=sum(_prompt_left(request) for request in queued),
            new_prompt_tokens_pending=sum(_prompt_left(request) for request in queued if not request.output_token_ids),
            num_decoding_blocks=sum(self.kv_cache_manager.num_held_blocks(request.request_id) for request in decoding),
            num_decode_waiting=len(prefilled) + sum(1 for request in waiting if request.output_token_ids),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled or self.kv_connector.num_in_flight)

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """The next step. ``token_budget`` bounds it below ``max_num_batched_tokens`` (chunked
        prefill only: a prompt that may not be chunked is never bounded)."""
        budget = self.max_num_batched_tokens
        if token_budget is not None and self.enable_chunked_prefill:
            budget = max(1, min(budget, token_budget))
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}

        # running requests, oldest first; the newest give way when blocks run out
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._rotate_long(request):  # computed again, from the waiting queue's front
                self.running.remove(request)
                self._restart(request)
                self.waiting.appendleft(request)
                preempted.add(request.request_id)
                continue
            num_uncomputed = request.num_tokens - request.num_computed_tokens
            num_new = min(num_uncomputed + len(request.spec_token_ids), budget, self._short_positions_left(request))
            if num_new <= 0 or not self._may_run(request):
                index += 1
                continue
            while True:
                blocks = self.kv_cache_manager.allocate_slots(request, num_new + self._lookahead(request, num_new))
                if blocks is not None:
                    break
                victim = self._victim(request)
                if self.running.index(victim) < index:
                    index -= 1
                self.running.remove(victim)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = [block.block_id for block in blocks]
            self._maybe_start_send(request, num_new)
            if num_new > num_uncomputed:
                spec_tokens[request.request_id] = request.spec_token_ids[: num_new - num_uncomputed]
            budget -= num_new
            index += 1

        # requests whose prompt KV was computed elsewhere
        while self.prefilled and budget > 0 and len(self.running) < self.max_num_seqs and not preempted and not self.suspects:
            request = self.prefilled[0]
            if self._rotate_long(request):  # its prompt's KV, short, is of no use: computed again here
                self.prefilled.popleft()
                self._restart(request)
                self.waiting.appendleft(request)
                continue
            if not self._adapter_held(request):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new + self._lookahead(request, num_new)) is None:
                break
            self.prefilled.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        # waiting requests, in arrival order, while nothing had to be preempted; those whose
        # LoRA adapter cannot be held yet wait for a running one to finish, the others go on
        skipped = 0
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[skipped]
            if not self._may_run(request):
                break
            if not self._adapter_held(request):
                skipped += 1
                continue
            self._rotate_long(request)
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            lookahead = self._lookahead(request, num_new, num_hit_tokens)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new + lookahead, computed_blocks)
            while blocks is None and self.suspects and self.running:  # the others are held still: they free nothing
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                blocks = self.kv_cache_manager.allocate_slots(request, num_new + lookahead, computed_blocks)
            if blocks is None:
                break
            self.waiting.remove(request)
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            request.num_cached_tokens = max(request.num_cached_tokens, num_hit_tokens)
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            self._maybe_start_send(request, num_new)
            budget -= num_new

        return self._build_output(num_scheduled, new_blocks, preempted, spec_tokens)

    def _maybe_start_send(self, request: Request, num_new: int) -> None:
        """A request whose KV goes to another replica starts shipping in the step that computes
        its prompt's last chunk."""
        if request.kv_send is not None and request.num_computed_tokens + num_new >= request.num_prompt_tokens:
            if not self.kv_connector.sending(request):
                self.kv_connector.start_send(request)

    def _adapter_held(self, request: Request) -> bool:
        """Whether the worker holds, or loads this step, the request's LoRA adapter."""
        return request.lora is None or self.loras.admit(request.lora, request.lora_path, self.running)

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Slots to reserve past this step's tokens: the proposer drafts after a request's step
        reaches its last token, and writes draft KV there (never past ``max_model_len``)."""
        end = (request.num_computed_tokens if num_computed is None else num_computed) + num_new
        if not self.num_lookahead_tokens or end < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _build_output(
        self,
        num_scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
        preempted: set[str],
        spec_tokens: dict[str, list[int]],
    ) -> SchedulerOutput:
        new_requests, cached_requests = [], []
        for request_id in num_scheduled:
            request = self.requests[request_id]
            if request_id not in self._runner_known:
                new_requests.append(
                    NewRequestData(
                        request_id=request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=self.kv_cache_manager.block_ids(request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        lora=request.lora,
                        prompt_len=request.prompt_len,
                    )
                )
                self._runner_known.add(request_id)
            else:
                # The scheduler's block table is the runner's: what it kept, then what is new.
                num_kept = len(self.kv_cache_manager.block_ids(request_id)) - len(new_blocks[request_id])
                dropped = self.kv_cache_manager.num_dropped_blocks(request_id)  # before its window
                cached_requests.append(CachedRequestData(request_id, new_blocks[request_id], request.num_computed_tokens, num_kept, dropped))
        finished, self._finished_ids = self._finished_ids, set()
        self._runner_known -= preempted
        return SchedulerOutput(
            new_requests, cached_requests, num_scheduled, finished, preempted, spec_tokens, self.kv_connector.take_metadata(),
            self.kv_cache_manager.take_tier_ops(), [] if self.loras is None else self.loras.take_ops(),
        )

    def _rotate_long(self, request: Request) -> bool:
        """Whether ``request``, computed with Phi-3's short RoPE, has passed its switch: from now
        on all of it is long (``prompt_len``: its length). The caller restarts it if it holds KV."""
        switch = self.rope_recompute_past
        if switch is None or request.prompt_len > switch or request.num_tokens <= switch:
            return False
        request.prompt_len = request.num_tokens
        request.cache_key = self.rope_cache_key(request.prompt_len)
        return True

    def _short_positions_left(self, request: Request) -> int:
        """How many tokens a step may compute for ``request`` before its switch (a draft past it
        would be verified against short keys)."""
        switch = self.rope_recompute_past
        if switch is None or request.prompt_len > switch:
            return self.max_num_batched_tokens
        return max(1, switch - request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self._restart(request)
        self.waiting.appendleft(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        logger.warning(
            "preempted request %s by recompute (%d tokens, %d free blocks, %d preemptions so far)",
            request.request_id, request.num_tokens, self.kv_cache_manager.num_free_blocks, self.num_preemptions,
        )

    def _restart(self, request: Request) -> None:
        """Give back the request's blocks; it computes again from its prefix-cache hits when next
        admitted (a transfer of its KV under way is cancelled)."""
        request.status = RequestStatus.PREEMPTED
        self.kv_connector.release_or_hold(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, stop what is done, take the next drafts
        and free the slots of rejected ones; admit requests whose prompt KV arrived. Returns the
        requests that got tokens or ended."""
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                request.num_computed_tokens += num_tokens
        changed = []
        for request_id, error in runner_output.errors.items():
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                logger.warning("request %s failed alone: %s", request_id, error)
                request.error = error
                self.finish_request(request_id, RequestStatus.FINISHED_ERROR)
                changed.append(request)
        for request_id, token_ids in zip(runner_output.request_ids, runner_output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None or request.is_finished or not token_ids:
                continue
            drafts = scheduler_output.scheduled_spec_token_ids.get(request_id)
            if drafts:
                # Emitted: the accepted drafts and one token of the target's own.
                num_accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.observe(len(drafts), num_accepted)
            for token_id in token_ids:
                request.append_output_token_ids([token_id])
                status = request.stop_status(self.max_model_len)
                if status is not None:
                    self.finish_request(request_id, status)
                    break
            if self.suspects and self.suspects[0] == request_id:
                self.suspects.pop(0)  # passed a step of its own
            if not request.is_finished:
                request.spec_token_ids = runner_output.draft_token_ids.get(request_id, [])
                if drafts:
                    # Past the last token the blocks hold only rejected drafts (the runner hears next step).
                    self.kv_cache_manager.trim(request, request.num_tokens)
            changed.append(request)
        return changed + self._finish_transfers(runner_output)

    def _finish_transfers(self, runner_output: RunnerOutput) -> list[Request]:
        """Requests whose prompt KV arrived join the batch after their first token (unless that
        token ends them); those whose KV was lost fail. Returns the ones that ended."""
        arrived, lost = self.kv_connector.finished_transfers(runner_output.kv_results)
        ended = []
        for request, first_token_id in arrived:
            request.num_computed_tokens = request.num_transfer_tokens
            self.kv_cache_manager.cache_received(request)
            # a whole prompt's first token came with it (a pull's prompt is finished here first)
            if not request.output_token_ids and request.num_computed_tokens == request.num_prompt_tokens:
                request.append_output_token_ids([first_token_id])
                request.num_emitted_tokens += 1  # the prefill replica sent it out
            status = request.stop_status(self.max_model_len) if request.output_token_ids else None
            if status is not None:
                self.finish_request(request.request_id, status)
                ended.append(request)
            else:
                request.status = RequestStatus.WAITING
                self.prefilled.append(request)
        for request, error in lost:
            logger.warning("the prompt KV of request %s did not arrive: %s", request.request_id, error)
            request.error = f"the prompt's KV did not arrive: {error}"
            self.finish_request(request.request_id, RequestStatus.FINISHED_KV_LOST)
            ended.append(request)
        return ended

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Stop a request (done, failed or aborted) and give back its blocks (held first, while a
        transfer may still use them)."""
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.prefilled:
            self.prefilled.remove(request)
        request.status = status
        self.kv_connector.release_or_hold(request)
        if request_id in self.suspects:
            self.suspects.remove(request_id)
        if request_id in self._runner_known:
            self._runner_known.discard(request_id)
            self._finished_ids.add(request_id)

    def abort(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)


def _prompt_left(request: Request) -> int:
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)
