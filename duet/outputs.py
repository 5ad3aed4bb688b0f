"""Messages between scheduler and runner, and the results users get. Lists, not tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from duet.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or dropped at preemption), sent whole."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's work. ``num_scheduled_tokens`` is in batch order."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    # Draft tokens to verify, per request; they are the last of its scheduled tokens.
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class RunnerOutput:
    """Tokens sampled this step, per request in batch order (empty for a mid-prompt chunk).

    With speculation a request gets its accepted draft tokens plus one; ``draft_token_ids``
    holds the proposals for the next step.
    """

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]] | None = None
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, shaped like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the engine failed on this request (and only on it); it is finished
