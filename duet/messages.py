"""What the router and the replicas send each other over Serve. Plain dataclasses of ints,
strings and lists, importable without torch, so the router never loads the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StreamDelta:
    """New output of one sequence since the previous delta."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class PrefillReply:
    """A prefill replica's answer: the first token and, when the request goes on, the
    ``KVHandle`` (as a dict) that a decode replica pulls the KV with."""

    first: StreamDelta
    kv_handle: dict | None
    replica_id: str


@dataclass
class KVTarget:
    """The decode replica's reply to a ``KVHandle``: where the prefill replica must send the KV."""

    replica_id: str
    transfer_id: int
    endpoint: dict
    pair_key: str


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
    integrity_failures: int = 0  # idle KV bookkeeping checks that failed (a leak, logged)
    prefix_hashes: list[int] = field(default_factory=list)
    reported_at: float = 0.0  # time.time() on the replica; a replica that stops reporting is gone

    @classmethod
    def collect(cls, stage: str, replica_id: str, engine, transfer, **extra) -> ReplicaStats:
        """Read an ``LLMEngine``'s counters and a sender's or receiver's ``TransferStats``."""
        return cls(
            stage=stage,
            replica_id=replica_id,
            reported_at=time.time(),
            **engine.stats(),
            transfer_bytes=transfer.bytes,
            transfers=transfer.transfers,
            transfer_failures=transfer.failures,
            transfers_cancelled=transfer.cancelled,
            transfer_seconds=transfer.seconds,
            **extra,
        )

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft (the accepted ones plus the target's own); 0 before any."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


class DeltaCursor:
    """Turns one sequence's cumulative outputs into deltas; starts after what was already sent
    (a transferred request's first token and its text went out from the prefill replica)."""

    def __init__(self, num_sent_tokens: int = 0, num_sent_chars: int = 0) -> None:
        self.num_sent_tokens = num_sent_tokens
        self.num_sent_chars = num_sent_chars
        self.num_sent_logprobs = 0

    def advance(self, completion, num_cached_tokens: int = 0) -> StreamDelta:
        """``completion`` is a cumulative ``CompletionOutput``."""
        token_ids = completion.token_ids[self.num_sent_tokens :]
        text = completion.text[self.num_sent_chars :]  # empty while held-back text is shorter
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[self.num_sent_logprobs :]
            self.num_sent_logprobs = len(completion.logprobs)
        self.num_sent_tokens = len(completion.token_ids)
        self.num_sent_chars = max(self.num_sent_chars, len(completion.text))
        return StreamDelta(text, token_ids, logprobs, completion.finish_reason, completion.stop_reason, num_cached_tokens)


class InvalidRequestError(ValueError):
    """A replica refused the request as given (HTTP 400); the message says what to change."""


class ReplicaFullError(RuntimeError):
    """The replica has no KV room for this request right now; another replica or a later try may."""


class KVTransferFailedError(RuntimeError):
    """The prompt's KV never reached the decode replica and its policy is to fail the request."""


class ReplicaGoneError(RuntimeError):
    """A call pinned to a replica that no longer runs; what it held there is gone with it."""

    @classmethod
    def check(cls, replica_id: str, here: str) -> None:
        """Refuse a pinned call that Serve routed here because its replica is gone."""
        if replica_id != here:
            raise cls(f"replica {replica_id} is gone")


class RequestFailedError(RuntimeError):
    """The engine failed on this request, with it alone in a step; the others went on (HTTP 500)."""
