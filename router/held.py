"""The contexts this router's sequences ended with on each decode replica, known the moment
they end: a conversation's next turn is often sent within milliseconds of the last one's end,
while the replica's report that it holds that history (``ReplicaStats.prefix_hashes``) comes
within a second or so. The balancer counts both (``duet.router.balance``), for the prefill
pool too (the contexts this router had it compute: its own record, so that neither side's
reports lag the other's), and a context it
sends to be computed where its history is goes to the replica named here first
(``DecodeStream``; in PD, the one the reports name where they say more), as does a colocated
pool's (the pool's router, by the reports, otherwise),
unless that replica is busier than the least loaded by more than the pools' routers allow
(``duet.router.targets.Targets.holder``, settled once for the choice: ``Orchestrator._history_source``).

A record lasts ``HELD_TTL_S``, by when the replica's reports name what it still holds; a
record whose blocks the replica evicted sooner costs at most one context computed there whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from duet.block_pool import routing_block_hashes, routing_depths

HELD_TTL_S = 30.0
HELD_LIMIT = 8192  # routing hashes kept (36 for a 2,048-token context)


@dataclasses.dataclass(frozen=True)
class Holder:
    """A replica (of ``pool``; None: one of the pool's) that this router saw end a context's
    first ``blocks`` blocks."""

    replica_id: str | None
    pool: str
    blocks: int  # the leading full blocks of the context it holds

    def pull_length(self, num_context_tokens: int, block_size: int) -> int | None:
        """The tokens of a context it sends when too busy to take it (a pull): its held blocks'
        and one more (the least its engine computes), at most all but the context's last (the
        receiver's logits sample the first token); None where it holds no block of those."""
        blocks = min(self.blocks, (num_context_tokens - 2) // block_size)
        return blocks * block_size + 1 if blocks > 0 else None


class HeldContexts:
    """Routing hash -> the replica that last ended a sequence holding it, and when."""

    def __init__(self, block_size: int, ttl_s: float = HELD_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.clock = clock
        self._held: OrderedDict[int, tuple[str, str, float]] = OrderedDict()  # routing hash -> replica, pool, when

    def add(self, replica_id: str | None, pool: str, token_ids: Sequence[int], lora: str | None = None, lora_path: str | None = None) -> None:
        """A sequence ended on ``replica_id`` (of ``pool``; None: not known) with its KV computed for ``token_ids``."""
        now = self.clock()
        for block_hash in routing_block_hashes(token_ids, self.block_size, lora, lora_path):
            self._held[block_hash] = (replica_id, pool, now)
            self._held.move_to_end(block_hash)
        while len(self._held) > HELD_LIMIT:
            self._held.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """The replica died: it holds nothing."""
        for block_hash in [block_hash for block_hash, entry in self._held.items() if entry[0] == replica_id]:
            del self._held[block_hash]

    def holder(self, prefix_hashes: Sequence[int]) -> Holder | None:
        """The replica that ended a sequence with the deepest of ``prefix_hashes`` (routing
        hashes: a chained hash names its whole prefix) in the last ``ttl_s``, or None."""
        since = self.clock() - self.ttl_s
        best = None
        for block_hash, depth in zip(prefix_hashes, routing_depths()):
            entry = self._held.get(block_hash)
            if entry is not None and entry[2] >= since:
                best = Holder(entry[0], entry[1], depth)
        return best
