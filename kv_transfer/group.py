"""Pairwise process groups built at run time, without a global ``init_process_group``.

Each receiving (decode) worker hosts one ``TCPStore``; a sending (prefill) worker that has
never met it connects to that store's address, the two exchange their ``KVSpec`` through
it (the handshake) and then build a 2-rank group under a key unique to the pair and the
attempt: rank 0 receives, rank 1 sends. NCCL when both hold CUDA devices, gloo otherwise;
a gloo group listens on the address each side was given (``kv_transfer.host``). Two CPU ends on
one machine that both allow it move the runs through shared memory (``shm.py``), the group
carrying signals only.
"""

from __future__ import annotations

import datetime
import json
import socket

import torch
import torch.distributed as dist

from duet.distributed import connect_store as connect_to
from duet.distributed import new_group
from duet.kv_transfer.shm import SharedRuns, agree
from duet.kv_transfer.spec import KVSpec
from duet.messages import KVEndpoint

RECEIVER_RANK = 0
SENDER_RANK = 1


class PeerUnreachableError(RuntimeError):
    """The other replica did not join the group in time."""


def connect_store(endpoint: KVEndpoint, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of the receiver's store. A receiver's store listens from its start to its end, so
    a port that refuses the connection is a receiver gone: that fails at once, where the store's
    client would retry for twice ``timeout_s`` (and hold the blocks of every transfer queued)."""
    try:
        socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s).close()
    except OSError as error:
        raise PeerUnreachableError(f"no KV receiver at {endpoint.host}:{endpoint.port}: {error}") from error
    return connect_to(endpoint.host, endpoint.port, timeout_s)


class PairGroup:
    """A 2-rank group between one sender and one receiver, after a successful handshake."""

    def __init__(
        self, store: dist.Store, pair_key: str, rank: int, spec: KVSpec, use_cuda: bool, timeout_s: float, host: str = "127.0.0.1",
        shared_memory: bool = False,
    ):
        self.pair_key = pair_key
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        prefix = dist.PrefixStore(f"duet/{pair_key}", store)
        peer = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
        prefix.set(f"spec/{rank}", json.dumps(spec.to_dict()))
        prefix.set(f"cuda/{rank}", "1" if use_cuda else "0")
        try:
            prefix.wait([f"spec/{peer}", f"cuda/{peer}"], self.timeout)
        except RuntimeError as error:
            raise PeerUnreachableError(f"peer of pair {pair_key} did not handshake within {timeout_s}s") from error
        self.peer_spec = KVSpec.from_dict(json.loads(prefix.get(f"spec/{peer}")))
        spec.check_compatible(self.peer_spec)
        both_cuda = use_cuda and prefix.get(f"cuda/{peer}") == b"1"
        self.backend, self.group = new_group(dist.PrefixStore("group", prefix), rank, 2, both_cuda, host, timeout_s)
        self.peer = peer
        # The runs' slots where both ends share memory (and want to), else None: the runs go on the wire.
        self.shared: SharedRuns | None = agree(prefix, rank == SENDER_RANK, shared_memory and not use_cuda, self.timeout)

    def send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.group.send([tensor], self.peer, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.group.recv([tensor], self.peer, tag)
