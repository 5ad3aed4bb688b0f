"""What both ends of a KV transfer must agree on, checked in the handshake."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class KVSpecMismatchError(ValueError):
    """The two replicas lay out KV differently; the message names every field that differs."""


@dataclass(frozen=True)
class KVSpec:
    """The KV cache layout of one replica: what a block of one layer holds, and how."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVSpec:
        return cls(**data)

    def check_compatible(self, peer: KVSpec) -> None:
        """Raise ``KVSpecMismatchError`` unless ``peer`` lays out KV exactly like this replica."""
        diffs = [
            f"{name}: here {mine!r}, peer {theirs!r}"
            for name, mine in asdict(self).items()
            if mine != (theirs := getattr(peer, name))
        ]
        if diffs:
            raise KVSpecMismatchError(
                "prefill and decode replicas disagree on the KV layout (" + "; ".join(diffs) + "); "
                "deploy both pools with the same model, block_size and dtype"
            )
