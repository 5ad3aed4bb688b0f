"""Sender and receiver threads that move requests' KV blocks over pairwise groups.

The decode side (receiver) decides a transfer: it allocates blocks, calls ``KVReceiver.expect``
and hands the prefill side the transfer id, its endpoint and the pair key it returns; the
prefill side (sender) calls ``KVSender.send``. Each pair has one thread per side, so the
engines' step loops never wait on the network.

Control and data travel apart. A gloo wait that times out tears the whole group down, so
nothing waits on gloo for a message that may never come. The sender announces each transfer
in the receiver's TCPStore (a numbered message: send transfer t of n blocks, or cancel it) once
its first run of layers is computed; only then do data messages follow, which are sure to come:
each run of layers' packed K/V (``wire.py``), a trailer saying whether the data is valid, and
an acknowledgement back. Transfers on a pair may be announced in any order: the receiver matches
them by id, and drains one it no longer expects (cancelled, timed out) into scratch buffers. A
request aborted mid-way still sends its remaining runs, read from blocks its node keeps until
the transfer ends, and a trailer that marks them invalid, so the pair stays in step. Only data
that does not come in time (the peer died or hung) breaks a pair: its transfers fail, its
threads end, and the receiver hands out a new pair key, under which a new group is built.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from duet.kv_transfer.group import RECEIVER_RANK, SENDER_RANK, Endpoint, PairGroup, connect_store, host_store
from duet.kv_transfer.spec import KVSpec
from duet.kv_transfer.wire import layer_runs, pack_layers, packed_shape, unpack_layers

logger = logging.getLogger(__name__)

_TRAILER_TAG = 0
_ACK_TAG = 1
_FIRST_LAYER_TAG = 2
# How long a blocked store wait lasts before it is renewed (a renewal logs a c10d warning).
_STORE_WAIT = datetime.timedelta(hours=1)
# A pair with nothing to do for this long ends its threads; the next transfer builds a new one.
PAIR_IDLE_S = 600.0
# How long a streamed transfer waits for its prompt's first layers: the prompt may be queued
# behind others on the prefill replica first. A request aborted meanwhile cancels it at once.
STREAM_START_TIMEOUT_S = 600.0


@dataclass
class TransferResult:
    """One transfer's outcome. ``seconds`` runs from the announcement to the acknowledgement: the
    wire time of a transfer whose KV was ready; a streamed one also spans the prefill it overlapped.
    ``cancelled``: not a failure, its request was aborted (on either side)."""

    transfer_id: int
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    cancelled: bool = False


@dataclass
class TransferStats:
    """Counters for metrics: bytes moved, transfers done and failed, time spent."""

    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    cancelled: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class TransferCancelled(Exception):
    """The request whose KV this is was aborted; what remains to send is not valid KV."""


class LayerProgress:
    """How many layers of a request's KV are computed, and its block ids once allocated.

    The engine marks layers as its forward pass writes them; the sender ships each run of
    layers as soon as it is complete, so the transfer overlaps the rest of the prefill.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._condition = threading.Condition()
        self._num_ready = 0
        self._block_ids: list[int] | None = None
        self._cancelled = False
        self.on_change = None  # called (without this object's lock) after every change

    @classmethod
    def complete(cls, num_layers: int, block_ids: list[int]) -> LayerProgress:
        progress = cls(num_layers)
        progress.mark_ready(num_layers, block_ids)
        return progress

    def mark_ready(self, num_ready: int, block_ids: list[int] | None = None) -> None:
        with self._condition:
            if block_ids is not None:
                self._block_ids = list(block_ids)
            self._num_ready = max(self._num_ready, num_ready)
            self._condition.notify_all()
        self._changed()

    def cancel(self) -> None:
        with self._condition:
            self._cancelled = True
            self._condition.notify_all()
        self._changed()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def ready(self, num_layers: int) -> bool:
        with self._condition:
            return self._num_ready >= num_layers and self._block_ids is not None

    def wait_for(self, num_layers: int, timeout_s: float) -> list[int]:
        """Block ids, once the first ``num_layers`` layers are computed; TransferCancelled if the
        request was aborted, TimeoutError if they do not come in time."""
        with self._condition:
            done = self._condition.wait_for(
                lambda: self._cancelled or (self._num_ready >= num_layers and self._block_ids is not None), timeout_s
            )
            if self._cancelled:
                raise TransferCancelled("the request was aborted")
            if not done:
                raise TimeoutError(f"layers 0-{num_layers - 1} not computed within {timeout_s}s")
            return self._block_ids

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


class _Endpoint:
    """What both sides share: the KV cache, results for ``poll()``, counters, the pairs' threads."""

    def __init__(self, kv_cache: torch.Tensor, spec: KVSpec, host: str, timeout_s: float) -> None:
        self.kv_cache = kv_cache
        self.spec = spec
        self.host = host
        self.timeout_s = timeout_s
        self.use_cuda = kv_cache.is_cuda
        self.closed = threading.Event()
        self.stats = TransferStats()
        self._results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._pairs: dict[str, _Pair] = {}
        self._threads: list[threading.Thread] = []  # every pair's, while it runs

    def _report(self, result: TransferResult) -> None:
        if result.ok:
            self.stats.bytes += result.num_bytes
            self.stats.transfers += 1
            self.stats.seconds += result.seconds
        elif result.cancelled:
            self.stats.cancelled += 1
        else:
            self.stats.failures += 1
        self._results.put(result)

    def poll(self) -> list[TransferResult]:
        """Transfers finished (or failed) since the last call."""
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def _group(self, store: dist.Store, pair_key: str, rank: int) -> PairGroup:
        return PairGroup(store, pair_key, rank, self.spec, self.use_cuda, self.timeout_s, self.host)

    def _wait(self, work, what: str) -> None:
        if not work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"{what} timed out after {self.timeout_s}s")

    def _buffers(self, num_blocks: int) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
        """The layer runs of a transfer and, for each, a view of one of two buffers in turn: run
        i+1 is on its way while run i is handled. Runs are equal but for a shorter last one."""
        runs = layer_runs(self.kv_cache, num_blocks)
        shape = packed_shape(self.kv_cache, *runs[0], num_blocks)
        buffers = [torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device) for _ in range(2)]
        return runs, [buffers[index % 2][: end - start] for index, (start, end) in enumerate(runs)]

    def _start(self, pair: _Pair) -> None:
        """Register a new pair (under ``_lock``) and start its thread."""
        self._pairs[pair.pair_key] = pair
        self._threads = [thread for thread in self._threads if thread.is_alive()]
        self._threads.append(pair.thread)
        pair.thread.start()

    @property
    def num_threads(self) -> int:
        """Pair threads still running, including those of pairs that broke or retired."""
        with self._lock:
            return sum(thread.is_alive() for thread in self._threads)

    def close(self) -> None:
        """Stop the pair threads (each notices at once unless it is mid-transfer)."""
        self.closed.set()
        with self._lock:
            pairs = list(self._pairs.values())
            self._lock.notify_all()
        for pair in pairs:
            pair.wake()
        for pair in pairs:
            pair.thread.join(timeout=1.0)


class _Pair:
    """One peer, one pair key, one thread; broken (and replaced) when data fails to arrive."""

    def __init__(self, owner: _Endpoint, pair_key: str) -> None:
        self.owner = owner
        self.pair_key = pair_key
        self.group: PairGroup | None = None
        self.idle_since = time.monotonic()
        self.thread = threading.Thread(target=self._guarded_run, name=f"kv-{pair_key}", daemon=True)

    def wake(self) -> None:
        pass

    def _guarded_run(self) -> None:
        try:
            self._run()
        except Exception as error:  # a network failure must reach the requests, not kill the replica
            if not self.owner.closed.is_set():
                logger.warning("KV transfer pair %s broke: %s", self.pair_key, error)
            self._break(str(error))

    def _run(self) -> None:
        raise NotImplementedError

    def _break(self, error: str) -> None:
        raise NotImplementedError


@dataclass
class _Expected:
    transfer_id: int
    block_ids: list[int]
    deadline: float
    pair: _ReceiverPair
    cancelled: bool = False


class KVReceiver(_Endpoint):
    """The decode side: hosts the store, receives KV straight into its own blocks."""

    def __init__(self, kv_cache, spec: KVSpec, host: str = "127.0.0.1", timeout_s: float = 30.0, name: str = "decode"):
        super().__init__(kv_cache, spec, host, timeout_s)
        self.name = name
        self.store = host_store(host, 0, timeout_s)
        self.endpoint = Endpoint(host, self.store.port)
        self._expected: dict[int, _Expected] = {}  # not announced yet
        self._active: dict[int, _Expected] = {}  # being received
        self._generation: dict[str, int] = {}
        self._next_idle_check = 0.0

    def pair_key(self, source: str) -> str:
        """The key the sender ``source`` must use: a new one after its last pair broke."""
        return f"{source}->{self.name}/{self._generation.get(source, 0)}"

    def expect(self, transfer_id: int, block_ids: list[int], source: str, timeout_s: float | None = None) -> str:
        """Receive transfer ``transfer_id`` into ``block_ids`` if ``source`` announces it within
        ``timeout_s`` (default: the endpoint's); returns the pair key to give the sender. Its
        result comes through ``poll()``, and only then may the blocks be freed."""
        pair_key = self.pair_key(source)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            pair = self._pairs.get(pair_key)
            if pair is None:
                pair = _ReceiverPair(self, pair_key, source)
                self._start(pair)
            self._expected[transfer_id] = _Expected(transfer_id, list(block_ids), deadline, pair)
        return pair_key

    def cancel(self, transfer_id: int) -> None:
        """The request went away: its transfer ends at once (or, mid-way, when its data is in),
        reported as failed through ``poll()``."""
        with self._lock:
            job = self._expected.pop(transfer_id, None) or self._active.get(transfer_id)
            if job is None:
                return
            job.cancelled = True
            if transfer_id in self._active:
                return
        self._report(TransferResult(transfer_id, False, error="cancelled", cancelled=True))

    def poll(self) -> list[TransferResult]:
        """Transfers finished (or failed) since the last call; announcements overdue fail here."""
        now = time.monotonic()
        idle = []
        with self._lock:
            overdue = [job for job in self._expected.values() if job.deadline <= now]
            for job in overdue:
                del self._expected[job.transfer_id]
            if now >= self._next_idle_check:
                self._next_idle_check = now + 1.0
                busy = {id(job.pair) for job in (*self._expected.values(), *self._active.values())}
                for pair in self._pairs.values():
                    if id(pair) in busy:
                        pair.idle_since = now
                    elif now - pair.idle_since > PAIR_IDLE_S:
                        idle.append(pair)
        for job in overdue:
            self._report(TransferResult(job.transfer_id, False, error="its KV was not announced in time"))
        for pair in idle:
            pair.retire()
        return super().poll()

    def _next_generation(self, pair: _ReceiverPair) -> None:
        with self._lock:
            if self._pairs.get(pair.pair_key) is pair:
                del self._pairs[pair.pair_key]
                self._generation[pair.source] = self._generation.get(pair.source, 0) + 1


class _ReceiverPair(_Pair):
    """Reads the pair's announcements in order and receives each announced transfer."""

    def __init__(self, owner: KVReceiver, pair_key: str, source: str) -> None:
        super().__init__(owner, pair_key)
        self.source = source
        self.control = dist.PrefixStore(f"duet/{pair_key}", owner.store)
        self.retired = False

    def wake(self) -> None:
        _announce(self.control, "wake")

    def retire(self) -> None:
        """Unused for long: end the thread; the next transfer from this source starts a new pair."""
        self.retired = True
        self.owner._next_generation(self)
        self.wake()

    def _run(self) -> None:
        owner = self.owner
        # A client of our own store: a blocked wait holds its connection.
        client = connect_store(owner.endpoint, owner.timeout_s)
        control = dist.PrefixStore(f"duet/{self.pair_key}", client)
        index = 0
        while not owner.closed.is_set() and not self.retired:
            index += 1
            key = f"m/{index}"
            while True:
                try:
                    control.wait([key], _STORE_WAIT)
                    break
                except dist.DistStoreError:
                    if owner.closed.is_set():
                        return
            message = control.get(key).decode().split()
            control.delete_key(key)
            if message[0] == "send":
                self._receive(client, int(message[1]), int(message[2]))
            elif message[0] == "cancel":
                self._sender_gave_up(int(message[1]), aborted=message[2] == "aborted")

    def _sender_gave_up(self, transfer_id: int, aborted: bool) -> None:
        with self.owner._lock:
            job = self.owner._expected.pop(transfer_id, None)
        if job is not None:
            error = "the prefill replica aborted the request" if aborted else "the prefill replica gave the transfer up"
            self.owner._report(TransferResult(transfer_id, False, error=error, cancelled=aborted))

    def _receive(self, client: dist.Store, transfer_id: int, num_blocks: int) -> None:
        owner = self.owner
        if not 0 < num_blocks <= owner.kv_cache.shape[3]:
            raise RuntimeError(f"transfer {transfer_id} announced with {num_blocks} blocks")
        with owner._lock:
            job = owner._expected.pop(transfer_id, None)
            if job is not None:
                owner._active[transfer_id] = job
        start = time.monotonic()
        if self.group is None:
            self.group = owner._group(client, self.pair_key, RECEIVER_RANK)
        mismatch = job is not None and len(job.block_ids) != num_blocks
        runs, received = owner._buffers(num_blocks)
        work = self.group.recv(received[0], _FIRST_LAYER_TAG)
        for index, (start_layer, end) in enumerate(runs):
            owner._wait(work, f"layers {start_layer}-{end - 1} of transfer {transfer_id}")
            if index + 1 < len(runs):
                work = self.group.recv(received[index + 1], _FIRST_LAYER_TAG + index + 1)
            if job is not None and not mismatch:
                unpack_layers(owner.kv_cache, start_layer, end, job.block_ids, received[index])
        trailer = torch.zeros(2, dtype=torch.int64)
        owner._wait(self.group.recv(trailer, _TRAILER_TAG), f"trailer of transfer {transfer_id}")
        with owner._lock:  # from here a cancel no longer reaches this transfer: it ends now
            owner._active.pop(transfer_id, None)
            accepted = job is not None and not mismatch and not job.cancelled and bool(trailer[1])
        owner._wait(self.group.send(torch.tensor([transfer_id, int(accepted)]), _ACK_TAG), f"ack of transfer {transfer_id}")
        if job is None:
            return  # drained: its request had gone (cancelled or timed out) and was told so then
        if accepted:
            num_bytes = sum(buffer.numel() * buffer.element_size() for buffer in received)
            owner._report(TransferResult(transfer_id, True, num_bytes, time.monotonic() - start))
        elif mismatch:
            owner._report(TransferResult(transfer_id, False, error=f"announced with {num_blocks} blocks, expected {len(job.block_ids)}"))
        else:
            error = "cancelled" if job.cancelled else "the prefill replica aborted the request mid-transfer"
            owner._report(TransferResult(transfer_id, False, error=error, cancelled=True))

    def _break(self, error: str) -> None:
        owner = self.owner
        owner._next_generation(self)
        with owner._lock:
            jobs = [job for job in (*owner._expected.values(), *owner._active.values()) if job.pair is self]
            for job in jobs:
                owner._expected.pop(job.transfer_id, None)
                owner._active.pop(job.transfer_id, None)
        for job in jobs:
            owner._report(TransferResult(job.transfer_id, False, error=f"pair {self.pair_key} broke: {error}"))


@dataclass
class _Send:
    transfer_id: int
    num_blocks: int
    progress: LayerProgress
    deadline: float  # to have the first run of layers computed


class KVSender(_Endpoint):
    """The prefill side: connects to receivers' stores and streams requests' blocks to them."""

    def __init__(self, kv_cache, spec: KVSpec, host: str = "127.0.0.1", timeout_s: float = 30.0):
        super().__init__(kv_cache, spec, host, timeout_s)
        self._jobs: dict[int, _Send] = {}

    def send(
        self,
        transfer_id: int,
        endpoint: Endpoint,
        pair_key: str,
        progress: LayerProgress,
        num_blocks: int,
        timeout_s: float | None = None,
    ) -> None:
        """Ship ``num_blocks`` blocks of a request, each run of layers once ``progress`` has it
        computed. Gives up (and tells the receiver) if the first run is not computed within
        ``timeout_s`` (default: the endpoint's). Its result comes through ``poll()``."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        job = _Send(transfer_id, num_blocks, progress, deadline)
        progress.on_change = self._wake_all
        with self._lock:
            pair = self._pairs.get(pair_key)
            if pair is None:
                pair = _SenderPair(self, pair_key, endpoint)
                self._start(pair)
            pair.jobs.append(job)
            self._jobs[transfer_id] = job
            self._lock.notify_all()

    def cancel(self, transfer_id: int) -> None:
        """The request was aborted: its transfer is given up, or sent on as invalid if under way."""
        with self._lock:
            job = self._jobs.get(transfer_id)
        if job is not None:
            job.progress.cancel()

    def _wake_all(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _done(self, job: _Send, result: TransferResult) -> None:
        with self._lock:
            self._jobs.pop(job.transfer_id, None)
        self._report(result)


class _SenderPair(_Pair):
    """Picks whichever queued transfer has its first layers computed, and sends it whole."""

    def __init__(self, owner: KVSender, pair_key: str, endpoint: Endpoint) -> None:
        super().__init__(owner, pair_key)
        self.endpoint = endpoint
        self.jobs: list[_Send] = []
        self.active: _Send | None = None

    def wake(self) -> None:
        with self.owner._lock:
            self.owner._lock.notify_all()

    def _run(self) -> None:
        owner = self.owner
        client = connect_store(self.endpoint, owner.timeout_s)
        control = dist.PrefixStore(f"duet/{self.pair_key}", client)
        while not owner.closed.is_set():
            job, give_up = self._next_job()
            if job is None:
                continue
            if job is _RETIRE:
                return
            if give_up is not None:
                aborted = job.progress.cancelled
                _announce(control, f"cancel {job.transfer_id} {'aborted' if aborted else 'timeout'}")
                owner._done(job, TransferResult(job.transfer_id, False, error=give_up, cancelled=aborted))
            else:
                self.active = job
                self._send(client, control, job)
                self.active = None

    def _next_job(self) -> tuple[_Send | None, str | None]:
        """The first transfer ready to go, or to give up; waits a little for one otherwise."""
        owner = self.owner
        with owner._lock:
            now = time.monotonic()
            for job in self.jobs:
                give_up = None
                if job.progress.cancelled:
                    give_up = "cancelled"
                elif job.deadline <= now and not job.progress.ready(1):
                    give_up = "its first layers were not computed in time"
                if give_up is not None or job.progress.ready(1):
                    self.jobs.remove(job)
                    self.idle_since = now
                    return job, give_up
            if not self.jobs and now - self.idle_since > PAIR_IDLE_S:
                del owner._pairs[self.pair_key]  # under the lock: no job can join it any more
                return _RETIRE, None
            next_deadline = min((job.deadline for job in self.jobs), default=now + 1.0)
            owner._lock.wait(timeout=max(0.001, min(next_deadline - now, 1.0)))
        return None, None

    def _send(self, client: dist.Store, control: dist.Store, job: _Send) -> None:
        owner = self.owner
        _announce(control, f"send {job.transfer_id} {job.num_blocks}")
        start = time.monotonic()
        if self.group is None:
            self.group = owner._group(client, self.pair_key, SENDER_RANK)
        runs = layer_runs(owner.kv_cache, job.num_blocks)
        valid, reason = True, None
        block_ids = job.progress.wait_for(runs[0][1], owner.timeout_s)
        num_bytes = 0
        in_flight = None  # (work, buffer): one run on the wire while the next is packed
        for index, (start_layer, end) in enumerate(runs):
            if valid:
                try:
                    block_ids = job.progress.wait_for(end, owner.timeout_s)
                except (TransferCancelled, TimeoutError) as error:
                    valid, reason = False, str(error)  # the rest goes out as filler, marked invalid
            packed = pack_layers(owner.kv_cache, start_layer, end, block_ids)
            work = self.group.send(packed, _FIRST_LAYER_TAG + index)
            if in_flight is not None:
                owner._wait(in_flight[0], f"layers before {start_layer} of transfer {job.transfer_id}")
            in_flight = (work, packed)
            num_bytes += packed.numel() * packed.element_size()
        owner._wait(in_flight[0], f"last layers of transfer {job.transfer_id}")
        owner._wait(self.group.send(torch.tensor([job.transfer_id, int(valid)]), _TRAILER_TAG), "trailer")
        ack = torch.zeros(2, dtype=torch.int64)
        owner._wait(self.group.recv(ack, _ACK_TAG), f"ack of transfer {job.transfer_id}")
        if int(ack[0]) != job.transfer_id:
            raise RuntimeError(f"transfer {job.transfer_id} acknowledged as {int(ack[0])}")
        if valid and bool(ack[1]):
            owner._done(job, TransferResult(job.transfer_id, True, num_bytes, time.monotonic() - start))
        elif valid:
            owner._done(job, TransferResult(job.transfer_id, False, error="the decode replica had cancelled it", cancelled=True))
        else:
            owner._done(job, TransferResult(job.transfer_id, False, error=reason, cancelled=job.progress.cancelled))

    def _break(self, error: str) -> None:
        owner = self.owner
        with owner._lock:
            jobs = ([self.active] if self.active is not None else []) + self.jobs
            self.jobs = []
            if owner._pairs.get(self.pair_key) is self:
                del owner._pairs[self.pair_key]
        for job in jobs:
            owner._done(job, TransferResult(job.transfer_id, False, error=f"pair {self.pair_key} broke: {error}"))


_RETIRE = _Send(-1, 0, LayerProgress(0), 0.0)  # what ``_next_job`` returns to end an idle pair's thread


def _announce(control: dist.Store, message: str) -> None:
    """Append a message to a pair's numbered announcements in the receiver's store."""
    index = control.add("next", 1)
    control.set(f"m/{index}", message)
