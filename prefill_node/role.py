"""The prefill role of the one replica class (``duet.cluster.replica``).

A prefill replica runs the engine on sequences the router sends with a ``kv_send``
destination: it computes the prompt (prefix cache, chunked), streams its KV to the decode
replica that reserved it, and answers with the first token. It loads no speculative draft
(nothing is decoded here), and it reports the routing hashes of the prompts it holds in its
prefix cache (``duet.block_pool.RecalledPrefixes``: a few depths of each prompt's chain), so
the router can send a prompt where the longest part of it already is.
"""

from __future__ import annotations

from duet.block_pool import RecalledPrefixes
from duet.errors import InvalidRequestError
from duet.messages import EngineRequest


class PrefillRole:
    stage = "prefill"

    def __init__(self) -> None:
        self._prefixes = RecalledPrefixes()

    @staticmethod
    def engine_args(args: dict) -> dict:
        # An application-wide draft would be loaded for nothing: prefill samples one token.
        return args | {"speculative_config": None}

    def admit(self, request: EngineRequest, block_size: int) -> None:
        if request.kv_send is None:
            raise InvalidRequestError("a prefill replica computes prompts whose KV goes to a decode replica (kv_send)")
        self._prefixes.add(request.prompt_token_ids, block_size, request.lora, request.lora_path)

    def prefix_hashes(self, engine) -> list[int]:
        """The recalled prefixes still in the engine's prefix cache, for its routing report."""
        return self._prefixes.cached(engine)
