"""A request as the scheduler sees it: tokens known so far and how many have KV."""

from __future__ import annotations

import enum
import time

from duet.messages import KVDestination
from duet.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, its prompt's KV on its way
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REMOTE = "remote"  # its first token is out; the sequence goes on where its KV went
    FINISHED_ERROR = "error"  # a step failed with this request alone in it
    FINISHED_KV_LOST = "kv_lost"  # its prompt's KV never arrived
    MIGRATING = "migrating"  # held still, its KV about to move to another replica
    FINISHED_MIGRATED = "migrated"  # its KV went to another replica, where it goes on

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # members compare by identity: no lookup of each one's value


_FINISHED = tuple(status for status in RequestStatus if status.name.startswith("FINISHED_"))


class Request:
    """One sequence being generated.

    There is no prefill or decode phase: ``num_computed_tokens`` (tokens whose KV is in the
    cache) catches up with ``num_tokens`` (prompt plus output so far), a chunk at a time.
    ``output_token_ids`` may start non-empty: tokens generated elsewhere, recomputed here.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        output_token_ids: list[int] | None = None,
        kv_send: KVDestination | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
        lora_path: str | None = None,
        prompt_len: int | None = None,
        cache_key: int | None = None,
        num_pulled_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora = lora  # its LoRA adapter's name (None: the base model)
        self.lora_path = lora_path  # the adapter's folder
        self.prompt_token_ids = list(prompt_token_ids)
        # Its sequence's own prompt length (``EngineRequest.own_prompt_len``), and what its KV
        # depends on besides its tokens (``LlamaArch.rope_cache_key``; the prefix cache keys by it).
        self.prompt_len = len(self.prompt_token_ids) if prompt_len is None else prompt_len
        self.cache_key = cache_key
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        # Output tokens already reported (given at arrival, or sent out by the prefill replica).
        self.num_emitted_tokens = len(self.output_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = num_pulled_tokens or 0  # a pull's tokens were not computed for it either
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Proposed continuation, verified by the target at this request's next step.
        self.spec_token_ids: list[int] = []
        # Prefill role: ship the prompt's KV here, and stop after the first token.
        self.kv_send = kv_send
        self.remote_decode = kv_send is not None
        # Decode role: the transfer bringing the prompt's KV, and (a pull,
        # ``EngineRequest.kv_receive_tokens``) the leading prompt tokens it brings when not all.
        self.kv_receive_id: int | None = None
        self.num_pulled_tokens = num_pulled_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_transfer_tokens(self) -> int:
        """Tokens whose KV a transfer of this request carries: its prompt (the leading part pulled,
        for a pull), or, for a sequence under way, all its tokens but the last (the next step
        computes that one)."""
        if self.num_pulled_tokens is not None:
            return self.num_pulled_tokens
        return self.num_tokens - 1 if self.output_token_ids else self.num_prompt_tokens

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        """The sequence's own reason; None while it goes on, here or on another replica."""
        if not self.status.finished or self.status in (RequestStatus.FINISHED_REMOTE, RequestStatus.FINISHED_MIGRATED):
            return None
        return self.status.value

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """How the request ends with its last output token (None: it goes on); a stop token
        sets ``stop_reason``."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        # A constrained request samples EOS before min_tokens only once its constraint is
        # complete and allows nothing else (the runner forbids it otherwise): it ends there.
        if last == self.eos_token_id and params.structured_outputs is not None:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.remote_decode:
            return RequestStatus.FINISHED_REMOTE
        return None
