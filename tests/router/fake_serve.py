"""An in-memory stand-in for a pool's Serve request router, registered where the pool view
(``duet.router.serve_internals``) looks: replicas with the stats they reported, no Ray."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

from duet.messages import ReplicaStats
from duet.router import serve_internals


def replica_stats(replica_id: str, **fields) -> dict:
    values = dict(stage="decode", replica_id=replica_id, num_running=0, num_waiting=0, num_free_blocks=100, num_blocks=100,
                  block_size=16, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, reported_at=time.time())
    return dataclasses.asdict(ReplicaStats(**values | fields))


@dataclasses.dataclass(frozen=True)
class ReplicaID:
    unique_id: str


class FakePool:
    """What the pool view reads of a request router: its running replicas (``curr_replicas``,
    keyed by their ids as Serve's are), each with its last report (``{}`` before one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.curr_replicas: dict[ReplicaID, SimpleNamespace] = {}

    def set(self, replica_id: str, **stats) -> None:
        """A running replica; with ``stats``, the report it last made (``reported=False``: none yet)."""
        reported = stats.pop("reported", True)
        routing_stats = replica_stats(replica_id, **stats) if reported else {}
        self.curr_replicas[ReplicaID(replica_id)] = SimpleNamespace(replica_id=ReplicaID(replica_id), routing_stats=routing_stats)

    def remove(self, replica_id: str) -> None:
        del self.curr_replicas[ReplicaID(replica_id)]
        serve_internals.departed([replica_id])
