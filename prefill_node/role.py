"""The prefill role of the one replica class (``duet.cluster.replica``).

A prefill replica runs the engine on sequences the router sends with a ``kv_send``
destination: it computes the prompt (prefix cache, chunked), streams its KV to the decode
replica that reserved it, and answers with the first token. It loads no speculative draft
(nothing is decoded here), and it reports the routing hashes of the prompts it holds in its
prefix cache (``duet.block_pool.routing_block_hashes``: a few depths of each prompt's chain), so
the router can send a prompt where the longest part of it already is.
"""

from __future__ import annotations

from collections import OrderedDict

from duet.block_pool import routing_block_hashes
from duet.errors import InvalidRequestError
from duet.messages import EngineRequest

# How many routing hashes the replica recalls (9 for a 2,048-token prompt; a conversation's turns share theirs).
MAX_REPORTED_PREFIXES = 2048


class PrefillRole:
    stage = "prefill"

    def __init__(self) -> None:
        self._prefixes: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def engine_args(args: dict) -> dict:
        # An application-wide draft would be loaded for nothing: prefill samples one token.
        return args | {"speculative_config": None}

    def admit(self, request: EngineRequest, block_size: int) -> None:
        if request.kv_send is None:
            raise InvalidRequestError("a prefill replica computes prompts whose KV goes to a decode replica (kv_send)")
        for block_hash in routing_block_hashes(request.prompt_token_ids, block_size, request.lora, request.lora_path):
            self._prefixes[block_hash] = None
            self._prefixes.move_to_end(block_hash)
        while len(self._prefixes) > MAX_REPORTED_PREFIXES:
            self._prefixes.popitem(last=False)

    def prefix_hashes(self, engine) -> list[int]:
        """The recalled prefixes still in the engine's prefix cache, for its routing report."""
        return engine.cached_prefixes(list(self._prefixes))
