"""What the router and the replicas send each other over Serve. Plain dataclasses of ints,
strings and lists, importable without torch, so the router never loads the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    is leaving its pool): ``token_ids`` are its output so far, all streamed before; it goes on
    at ``replica_id`` (attach to it there), or, if None, must be recomputed elsewhere."""

    replica_id: str | None
    token_ids: list[int]


@dataclass
class EngineRequest:
    """One sequence for an engine, as the router hands it to a replica (token ids, never text).

    ``output_token_ids``: tokens generated before, elsewhere (a request resumed after its KV was
    lost); the engine recomputes their KV and goes on from them. ``kv_send``: a prefill
    replica's request: ship the prompt's KV there and stop after the first token. ``kv_receive``:
    a decode replica's request whose prompt KV (and first token) come from a prefill replica.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    kv_send: KVDestination | None = None
    kv_receive: bool = False


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


# Replicas report their stats every 0.5 s, even mid-step; one silent this long is taken for dead.
REPLICA_SILENT_S = 3.0


@dataclass
class ReplicaStats:
    """One replica's state, reported through Serve's ``record_routing_stats`` for routing,
    metrics and ``duet status``. Counters are totals since the replica started."""

    stage: str
    replica_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    block_size: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_dtype: str = "auto"  # the setting
    kv_dtype: str = ""  # the dtype the KV cache is in (bfloat16, int8, ...)
    kv_bytes_per_block: int = 0  # across this replica's layers, K and V
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    transfer_bytes: int = 0
    transfers: int = 0
    transfer_failures: int = 0
    transfers_cancelled: int = 0  # their requests were aborted: not failures
    transfer_seconds: float = 0.0
    pending_transfers: int = 0
    prompt_tokens_pending: int = 0  # prompt tokens queued or in their prefill
    new_prompt_tokens_pending: int = 0  # of those, of sequences with no output yet (not recomputed): prefill's kind of work
    num_decoding_blocks: int = 0  # KV blocks of sequences past their prompt (not of prompts, nor reserved for transfers)
    num_decode_waiting: int = 0  # sequences past their prompt that cannot run for lack of room (preempted, or KV arrived)
    prefill_tokens_per_s: float = 0.0  # measured prompt throughput (0: not measured yet)
    tokens_per_s: float = 0.0  # all the tokens per second of the steps that measured it: what a prompt token costs
    tpot_s: float = 0.0  # recent steps that decoded: each decoding sequence's wait per token it got
    decode_only_tpot_s: float = 0.0  # the same, of steps that computed no prompt (0: none seen yet)
    ttft_s: float = 0.0  # recent requests' wait for their first token computed here
    output_tokens_per_s: float = 0.0
    integrity_failures: int = 0  # idle KV bookkeeping checks that failed (a leak, logged)
    worker_failure: str | None = None  # a worker died: the replica refuses work until Serve replaces it
    prefix_hashes: list[int] = field(default_factory=list)
    reported_at: float = 0.0  # time.time() on the replica; a replica that stops reporting is gone

    @classmethod
    def collect(cls, stage: str, replica_id: str, engine, **extra) -> ReplicaStats:
        """Read an ``LLMEngine``'s counters (its KV transfers' among them)."""
        return cls(stage=stage, replica_id=replica_id, reported_at=time.time(), **engine.stats(), **extra)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft (the accepted ones plus the target's own); 0 before any."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0
