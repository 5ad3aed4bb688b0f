"""A request as the scheduler sees it: tokens known so far and how many have KV."""

from __future__ import annotations

import enum
import time

from duet.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed with this request alone in it

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """One sequence being generated.

    There is no prefill or decode phase: ``num_computed_tokens`` (tokens whose KV is in the
    cache) catches up with ``num_tokens`` (prompt plus output so far), a chunk at a time.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Proposed continuation, verified by the target at this request's next step.
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first ``num_output_tokens`` (emitted in the same step as a stop)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
