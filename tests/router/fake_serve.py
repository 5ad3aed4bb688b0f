"""An in-memory stand-in for a pool's Serve request router, registered where the pool view
(``duet.router.serve_internals``) looks: replicas with the stats they reported, no Ray."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

from duet.messages import CoreStats, KVCacheStats, LoadStats, LoRAStats, ReplicaStats, SchedulerStats, SpecStats, TransferStats
from duet.router import serve_internals


def make_stats(stage: str = "decode", replica_id: str = "r", **fields) -> ReplicaStats:
    """A replica's report: zeros (100 blocks of 16 tokens, all free) but for ``fields``, each
    named as in the part that has it (``num_free_blocks``: the KV cache's) or the report's own."""
    parts = {
        "scheduler": SchedulerStats(0, 0, 0, 0, 0, 0, 0),
        "kv": KVCacheStats(100, 100, 16, 0, 0, "auto", "bfloat16", 0, 0, 0, 0, 0),
        "transfer": TransferStats(0, 0, 0, 0, 0.0, 0, 0, 0.0),
        "load": LoadStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        "spec": SpecStats(0, 0, 0, []),
        "cores": CoreStats(1, False, 0.0),
        "lora": LoRAStats([], 4, 0, 0),
    }
    own = dict(worker_failure=None, integrity_failures=0, prefix_hashes=[], reported_at=time.time())
    for name, value in fields.items():
        part = next((part for part in parts if name in {field.name for field in dataclasses.fields(parts[part])}), None)
        if part is not None:
            parts[part] = dataclasses.replace(parts[part], **{name: value})
        elif name in own:
            own[name] = value
        else:
            raise TypeError(f"no stats field {name!r}")
    return ReplicaStats(stage=stage, replica_id=replica_id, node_id="", **parts, **own)


def replica_stats(replica_id: str, **fields) -> dict:
    """A report as Serve carries it."""
    return make_stats("decode", replica_id, **fields).to_dict()


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
