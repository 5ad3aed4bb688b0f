"""Process groups built at run time from a ``TCPStore``, never a global ``init_process_group``:
a replica's tensor-parallel ranks and the KV transfer's pairwise groups live side by side in
one process, each under a key of its own. NCCL when every rank holds a CUDA device, gloo
otherwise; a gloo group listens on the address its rank was given, never on whatever the
machine's hostname resolves to. CPU ranks on one machine exchange through shared memory
instead (``SharedMemoryExchange``): over gloo, SmolLM2's TP=2 decode step on two cores spent
0.7 ms a collective (60 ms a step at batch 1; 13 ms through shared memory).
"""

from __future__ import annotations

import datetime
import os
import platform
import secrets
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


class SharedMemoryExchange:
    """Collectives among CPU ranks of one machine through one shared segment. A call copies the
    rank's tensor into its slot and raises its flag to the call's number; once every flag is up,
    each rank reads every slot (an all-reduce sums them in rank order: every rank gets the same
    bits). Calls alternate between two sets of slots: a rank that raised its flag for call g + 1
    has finished reading call g, so no slot is rewritten (call g + 2) before all have read it.
    A wait spins, yielding the core, for at most the timeout. It relies on x86's ordering (a
    flag's store is seen after the data's, loads in order): other machines use gloo."""

    SLOT_BYTES = 8 << 20  # larger tensors (long prompt chunks of big models) go through gloo
    FLAG_STRIDE = 8  # one int64 flag per 64-byte line

    @staticmethod
    def available() -> bool:
        return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.call = 0
        header = world_size * self.FLAG_STRIDE * 8
        size = header + 2 * world_size * self.SLOT_BYTES
        if rank == 0:
            path = f"/dev/shm/duet-tp-{os.getpid()}-{secrets.token_hex(4)}"
            with open(path, "wb") as segment:
                segment.truncate(size)  # zeros: every flag down
            store.set("shm/path", path)
        path = store.get("shm/path").decode()
        self.memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        store.set(f"shm/attached/{rank}", "1")
        if rank == 0:  # once all have mapped it, the name goes: nothing is left behind, whatever dies
            store.wait([f"shm/attached/{other}" for other in range(world_size)])
            os.unlink(path)
        self.flags = self.memory[:header].view(torch.int64)[:: self.FLAG_STRIDE].numpy()
        self.slots = self.memory[header:].view(2, world_size, self.SLOT_BYTES)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.nbytes <= self.SLOT_BYTES

    def exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (contiguous, same shape and dtype on each), as views of the
        segment valid until the call after next."""
        self.call += 1
        slots = self.slots[self.call % 2, :, : tensor.nbytes]
        slots[self.rank].copy_(tensor.reshape(-1).view(torch.uint8))
        self.flags[self.rank] = self.call
        deadline = time.monotonic() + self.timeout_s
        while self.flags.min() < self.call:
            if time.monotonic() > deadline:
                missing = [rank for rank, flag in enumerate(self.flags) if flag < self.call]
                raise TimeoutError(f"tensor-parallel ranks {missing} did not join call {self.call} within {self.timeout_s} s")
            os.sched_yield()
        return [slot.view(tensor.dtype).view(tensor.shape) for slot in slots]


class TensorParallelGroup:
    """A replica's tensor-parallel ranks: the collectives its sharded modules call. Every rank
    makes the same calls in the same order (each runs the same step on the same inputs).
    ``seconds`` and ``calls`` count the time spent in them (waiting for slower ranks included).
    With ``same_machine`` (CPU ranks on one node), through shared memory where it fits.
    ``name`` tells apart the groups of one replica's pipeline stages. With ``ordered_sums``
    (``batch_invariant``) every sum adds the ranks' parts in rank order whatever the tensor's
    size, where a ring's order of additions depends on it (past two ranks)."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, use_cuda: bool, host: str, timeout_s: float, same_machine: bool = False,
        name: str = "tp", ordered_sums: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.ordered_sums = ordered_sums
        prefix = dist.PrefixStore(f"duet/{name}", store)
        self.backend, self.group = new_group(prefix, rank, world_size, use_cuda, host, timeout_s)
        self.shared = None
        if same_machine and not use_cuda and SharedMemoryExchange.available():
            self.shared = SharedMemoryExchange(prefix, rank, world_size, timeout_s)
            self.backend = "shared memory, gloo beyond it"
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous) over the ranks, in place; every rank gets the same bits."""
        started = time.perf_counter()
        parts = None  # every rank's tensor, to add here in rank order
        if self.shared is not None and self.shared.fits(tensor):
            parts = self.shared.exchange(tensor)
        elif self.ordered_sums and self.world_size > 2:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self.group.allgather([parts], [tensor]).wait()
        else:
            self.group.allreduce([tensor]).wait()
        if parts is not None:
            tensor.copy_(parts[0])
            for part in parts[1:]:
                tensor.add_(part)
        self._count(started)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order; read them before the
        next collective but one (through shared memory they are views of its slots)."""
        started = time.perf_counter()
        tensor = tensor.contiguous()
        if self.shared is not None and self.shared.fits(tensor):
            gathered = self.shared.exchange(tensor)
        else:
            gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self.group.allgather([gathered], [tensor]).wait()
        self._count(started)
        return gathered

    def _count(self, started: float) -> None:
        # On a GPU the wait returns once the collective is queued: time only means something on CPU.
        self.seconds += time.perf_counter() - started
        self.calls += 1


class PipelineGroup:
    """A replica's pipeline stages, of ``tensor_parallel_size`` ranks each (rank = stage x
    tensor_parallel_size + its rank in the stage): a stage's hidden states go to the rank of the
    same place in the next stage, and the tokens the last rank samples go to every rank (each
    keeps its own copy of the sequences). Every wait is bounded by the timeout, and timed
    (``seconds``, ``calls``: the transfers and the other stages' compute they wait for)."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, tensor_parallel_size: int, use_cuda: bool, host: str, timeout_s: float
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stride = tensor_parallel_size
        self.stage, self.num_stages = rank // tensor_parallel_size, world_size // tensor_parallel_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend, self.group = new_group(dist.PrefixStore("duet/pp", store), rank, world_size, use_cuda, host, timeout_s)
        self.seconds, self.calls = 0.0, 0

    def send_next(self, tensor: torch.Tensor, tag: int):
        """Start sending ``tensor`` (contiguous) to the next stage; wait on the returned work before reusing it."""
        return self.group.send([tensor], self.rank + self.stride, tag)

    def recv_previous(self, tensor: torch.Tensor, tag: int) -> torch.Tensor:
        self.wait(self.group.recv([tensor], self.rank - self.stride, tag))
        return tensor

    def broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = self.world_size - 1
        self.wait(self.group.broadcast([tensor], options))
        return tensor

    def wait(self, work) -> None:
        started = time.perf_counter()
        if not work.wait(self.timeout):
            raise TimeoutError(f"a pipeline stage did not answer within {self.timeout.total_seconds():g} s")
        self.seconds += time.perf_counter() - started
        self.calls += 1
