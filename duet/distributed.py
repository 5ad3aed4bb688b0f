"""Process groups built at run time from a ``TCPStore``, never a global ``init_process_group``:
a replica's tensor-parallel ranks and the KV transfer's pairwise groups live side by side in
one process, each under a key of its own. NCCL when every rank holds a CUDA device, gloo
otherwise; a gloo group listens on the address its rank was given, never on whatever the
machine's hostname resolves to.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> dist.TCPStore:
    """A store listening on ``host`` only (a TCPStore left to itself listens on every
    interface); port 0 picks a free one (read it back from ``store.port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    bound_port = listener.getsockname()[1]
    return dist.TCPStore(
        host, bound_port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=listener.detach(),  # the store owns the socket now
    )


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def new_group(store: dist.Store, rank: int, world_size: int, use_cuda: bool, host: str, timeout_s: float):
    """``(backend, group)``: the ranks that meet under ``store`` (a ``PrefixStore`` unique to
    the group and the attempt), every wait bounded by ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return "nccl", dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return "gloo", dist.ProcessGroupGloo(store, rank, world_size, options)


class TensorParallelGroup:
    """A replica's tensor-parallel ranks: the collectives its sharded modules call. Every rank
    makes the same calls in the same order (each runs the same step on the same inputs).
    ``seconds`` and ``calls`` count the time spent in them (waiting for slower ranks included)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, use_cuda: bool, host: str, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend, self.group = new_group(dist.PrefixStore("duet/tp", store), rank, world_size, use_cuda, host, timeout_s)
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous) over the ranks, in place; every rank gets the same bits."""
        started = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self._count(started)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order."""
        started = time.perf_counter()
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([gathered], [tensor.contiguous()]).wait()
        self._count(started)
        return gathered

    def _count(self, started: float) -> None:
        # On a GPU the wait returns once the collective is queued: time only means something on CPU.
        self.seconds += time.perf_counter() - started
        self.calls += 1
