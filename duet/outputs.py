"""Messages between scheduler and workers, and the results users get. Lists, not tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from duet.messages import KVEndpoint
from duet.sampling_params import SamplingParams


@dataclass
class KVSendSpec:
    """Ship this request's KV: a prompt's layer run by layer run as this step's forward writes
    it, or (``block_ids`` given) a sequence's KV already in these blocks (a migration). Its
    ``num_blocks`` blocks from ``first_block`` of its table: those before lie wholly outside
    every layer's sliding window for the receiver's next step, which reads none of them."""

    request_id: str
    transfer_id: int
    endpoints: tuple[KVEndpoint, ...]
    num_blocks: int
    block_ids: list[int] | None = None
    first_block: int = 0


@dataclass
class KVReceiveSpec:
    """The prompt KV of this request is on its way: take it into these blocks."""

    request_id: str
    transfer_id: int
    block_ids: list[int]


@dataclass
class KVConnectorMetadata:
    """What the scheduler side of the KV connector asks the workers' side to start or stop."""

    sends: list[KVSendSpec] = field(default_factory=list)
    receives: list[KVReceiveSpec] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)  # transfer ids whose request went away

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.cancels)


@dataclass
class KVTierOps:
    """One step's copies between the pool and the second KV tier (``duet.kv_tier``): ``saves``
    (pool block, slot) first, then ``loads`` (slot, pool block), before the step's forward."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


@dataclass
class KVTransferResult:
    """How a transfer ended, as the workers report it. A received one carries the first token
    the prefill replica sampled; ``cancelled``: its request was aborted, not a failure."""

    transfer_id: int
    ok: bool
    first_token_id: int | None = None
    error: str | None = None
    cancelled: bool = False
    num_bytes: int = 0
    seconds: float = 0.0
    # A send's time less its waits for the forward computing what it sends: what moving
    # ``num_bytes`` took (None: a receive, which cannot tell its wire from its sender's forward).
    wire_seconds: float | None = None

    @classmethod
    def combine(cls, parts: list[KVTransferResult]) -> KVTransferResult:
        """One transfer's result from its parts' (several ranks', or several destinations'): it
        succeeded if every part did, and carries the first token whichever part brought it."""
        failed = [part for part in parts if not part.ok]
        first_token_ids = [part.first_token_id for part in parts if part.first_token_id is not None]
        return cls(
            transfer_id=parts[0].transfer_id,
            ok=not failed,
            first_token_id=first_token_ids[0] if first_token_ids else None,
            error=failed[0].error if failed else None,
            cancelled=any(part.cancelled for part in parts),
            num_bytes=sum(part.num_bytes for part in parts),
            seconds=max(part.seconds for part in parts),
            wire_seconds=None if any(part.wire_seconds is None for part in parts) else max(part.wire_seconds for part in parts),
        )


@dataclass
class NewRequestData:
    """A request the runner has not seen (or dropped at preemption), sent whole."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora: str | None = None  # its LoRA adapter (None: the base model)
    prompt_len: int | None = None  # its sequence's own prompt length (None: its prompt's)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed. Its block table keeps its first
    ``num_kept_blocks`` entries (the scheduler freed the rest: slots of rejected drafts), then
    gains ``new_block_ids``; its first ``num_dropped_blocks`` name the null block (their keys
    passed out of every layer's sliding window, ``KVCacheManager``)."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_kept_blocks: int
    num_dropped_blocks: int = 0


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
    kv_connector: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    kv_tier: KVTierOps = field(default_factory=KVTierOps)
    # LoRA adapters to load (name, folder) and unload (name, None), in order, before the forward.
    lora_ops: list[tuple[str, str | None]] = field(default_factory=list)

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
    holds the proposals for the next step. A request in ``errors`` ends with that error, and
    whatever it sampled this step is dropped.
    """

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]] | None = None
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_results: list[KVTransferResult] = field(default_factory=list)
    # Requests that cannot go on (their constraint failed), and why: they fail alone.
    errors: dict[str, str] = field(default_factory=dict)
    # Per request asking for them: the first prompt position this step's chunk scored, and the
    # top logprobs of each prompt token after it (``SamplingParams.prompt_logprobs``).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


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
    metrics: dict[str, float] = field(default_factory=dict)  # first_token_time, finished_time (monotonic)
    # Each prompt token's top logprobs after the tokens before it (None for the first), where asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
