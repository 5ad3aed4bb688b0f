"""The decode role of the one replica class (``duet.cluster.replica``), and the colocated one.

A decode replica takes the router's sequences with ``kv_receive``: the engine reserves the
prompt's blocks at once and the replica answers with the ``KVDestination`` the prefill replica
streams into; the sequence joins the continuous batch (with speculative decoding) when its KV
and first token are in, and its tokens stream back. Short prompts, and sequences resumed after
their KV was lost, come without ``kv_receive`` and are prefilled here. A colocated replica does
everything locally and receives no KV. Either reports the routing hashes of the contexts its
prefix cache still holds (``duet.block_pool.RecalledPrefixes``): each prompt it computes and,
once a sequence ends, its prompt (computed or received) with its outputs. So a
conversation's next turn, which resends that history, is computed where the history is: its
pool's router sends it there, and the PD router's balancer prices it at the tokens past it
(``duet.router.balance``) rather than sending the whole history to a prefill replica that
holds at most the last prompt.
"""

from __future__ import annotations

from duet.block_pool import RecalledPrefixes
from duet.errors import InvalidRequestError
from duet.messages import EngineRequest


class DecodeRole:
    def __init__(self, colocated: bool = False) -> None:
        self.stage = "colocated" if colocated else "decode"
        self.colocated = colocated
        self._prefixes = RecalledPrefixes()

    @staticmethod
    def engine_args(args: dict) -> dict:
        return args

    def admit(self, request: EngineRequest, block_size: int) -> None:
        if request.kv_send is not None:
            raise InvalidRequestError("a decode replica does not send prompt KV (kv_send)")
        if self.colocated and request.kv_receive:
            raise InvalidRequestError("a colocated replica computes its own prompts; it receives no KV")
        if not request.kv_receive:  # a received prompt counts once its sequence ends (below): a replica
            # lost mid-stream must not draw its sequences' recomputing back by its last report
            self._prefixes.add(request.prompt_token_ids, block_size, request.lora, request.lora_path)

    def prefix_hashes(self, engine) -> list[int]:
        """The recalled contexts' prefixes still in the engine's prefix cache, for its routing
        report: the prompts it computes, and the sequences that ended since the last report, each
        with the tokens it made (``KVCacheManager.finished_contexts``: with a received prompt's
        first token, which only the engine saw)."""
        finished = engine.kv_cache_manager.finished_contexts
        while finished:
            token_ids, lora, lora_path = finished.popleft()
            self._prefixes.add(token_ids, engine.block_size, lora, lora_path)
        return self._prefixes.cached(engine)
