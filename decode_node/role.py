"""The decode role of the one replica class (``duet.cluster.replica``), and the colocated one.

A decode replica takes the router's sequences with ``kv_receive``: the engine reserves the
prompt's blocks at once and the replica answers with the ``KVDestination`` the prefill replica
streams into; the sequence joins the continuous batch (with speculative decoding) when its KV
and first token are in, and its tokens stream back. Short prompts, and sequences resumed after
their KV was lost, come without ``kv_receive`` and are prefilled here. A colocated replica does
everything locally and receives no KV.
"""

from __future__ import annotations

from duet.errors import InvalidRequestError
from duet.messages import EngineRequest


class DecodeRole:
    def __init__(self, colocated: bool = False) -> None:
        self.stage = "colocated" if colocated else "decode"
        self.colocated = colocated

    @staticmethod
    def engine_args(args: dict) -> dict:
        return args

    def admit(self, request: EngineRequest, block_size: int) -> None:
        if request.kv_send is not None:
            raise InvalidRequestError("a decode replica does not send prompt KV (kv_send)")
        if self.colocated and request.kv_receive:
            raise InvalidRequestError("a colocated replica computes its own prompts; it receives no KV")

    @staticmethod
    def prefix_hashes(engine) -> list[int]:
        """A decode pool's router ranks by room, not by cached prefixes: it reports none."""
        return []
