"""The receiving side (a decode worker): hosts a TCPStore whose channel takes announcements,
and receives each announced transfer straight into the blocks its engine reserved.

An expected transfer waits for its sender to queue it (``queued``: up to the expectation's
timeout, long, since a prompt may wait behind others on its prefill replica), then to announce it
(``send``: within ``QUEUED_START_TIMEOUTS`` of the pair's timeout from being queued, its sender
saying it is still queued there at least every ``SENDER_SILENT_S``: ``alive``); one not
announced in time, or whose sender fell silent, fails, and its router recomputes it.

One listener thread reads the channel in order and hands each transfer to its pair's thread
(one per sender and pair key, started on the pair's first announcement: no sender needs to be
known in advance). Transfers are matched to expectations by id, in whatever order they come;
an announcement may even come before its expectation (the engine tells its workers between
two steps), and waits for it, up to half the pair's timeout. One whose request went away
(cancelled, timed out), or whose expectation did not come, is drained into scratch buffers. A
transfer may come in parts, each a range of the model's KV heads and layers from another sender
(tensor-parallel ranks, pipeline stages on the prefill side): it ends once its parts cover the
heads and layers this cache holds, or one failed and none is still coming in.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import torch

from duet.distributed import host_store
from duet.kv_transfer.channel import Channel
from duet.kv_transfer.endpoint import (
    ACK_ACCEPTED,
    ACK_CORRUPTED,
    ACK_REFUSED,
    ACK_TAG,
    FIRST_LAYER_TAG,
    NO_TOKEN,
    QUEUED_START_TIMEOUTS,
    SENDER_SILENT_S,
    TRAILER_TAG,
    TransferEndpoint,
)
from duet.kv_transfer.faults import checksum
from duet.kv_transfer.group import RECEIVER_RANK, connect_store
from duet.kv_transfer.shm import FREE_TAG_BASE
from duet.kv_transfer.spec import KVSpec
from duet.kv_transfer.wire import packed_shape, unpack_summed
from duet.messages import KVEndpoint
from duet.outputs import KVTransferResult

logger = logging.getLogger(__name__)

# A cancellation is remembered this long, to drain a late announcement of the same transfer.
_CANCELLED_MEMORY_S = 3600.0
# Of the pair's timeout, how long an announced transfer waits for its expectation before it is
# drained: less than all of it, or the sender's send (with the same timeout) gives up first and
# the pair breaks where a drain would have kept it.
_CLAIM_WAIT_SHARE = 0.5


class _SettledPartError(Exception):
    """The pair broke after a part's verdict was recorded (its acknowledgement did not go out):
    the part has nothing left to settle."""


@dataclass
class _Expected:
    transfer_id: int
    block_ids: list[int]
    deadline: float  # for its (next) part to be announced
    heard: float | None = None  # when its sender last said it was queued there (None: not yet)
    cancelled: bool = False
    num_cells_in: int = 0  # (KV head, layer) pairs received so far
    parts_active: int = 0
    error: str | None = None
    first_token_id: int | None = None
    num_bytes: int = 0
    started: float = 0.0


class KVReceiver(TransferEndpoint):
    """``kv_heads``, ``layers``: the ranges of the model's KV heads and layers this cache holds
    (None: all of them)."""

    def __init__(
        self, kv_cache: torch.Tensor, spec: KVSpec, host: str = "127.0.0.1", timeout_s: float = 30.0,
        kv_heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None, shared_memory: bool = True,
    ) -> None:
        super().__init__(kv_cache, spec, host, timeout_s, kv_heads, layers, shared_memory)
        self.store = host_store(host, 0, timeout_s)
        self.endpoint = KVEndpoint(host, self.store.port, self.kv_heads, self.layers)
        self._expected: dict[int, _Expected] = {}  # not announced yet
        self._active: dict[int, _Expected] = {}  # being received
        self._cancelled: dict[int, float] = {}  # cancelled before any announcement: when
        self._queued: dict[int, tuple[float, float]] = {}  # queued by its sender, not expected here (yet): when, when last heard of
        self._pairs: dict[str, queue.SimpleQueue] = {}  # pair key -> its thread's inbox
        self.start_thread(self._listen, "kv-listener")

    def expect(self, transfer_id: int, block_ids: list[int], timeout_s: float | None = None) -> None:
        """Receive transfer ``transfer_id`` into ``block_ids`` if it is announced within
        ``timeout_s`` (default: the endpoint's). Its result comes through ``poll()``, and
        only then may the blocks be reused."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            queued_at, heard = self._queued.pop(transfer_id, (None, None))
            if queued_at is not None:
                deadline = min(deadline, queued_at + QUEUED_START_TIMEOUTS * self.timeout_s)
            if self._cancelled.pop(transfer_id, None) is None:
                self._expected[transfer_id] = _Expected(transfer_id, list(block_ids), deadline, heard)
                self._lock.notify_all()
                return
        self.report(KVTransferResult(transfer_id, False, error="cancelled", cancelled=True))

    def cancel(self, transfer_id: int) -> None:
        """The request went away: its transfer ends at once (mid-way: once its data is in),
        reported through ``poll()``. A transfer not expected yet is drained when it comes; one
        never expected here is reported cancelled at once (nothing writes its blocks), so that
        blocks its request's engine holds for it come free."""
        with self._lock:
            job = self._expected.pop(transfer_id, None) or self._active.get(transfer_id)
            if transfer_id not in self._active:
                self._cancelled[transfer_id] = time.monotonic()  # drain its announcement, if one comes
                self._lock.notify_all()
            if job is not None:
                job.cancelled = True
                if transfer_id in self._active and not self._finished(job):
                    return  # a part is coming in: it ends once its data is in
        self.report(KVTransferResult(transfer_id, False, error="cancelled", cancelled=True))

    def poll(self) -> list[KVTransferResult]:
        """Transfers finished (or failed) since the last call; announcements overdue fail here
        (a transfer's first part, or a next part of one partly in)."""
        now = time.monotonic()
        with self._lock:
            overdue, silent = [], []
            for job in self._expected.values():
                if job.heard is not None and now - job.heard > SENDER_SILENT_S:
                    silent.append(job)
                elif job.deadline <= now:
                    overdue.append(job)
            overdue += [job for job in self._active.values() if job.parts_active == 0 and job.deadline <= now]
            for job in overdue + silent:
                self._expected.pop(job.transfer_id, None)
                self._active.pop(job.transfer_id, None)
                self._cancelled[job.transfer_id] = now
            for transfer_id, when in list(self._cancelled.items()):
                if now - when > _CANCELLED_MEMORY_S:
                    del self._cancelled[transfer_id]
            for transfer_id, (when, _) in list(self._queued.items()):  # notices of transfers already in, mostly
                if now - when > QUEUED_START_TIMEOUTS * self.timeout_s:
                    del self._queued[transfer_id]
        for job in overdue:
            self.report(KVTransferResult(job.transfer_id, False, error="its KV was not announced in time"))
        for job in silent:
            self.report(KVTransferResult(job.transfer_id, False, error="its sender fell silent before announcing it"))
        return super().poll()

    def wake_threads(self) -> None:
        Channel(self.store).post("wake")

    def _listen(self) -> None:
        channel = Channel(connect_store(self.endpoint, self.timeout_s))
        index = 0
        while not self.closed.is_set():
            index += 1
            message = channel.read(index, self.closed.is_set)
            if message is None:
                return
            kind = message[0]
            if kind == "send":
                heads, layers = (int(message[4]), int(message[5])), (int(message[6]), int(message[7]))
                self._inbox(message[1]).put((int(message[2]), int(message[3]), heads, layers))
            elif kind == "queued":
                self._sender_queued(int(message[1]))
            elif kind == "alive":
                self._sender_alive([int(word) for word in message[1:]])
            elif kind == "cancel":
                self._sender_gave_up(int(message[1]), aborted=message[2] == "aborted")
            elif kind == "close":
                inbox = self._pairs.pop(message[1], None)
                if inbox is not None:
                    inbox.put(None)

    def _inbox(self, pair_key: str) -> queue.SimpleQueue:
        if pair_key not in self._pairs:
            inbox = self._pairs[pair_key] = queue.SimpleQueue()
            self.start_thread(lambda: self._run_pair(pair_key, inbox), f"kv-{pair_key}")
        return self._pairs[pair_key]

    def _sender_queued(self, transfer_id: int) -> None:
        """From now the transfer has ``QUEUED_START_TIMEOUTS`` timeouts to be announced (the
        notice may come after the announcement itself, or before the expectation)."""
        now = time.monotonic()
        with self._lock:
            job = self._expected.get(transfer_id)
            if job is not None:
                job.deadline = min(job.deadline, now + QUEUED_START_TIMEOUTS * self.timeout_s)
                job.heard = now
            elif transfer_id not in self._active and transfer_id not in self._cancelled:
                self._queued[transfer_id] = (now, now)

    def _sender_alive(self, transfer_ids: list[int]) -> None:
        """Their sender still has them queued: it is alive."""
        now = time.monotonic()
        with self._lock:
            for transfer_id in transfer_ids:
                job = self._expected.get(transfer_id)
                if job is not None:
                    job.heard = now
                elif transfer_id in self._queued:
                    self._queued[transfer_id] = (self._queued[transfer_id][0], now)

    def _sender_gave_up(self, transfer_id: int, aborted: bool) -> None:
        error = "the prefill replica aborted the request" if aborted else "the prefill replica gave the transfer up"
        with self._lock:
            job = self._expected.pop(transfer_id, None)
            if job is None:
                job = self._active.get(transfer_id)
                if job is None:
                    self._cancelled[transfer_id] = time.monotonic()
                    return
            job.cancelled = job.cancelled or aborted
            job.error = job.error or error
            self._active[transfer_id] = job
            finished = self._finished(job)
        if finished:
            self.report(self._result(job))

    def _run_pair(self, pair_key: str, inbox: queue.SimpleQueue) -> None:
        client = connect_store(self.endpoint, self.timeout_s)
        group = None
        while not self.closed.is_set():
            try:
                announced = inbox.get(timeout=1.0)
            except queue.Empty:
                continue
            if announced is None:
                return
            transfer_id, num_blocks, heads, layers = announced
            job = self._claim(transfer_id)
            try:
                if group is None:
                    group = self.group(client, pair_key, RECEIVER_RANK)
                self._receive(group, transfer_id, num_blocks, heads, layers, job)
            except Exception as error:  # the pair is broken: its transfers fail, the replica goes on
                if not self.closed.is_set():
                    logger.warning("KV transfer pair %s broke: %s", pair_key, error)
                self._pairs.pop(pair_key, None)
                if job is not None and not isinstance(error, _SettledPartError):
                    with self._lock:
                        job.parts_active -= 1
                        job.error = job.error or f"pair {pair_key} broke: {error}"
                        finished = self._finished(job)
                    if finished:
                        self.report(self._result(job))
                return

    def _claim(self, transfer_id: int) -> _Expected | None:
        """The expectation of an announced transfer (waiting for it a while: the engine tells its
        workers between steps), or of one whose other parts are coming in; None if its request
        went away, and it must be drained."""
        with self._lock:
            self._lock.wait_for(
                lambda: transfer_id in self._expected or transfer_id in self._active or transfer_id in self._cancelled
                or self.closed.is_set(),
                self.timeout_s * _CLAIM_WAIT_SHARE,
            )
            job = self._expected.pop(transfer_id, None)
            if job is not None:
                job.started = time.monotonic()
                self._active[transfer_id] = job
            job = self._active.get(transfer_id)
            if job is not None:
                job.parts_active += 1
            return job

    def _receive(
        self, group, transfer_id: int, num_blocks: int, heads: tuple[int, int], layers: tuple[int, int], job: _Expected | None
    ) -> None:
        spec = self.spec
        if (
            not 0 < num_blocks <= self.kv_cache.shape[3] or not 0 <= heads[0] < heads[1] <= spec.num_kv_heads
            or not 0 <= layers[0] < layers[1] <= spec.num_layers
        ):
            raise RuntimeError(f"transfer {transfer_id} announced with {num_blocks} blocks of KV heads {heads} of layers {layers}")
        mismatch = None
        if job is not None and len(job.block_ids) != num_blocks:
            mismatch = f"announced with {num_blocks} blocks, expected {len(job.block_ids)}"
        elif not self.held(heads, layers):
            mismatch = f"announced with KV heads {heads} of layers {layers}, this worker holds {self.kv_heads} of {self.layers}"
        runs, here = self.runs(num_blocks, heads, layers)
        checksums, num_bytes = [], 0
        for index, start, end, run in self._incoming(group, transfer_id, runs, num_blocks, heads, layers):
            num_bytes += run.numel() * run.element_size()
            if job is not None and mismatch is None:
                heads_here = self.local_heads(heads)
                checksums.append(unpack_summed(self.kv_cache, here + start, here + end, job.block_ids, run, heads_here, self.block_ops))
            else:
                checksums.append(checksum(run))
        trailer = torch.zeros(3 + len(runs), dtype=torch.int64, device=self.kv_cache.device)  # NCCL moves GPU tensors only
        self.wait(group.recv(trailer, TRAILER_TAG), f"trailer of transfer {transfer_id}")
        corruption = _corrupted(layers[0], runs, checksums, trailer[3:].tolist())
        mismatch = mismatch or corruption
        with self._lock:  # from here a cancel no longer reaches this part: it ends now
            accepted = job is not None and mismatch is None and not job.cancelled and job.error is None and bool(trailer[1])
            if job is not None:
                job.parts_active -= 1
                if accepted:
                    job.num_cells_in += (heads[1] - heads[0]) * (layers[1] - layers[0])
                    job.num_bytes += num_bytes
                    if int(trailer[2]) != NO_TOKEN:
                        job.first_token_id = int(trailer[2])
                elif not job.cancelled and job.error is None:
                    if mismatch is not None:
                        job.error = mismatch
                    else:
                        job.error, job.cancelled = "the prefill replica aborted the request mid-transfer", True
                finished = self._finished(job)
        answer = ACK_ACCEPTED if accepted else ACK_CORRUPTED if corruption else ACK_REFUSED
        ack = torch.tensor([transfer_id, answer], device=self.kv_cache.device)
        try:
            self.wait(group.send(ack, ACK_TAG), f"ack of transfer {transfer_id}")
        except Exception as error:
            raise _SettledPartError(str(error)) from error
        finally:
            if job is not None and finished:  # a drained one's request went away, and was told so then
                self.report(self._result(job))

    def _incoming(self, group, transfer_id: int, runs: list[tuple[int, int]], num_blocks: int, heads: tuple[int, int], layers):
        """Each run of a transfer as it comes in, ``(index, start, end, tensor)``: off the wire into
        two buffers in turn (the next run coming into one while the caller handles the other),
        or, where the pair shares memory, in the slot its signal names; that slot is given back
        once the caller is done with the run, if a later run is to fill it."""
        what = lambda start, end: f"layers {layers[0] + start}-{layers[0] + end - 1} of transfer {transfer_id}"  # noqa: E731
        shared = group.shared
        signal = torch.zeros(3, dtype=torch.int64)
        if shared is not None:
            self.wait(group.recv(signal, FIRST_LAYER_TAG), what(*runs[0]))
            if shared.on_the_wire(signal):  # the sender's /dev/shm had no room for its slots
                shared = None
        if shared is not None:
            shape = packed_shape(self.kv_cache, *runs[0], num_blocks, heads[1] - heads[0])
            incoming = shared.incoming(signal, shape, runs, self.kv_cache.dtype)
            for index, (start, end) in enumerate(runs):
                if index:
                    self.wait(group.recv(signal, FIRST_LAYER_TAG + index), what(start, end))
                yield index, start, end, incoming[index]
                if index + 2 < len(runs):
                    self.wait(group.send(torch.tensor([index]), FREE_TAG_BASE + index), f"slot of transfer {transfer_id}")
            return
        received = self.buffers(runs, num_blocks, heads[1] - heads[0])
        work = group.recv(received[0], FIRST_LAYER_TAG)
        for index, (start, end) in enumerate(runs):
            self.wait(work, what(start, end))
            if index + 1 < len(runs):
                work = group.recv(received[index + 1], FIRST_LAYER_TAG + index + 1)
            yield index, start, end, received[index]

    def _finished(self, job: _Expected) -> bool:
        """Under the lock: whether ``job`` has ended (every head of every layer in, or a part
        failed or the request went away, with no part still coming in); if so it leaves the
        active ones, and later parts of a failed one are drained. Otherwise its next part has a
        deadline."""
        complete = job.num_cells_in == (self.kv_heads[1] - self.kv_heads[0]) * (self.layers[1] - self.layers[0])
        if job.parts_active or not (complete or job.cancelled or job.error):
            job.deadline = time.monotonic() + self.timeout_s
            return False
        self._active.pop(job.transfer_id, None)
        if not complete:
            self._cancelled[job.transfer_id] = time.monotonic()
        return True

    def _result(self, job: _Expected) -> KVTransferResult:
        if job.error is None and not job.cancelled:
            seconds = time.monotonic() - job.started
            return KVTransferResult(job.transfer_id, True, job.first_token_id, num_bytes=job.num_bytes, seconds=seconds)
        return KVTransferResult(job.transfer_id, False, error=job.error or "cancelled", cancelled=job.cancelled)


def _corrupted(first_layer: int, runs: list[tuple[int, int]], received: list[int], sent: list[int]) -> str | None:
    """Why the KV cannot be used if a run's bytes differ from what the sender summed (the
    blocks it was written to are then freed unused: the request is recomputed or fails)."""
    for (start, end), got, expected in zip(runs, received, sent):
        if got != expected:
            return f"the KV of layers {first_layer + start}-{first_layer + end - 1} arrived corrupted (checksum {got}, sent {expected})"
    return None
