"""What travels from prefill to router to decode about one request's KV. Small and picklable."""

from __future__ import annotations

from dataclasses import dataclass

from duet.kv_transfer.group import Endpoint


@dataclass(frozen=True)
class KVHandle:
    """A prefilled request: its prompt, its first token, and where its KV waits to be pulled."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    num_kv_tokens: int
    source: str  # the prefill node's id, which names the pair on the decode side
    transfer_id: int


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill node streams a request's KV when the decode replica is chosen first."""

    transfer_id: int
    endpoint: Endpoint
    pair_key: str
