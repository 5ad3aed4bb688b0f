"""What the router and the replicas send each other over Serve. Plain dataclasses of ints,
strings and lists, importable without torch, so the router never loads the engine."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from duet.errors import InvalidRequestError
from duet.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVEndpoint:
    """Where one decode worker's KV receiver takes announcements (its TCPStore), and the ranges
    of the model's KV heads and layers it holds (None: all of them; a tensor-parallel rank holds
    some of the heads, a pipeline stage some of the layers)."""

    host: str
    port: int
    kv_heads: tuple[int, int] | None = None
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill replica ships a request's prompt KV. The decode replica picks it, with the
    blocks reserved, before the prefill starts, so the transfer overlaps the prefill."""

    transfer_id: int
    endpoints: tuple[KVEndpoint, ...]  # one per decode worker
    replica_id: str


@dataclass(frozen=True)
class Placement:
    """The first item of a decode replica's stream: where the sequence runs, and, for one whose
    KV comes from elsewhere, the destination to send it to."""

    replica_id: str
    destination: KVDestination | None = None


@dataclass(frozen=True)
class Moved:
    """The last item of a decode replica's stream when the sequence left it mid-way (the replica
    is leaving its pool, or sheds load to a replica that took the decode role): ``token_ids``
    are its output so far, all streamed before; it goes on at ``replica_id`` of ``pool`` (None:
    the decode pool; attach to it there), or, if None, must be recomputed elsewhere."""

    replica_id: str | None
    token_ids: list[int]
    pool: str | None = None


@dataclass
class EngineRequest:
    """One sequence for an engine, as the router hands it to a replica (token ids, never text).

    ``output_token_ids``: tokens generated before, elsewhere (a request resumed after its KV was
    lost); the engine recomputes their KV and goes on from them. ``kv_send``: a prefill
    replica's request: ship the prompt's KV there and stop after the first token. ``kv_receive``:
    a decode replica's request whose prompt KV (and first token) come from a prefill replica;
    ``kv_receive_tokens`` with it: only the KV of the prompt's first that many tokens comes (a
    pull of a history another replica holds), and this replica computes the rest and samples the
    first token itself.
    ``lora``: the LoRA adapter it runs with (``duet.lora``), None for the base model;
    ``lora_path``: its folder, which an engine that does not hold it loads it from (None: an
    adapter named in the engine's config). ``own_prompt_len``: where ``prompt_token_ids`` hold a
    resumed sequence's context (its prompt, then its outputs but the last, which its decode
    replica computes), its own prompt's length: a RoPE that depends on the sequence's length
    rotates those outputs as generated tokens (None: the prompt is its own).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    kv_send: KVDestination | None = None
    kv_receive: bool = False
    kv_receive_tokens: int | None = None
    lora: str | None = None
    lora_path: str | None = None
    own_prompt_len: int | None = None

    def check_pull(self) -> None:
        """A pull (``kv_receive_tokens``) brings the KV of some of a new prompt's leading tokens,
        at least one, and leaves at least its last to compute (its logits sample the first
        token); no prompt logprobs (the replica that sends the KV computes none of them)."""
        if self.kv_receive_tokens is None:
            return
        num_pulled, num_prompt = self.kv_receive_tokens, len(self.prompt_token_ids)
        if not self.kv_receive or self.output_token_ids or self.params.prompt_logprobs is not None:
            raise InvalidRequestError("kv_receive_tokens is for a new sequence's prompt KV, received, no prompt logprobs")
        if not 0 < num_pulled < num_prompt:
            raise InvalidRequestError(f"kv_receive_tokens is {num_pulled}: it must be from 1 to {num_prompt - 1}, the prompt less one")


@dataclass
class TokenDelta:
    """What an engine produced for one sequence since its previous delta.

    ``finished``: the engine is done with the sequence. ``finish_reason`` is the sequence's own
    (None while it goes on, here or on the decode replica its KV went to). ``error`` says why the
    engine failed it; ``kv_lost`` marks the failure of a prompt KV that never arrived (the
    router may compute the prompt elsewhere).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_lost: bool = False
    # With the first token of a request that asked for them: each prompt token's top logprobs
    # (its own among them) after the tokens before it; None for the first, which has none.
    prompt_logprobs: list[dict[int, float] | None] | None = None


# Replicas report their stats this often, even mid-step. Serve sends every changed report to every
# router of the pool, so a report unchanged but for its time is sent as it was (its time too) for
# up to ``UNCHANGED_REPORT_S``: an idle replica's report then changes that often, not every period.
# ``duet status`` calls a replica whose last report is ``REPLICA_SILENT_S`` old stale.
ROUTING_STATS_PERIOD_S = 0.5
UNCHANGED_REPORT_S = 4.0
REPLICA_SILENT_S = 8.0


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues (``Scheduler.stats``). Counters are totals since the engine started."""

    num_running: int
    num_waiting: int  # waiting to be scheduled, their KV arrived ones among them
    num_preemptions: int
    prompt_tokens_pending: int  # prompt tokens queued or in their prefill
    new_prompt_tokens_pending: int  # of those, of sequences with no output yet (not recomputed): prefill's kind of work
    num_decoding_blocks: int  # KV blocks of sequences past their prompt (not of prompts, nor reserved for transfers)
    num_decode_waiting: int  # sequences past their prompt that cannot run for lack of room (preempted, or KV arrived)

    @property
    def num_sequences(self) -> int:
        """Running and waiting: a replica's load as the routers weigh it."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class KVCacheStats:
    """The KV cache (``KVCacheManager.stats``): its blocks, its prefix cache's lookups (in
    prompt tokens) and what its blocks hold."""

    num_free_blocks: int
    num_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_dtype: str  # the setting ("auto": the model's dtype)
    kv_dtype: str  # the dtype the KV cache is in (bfloat16, int8, ...)
    kv_bytes_per_block: int  # across this replica's layers, K and V
    # The second tier (``kv_offload``): blocks it can hold and holds, blocks written and restored.
    tier_capacity_blocks: int
    tier_blocks: int
    tier_saved_blocks: int
    tier_restored_blocks: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class TransferStats:
    """KV transfers (``KVConnectorScheduler.stats``): bytes moved, transfers done, failed and
    cancelled (their request was aborted: not a failure), seconds from announcement to
    acknowledgement, and the transfers reserved or under way now; of the sends, the bytes and
    the seconds they took less their waits for the forward (``wire_bytes / wire_seconds``: what
    this replica's sends move a second, for the router's cost of pulling a history)."""

    bytes: int
    transfers: int
    failures: int
    cancelled: int
    seconds: float
    pending: int
    wire_bytes: int
    wire_seconds: float


@dataclass(frozen=True)
class LoadStats:
    """What the engine measured of its own load (``LoadTracker.stats``; ``duet.load``)."""

    prefill_tokens_per_s: float  # measured prompt throughput (0: not measured yet)
    tokens_per_s: float  # all the tokens per second of the steps that measured it: what a prompt token costs
    tpot_s: float  # recent steps that decoded: each decoding sequence's wait per token it got
    decode_only_tpot_s: float  # the same, of steps that computed no prompt (0: none seen yet)
    ttft_s: float  # recent requests' wait for their first token computed here
    output_tokens_per_s: float


@dataclass(frozen=True)
class CoreStats:
    """The cores an engine computes on (``LLMEngine.stats``; ``duet.cores``)."""

    threads: int  # torch threads of its steps
    shared_cores: bool  # it shares its machine's cores with the other engines there, step by step
    core_wait_s: float  # a decoder: time it yielded to prompts; a prompt engine: time it waited for decoders to yield


@dataclass(frozen=True)
class LoRAStats:
    """The LoRA adapters an engine holds (``duet.lora.LoRASlots``), least recently used first,
    and how many it loaded and evicted (to load another, ``max_loras`` being held)."""

    held: list[str]
    max_loras: int
    loads: int
    evictions: int


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding (``SpecDecodingStats.stats``): drafts (one request's proposal
    verified in one step), their tokens, those accepted, and per position the drafts whose
    token there was accepted."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft (the accepted ones plus the target's own); 0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class EngineStats:
    """An engine's stats (``LLMEngine.stats``), each part from its owner."""

    scheduler: SchedulerStats
    kv: KVCacheStats
    transfer: TransferStats
    load: LoadStats
    spec: SpecStats
    cores: CoreStats
    lora: LoRAStats
    worker_failure: str | None  # a worker died: the engine cannot step any more


# The parts of a report, by field name: what ``ReplicaStats.from_dict`` rebuilds.
_PARTS = {
    "scheduler": SchedulerStats, "kv": KVCacheStats, "transfer": TransferStats, "load": LoadStats, "spec": SpecStats, "cores": CoreStats,
    "lora": LoRAStats,
}


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's state, reported through Serve's ``record_routing_stats`` (as ``to_dict``)
    for routing, metrics and ``duet status``: its engine's stats and the replica's own. Counters
    are totals since the replica started."""

    stage: str
    replica_id: str
    node_id: str  # the Ray node the replica runs on ("" outside Ray)
    scheduler: SchedulerStats
    kv: KVCacheStats
    transfer: TransferStats
    load: LoadStats
    spec: SpecStats
    cores: CoreStats
    lora: LoRAStats
    worker_failure: str | None  # a worker died: the replica refuses work until Serve replaces it
    integrity_failures: int  # idle KV bookkeeping checks that failed (a leak, logged)
    prefix_hashes: list[int]  # a prefill replica's recalled prompt prefixes still in its prefix cache
    reported_at: float  # time.time() on the replica; a replica that stops reporting is gone

    @classmethod
    def compose(
        cls, stage: str, replica_id: str, node_id: str, engine: EngineStats, integrity_failures: int, prefix_hashes: list[int]
    ) -> ReplicaStats:
        return cls(
            stage=stage, replica_id=replica_id, node_id=node_id, scheduler=engine.scheduler, kv=engine.kv, transfer=engine.transfer,
            load=engine.load, spec=engine.spec, cores=engine.cores, lora=engine.lora, worker_failure=engine.worker_failure, integrity_failures=integrity_failures,
            prefix_hashes=prefix_hashes, reported_at=time.time(),
        )

    def to_dict(self) -> dict:
        """Plain nested dicts and lists, as Serve carries a routing report."""
        return asdict(self)

    def repeats(self, earlier: ReplicaStats | None) -> bool:
        """Whether this report says what ``earlier`` did, made less than ``UNCHANGED_REPORT_S``
        after it: the replica sends ``earlier`` again, and Serve has nothing new to send on."""
        if earlier is None or self.reported_at - earlier.reported_at >= UNCHANGED_REPORT_S:
            return False
        return replace(self, reported_at=earlier.reported_at) == earlier

    @classmethod
    def from_dict(cls, data: dict) -> ReplicaStats:
        return cls(**data | {name: part(**data[name]) for name, part in _PARTS.items()})

    def flat(self) -> dict:
        """One level of named values, for people and scripts (``/duet/status``, ``duet status``):
        the parts' fields (a transfer's and speculation's with the names their metrics have),
        the replica's own, and the KV cache's usage."""
        transfer, spec = self.transfer, self.spec
        return {
            "stage": self.stage,
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            **asdict(self.scheduler),
            **asdict(self.kv),
            "kv_usage": self.kv.kv_usage,
            "transfer_bytes": transfer.bytes,
            "transfers": transfer.transfers,
            "transfer_failures": transfer.failures,
            "transfers_cancelled": transfer.cancelled,
            "transfer_seconds": transfer.seconds,
            "pending_transfers": transfer.pending,
            "transfer_wire_bytes": transfer.wire_bytes,
            "transfer_wire_seconds": transfer.wire_seconds,
            **asdict(self.load),
            **asdict(self.cores),
            "spec_num_drafts": spec.num_drafts,
            "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_position": list(spec.accepted_per_position),
            "loras": list(self.lora.held),
            "lora_loads": self.lora.loads,
            "lora_evictions": self.lora.evictions,
            "worker_failure": self.worker_failure,
            "integrity_failures": self.integrity_failures,
            "prefix_hashes": list(self.prefix_hashes),
            "reported_at": self.reported_at,
        }
