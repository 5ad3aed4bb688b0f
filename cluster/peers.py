"""The other replicas serving decode, as a leaving replica reaches them to move its sequences
(``duet.decode_node.migration.Peers``), over Serve handles held by the replica itself."""

from __future__ import annotations

import asyncio

from duet.decode_node.migration import Target
from duet.messages import EngineRequest, Placement
from duet.router.serve_internals import new_call_context, replica_ids

MOVE_CALL_TIMEOUT_S = 10.0


class ServePeers:
    """The other replicas serving decode (``decode_node.migration.Peers``), through Serve handles
    on the pools held by the replica itself: ``pools`` by name, ``stage`` the decode pool's."""

    def __init__(self, pools: dict, stage: str) -> None:
        self._pools = pools
        self._stage = stage

    async def reserve(self, request: EngineRequest, num_prompt_blocks: int, to: Target | None = None) -> Placement:
        new_call_context()  # the moves' calls overlap (an abort, the next move)
        if to is None:
            call = self._pools[self._stage].reserve.remote(request, num_prompt_blocks=num_prompt_blocks, lora=request.lora)
        else:
            call = self._pools[to.pool].reserve.remote(request, num_prompt_blocks=num_prompt_blocks, replica_id=to.replica_id)
        return await asyncio.wait_for(call, MOVE_CALL_TIMEOUT_S)

    def abort(self, request_id: str, replica_id: str, pool: str | None = None) -> None:
        new_call_context()
        self._pools[pool or self._stage].abort.remote(request_id, replica_id=replica_id)

    def any_running(self) -> bool:
        return bool(replica_ids(self._stage))
