"""The sending side (a prefill worker): ships requests' KV to the receivers that expect it.

A transfer is made known to its receiver the moment it is queued (``queued <id>`` on the
receiver's channel, posted by that receiver's notice thread), and while any is queued for it the
thread says so again every ``SENDER_ALIVE_S`` (``alive <id> ...``): the receiver gives a queued
transfer a bounded time to start, and fails it sooner once its sender falls silent, so a sender
that dies with transfers still queued leaves no receiver waiting long. One pair per receiver
endpoint, with a thread that picks whichever of its transfers has its first run of layers
computed (a long prompt queued first does not hold up a short one), then announces it on the
receiver's channel, with the ranges of the model's KV heads and layers it carries, and sends it
whole. A transfer may go in parts, a range of heads and layers to each of several receivers
(tensor-parallel ranks, pipeline stages): each part is reported on its own. A pair that broke
fails the transfer under way; the others move, once, to a new pair (a new key, a new group).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import torch

from duet.kv_transfer.channel import Channel
from duet.kv_transfer.endpoint import (
    ACK_ACCEPTED,
    ACK_CORRUPTED,
    ACK_TAG,
    FIRST_LAYER_TAG,
    NO_TOKEN,
    PAIR_IDLE_S,
    SENDER_ALIVE_S,
    TRAILER_TAG,
    TransferEndpoint,
)
from duet.kv_transfer.faults import TransferFaults, checksum
from duet.kv_transfer.group import SENDER_RANK, connect_store
from duet.kv_transfer.progress import LayerProgress, TransferCancelled
from duet.kv_transfer.shm import FREE_TAG_BASE, WIRE_SIGNAL
from duet.kv_transfer.spec import KVSpec
from duet.kv_transfer.wire import pack_summed, packed_shape
from duet.messages import KVEndpoint
from duet.outputs import KVTransferResult

logger = logging.getLogger(__name__)


@dataclass
class _Send:
    transfer_id: int
    num_blocks: int
    progress: LayerProgress
    deadline: float  # to have the first run of layers computed
    heads: tuple[int, int]  # the model's KV heads it carries
    layers: tuple[int, int]  # and the model's layers
    ready_at: int = 1  # how many of this cache's layers must be computed before it can start
    endpoint: KVEndpoint | None = None
    moved: bool = False  # already moved off a pair that broke


class KVSender(TransferEndpoint):
    """``kv_heads``, ``layers``: the ranges of the model's KV heads and layers this cache holds
    (None: all of them)."""

    def __init__(
        self, kv_cache: torch.Tensor, spec: KVSpec, host: str = "127.0.0.1", timeout_s: float = 30.0, name: str = "prefill",
        kv_heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None, shared_memory: bool = True,
    ):
        super().__init__(kv_cache, spec, host, timeout_s, kv_heads, layers, shared_memory)
        self.name = name
        self._pairs: dict[KVEndpoint, _SenderPair] = {}
        self._generation: dict[KVEndpoint, int] = {}
        self._jobs: dict[tuple[int, KVEndpoint], _Send] = {}
        self._notifiers: dict[KVEndpoint, _Notifier] = {}
        self.faults = TransferFaults.from_env()

    def send(
        self, transfer_id: int, endpoint: KVEndpoint, progress: LayerProgress, num_blocks: int, timeout_s: float | None = None,
        heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None,
    ) -> None:
        """Ship ``num_blocks`` blocks of a request (of the model's KV ``heads`` and ``layers``,
        default all this cache holds), each run of layers once ``progress`` (which counts this
        cache's layers) has it computed, and its first token after them. Gives up (and tells
        the receiver) if the first run is not computed within ``timeout_s`` (default: the
        endpoint's)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        progress.on_change = self._wake_pairs
        layers = layers or self.layers
        job = _Send(transfer_id, num_blocks, progress, deadline, heads or self.kv_heads, layers, layers[0] - self.layers[0] + 1)
        self._notify_queued(endpoint, transfer_id)
        self._queue(job, endpoint)

    def _notify_queued(self, endpoint: KVEndpoint, transfer_id: int) -> None:
        """Tell the receiver at once that the transfer is queued here, off this thread (the
        caller is a step of the engine; the pair's thread may be busy with another transfer)."""
        with self._lock:
            notifier = self._notifiers.get(endpoint)
            if notifier is None:
                notifier = self._notifiers[endpoint] = _Notifier(self, endpoint)
                self.start_thread(notifier.run, f"kv-notices-{endpoint.host}:{endpoint.port}")
            notifier.notices.put(transfer_id)

    def _queue(self, job: _Send, endpoint: KVEndpoint) -> None:
        job.endpoint = endpoint
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is None:
                generation = self._generation.get(endpoint, 0)
                self._generation[endpoint] = generation + 1
                pair = self._pairs[endpoint] = _SenderPair(self, endpoint, f"{self.name}->{endpoint.host}:{endpoint.port}/{generation}")
                self.start_thread(pair.run, f"kv-{pair.pair_key}")
            pair.jobs.append(job)
            self._jobs[(job.transfer_id, endpoint)] = job
            self._lock.notify_all()

    def cancel(self, transfer_id: int) -> None:
        """The request was aborted: its transfer is given up, or sent on as invalid if under way."""
        with self._lock:
            jobs = [job for (job_id, _), job in self._jobs.items() if job_id == transfer_id]
        for job in jobs:
            job.progress.cancel()

    def done(self, job: _Send, result: KVTransferResult) -> None:
        with self._lock:
            self._jobs.pop((job.transfer_id, job.endpoint), None)
        self.report(result)

    def _wake_pairs(self) -> None:
        with self._lock:
            self._lock.notify_all()


class _Notifier:
    """One receiver's notices from this sender, in a thread of their own (a receiver that went
    away holds up only its own): each transfer as it is queued for it, and every
    ``SENDER_ALIVE_S`` the ids of all those still here; retired once idle for ``PAIR_IDLE_S``."""

    def __init__(self, owner: KVSender, endpoint: KVEndpoint) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.notices: queue.SimpleQueue[int] = queue.SimpleQueue()

    def run(self) -> None:
        owner = self.owner
        channel = None
        last_alive = idle_since = time.monotonic()
        while not owner.closed.is_set():
            try:
                messages = [("queued", self.notices.get(timeout=SENDER_ALIVE_S))]
            except queue.Empty:
                messages = []
            now = time.monotonic()
            with owner._lock:
                here = [transfer_id for transfer_id, endpoint in owner._jobs if endpoint == self.endpoint]
                if here or messages:
                    idle_since = now
                elif now - idle_since > PAIR_IDLE_S and self.notices.empty():
                    del owner._notifiers[self.endpoint]  # under the lock: no notice can reach it any more
                    return
            if here and now - last_alive >= SENDER_ALIVE_S:
                messages.append(("alive", *here))
                last_alive = now
            for words in messages:
                try:
                    if channel is None:
                        channel = Channel(connect_store(self.endpoint, owner.timeout_s))
                    channel.post(*words)
                except Exception as error:  # the receiver is gone: its transfers fail on their pair
                    channel = None
                    host, port = self.endpoint.host, self.endpoint.port
                    logger.warning("could not tell %s:%d of %d transfers %s: %s", host, port, len(words) - 1, words[0], error)


class _SenderPair:
    def __init__(self, owner: KVSender, endpoint: KVEndpoint, pair_key: str) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.pair_key = pair_key
        self.jobs: list[_Send] = []
        self.active: _Send | None = None
        self.idle_since = time.monotonic()

    def run(self) -> None:
        owner = self.owner
        group = None
        try:
            client = connect_store(self.endpoint, owner.timeout_s)
            channel = Channel(client)
            while not owner.closed.is_set():
                job, give_up = self._next_job()
                if job is _RETIRE:
                    channel.post("close", self.pair_key)
                    return
                if job is None:
                    continue
                if give_up is not None:  # reported first: a post that fails (the receiver went away) must not lose it
                    aborted = job.progress.cancelled
                    owner.done(job, KVTransferResult(job.transfer_id, False, error=give_up, cancelled=aborted))
                    channel.post("cancel", job.transfer_id, "aborted" if aborted else "timeout")
                    continue
                self.active = job
                channel.post("send", self.pair_key, job.transfer_id, job.num_blocks, *job.heads, *job.layers)
                if group is None:
                    group = owner.group(client, self.pair_key, SENDER_RANK)
                self._send(group, job)
                self.active = None
        except Exception as error:  # a network failure must reach the requests, not kill the replica
            if not owner.closed.is_set():
                logger.warning("KV transfer pair %s broke: %s", self.pair_key, error)
            self._break(str(error))
        finally:
            if group is not None and group.shared is not None:
                group.shared.close()

    def _next_job(self) -> tuple[_Send | None, str | None]:
        """The first transfer ready to go, or to give up; waits a little for one otherwise."""
        owner = self.owner
        with owner._lock:
            now = time.monotonic()
            for job in self.jobs:
                give_up = None
                if job.progress.cancelled:
                    give_up = "cancelled"
                elif job.deadline <= now and not job.progress.ready(job.ready_at):
                    give_up = "its first layers were not computed in time"
                if give_up is not None or job.progress.ready(job.ready_at):
                    self.jobs.remove(job)
                    self.idle_since = now
                    return job, give_up
            if not self.jobs and now - self.idle_since > PAIR_IDLE_S:
                del owner._pairs[self.endpoint]  # under the lock: no job can join it any more
                return _RETIRE, None
            next_deadline = min((job.deadline for job in self.jobs), default=now + 1.0)
            owner._lock.wait(timeout=max(0.001, min(next_deadline - now, 1.0)))
        return None, None

    def _send(self, group, job: _Send) -> None:
        owner = self.owner
        began = time.monotonic()
        computing = 0.0  # of the time since, waits for the forward to compute what goes
        heads = owner.local_heads(job.heads)
        runs, here = owner.runs(job.num_blocks, job.heads, job.layers)
        valid, reason = True, None
        # Set: the job was picked with its first layer ready. A request aborted since still sends
        # every run, from these blocks, as filler.
        block_ids = job.progress.block_ids
        num_bytes = 0
        checksums = []
        faults = owner.faults
        shared, num_heads, staged = group.shared, job.heads[1] - job.heads[0], None
        if shared is not None:  # packed straight into the slots the receiver maps, where they have room
            staged = shared.outgoing(packed_shape(owner.kv_cache, *runs[0], job.num_blocks, num_heads), runs, owner.kv_cache.dtype)
            if staged is None:
                shared = None
                owner.wait(group.send(torch.tensor(WIRE_SIGNAL), FIRST_LAYER_TAG), f"signal of transfer {job.transfer_id}")
        if staged is None:
            staged = owner.buffers(runs, job.num_blocks, num_heads)
        in_flight = None  # (work, buffer): one run on the wire while the next is packed
        for index, (start, end) in enumerate(runs):
            if valid:
                waited = time.monotonic()
                try:
                    block_ids = job.progress.wait_for(here + end, owner.timeout_s)
                except (TransferCancelled, TimeoutError) as error:
                    valid, reason = False, str(error)  # the rest goes out as filler, marked invalid
                computing += time.monotonic() - waited
            if shared is not None and index >= 2:  # its slot held run index - 2: the receiver must be done with it
                owner.wait(group.recv(torch.zeros(1, dtype=torch.int64), FREE_TAG_BASE + index - 2), f"slot of transfer {job.transfer_id}")
            packed = staged[index]
            total = pack_summed(owner.kv_cache, here + start, here + end, block_ids, heads, packed, owner.block_ops)
            corrupting = faults is not None and index == 0
            if corrupting:  # the run's checksum is taken before the fault flips a bit
                checksums.append(checksum(packed) if total is None else total)
                faults.corrupt(packed)
            message = packed if shared is None else shared.signal(index)
            work = group.send(message, FIRST_LAYER_TAG + index)
            if not corrupting:  # taken in the pack, or read while the wire (or the receiver) reads it too
                checksums.append(checksum(packed) if total is None else total)
            if in_flight is not None:
                owner.wait(in_flight[0], f"layers before {job.layers[0] + start} of transfer {job.transfer_id}")
            in_flight = (work, message)
            num_bytes += packed.numel() * packed.element_size()
            if faults is not None and index == 0:
                faults.drop(job.transfer_id)
        owner.wait(in_flight[0], f"last layers of transfer {job.transfer_id}")
        first_token_id = NO_TOKEN
        if valid:
            waited = time.monotonic()
            try:
                first_token_id = job.progress.wait_first_token(owner.timeout_s)
            except (TransferCancelled, TimeoutError) as error:
                valid, reason = False, str(error)
            computing += time.monotonic() - waited
        if faults is not None:
            faults.stall()
        # Control tensors live where the KV does: an NCCL pair moves only GPU tensors.
        device = owner.kv_cache.device
        trailer = torch.tensor([job.transfer_id, int(valid), first_token_id, *checksums], device=device)
        owner.wait(group.send(trailer, TRAILER_TAG), "trailer")
        ack = torch.zeros(2, dtype=torch.int64, device=device)
        owner.wait(group.recv(ack, ACK_TAG), f"ack of transfer {job.transfer_id}")
        if int(ack[0]) != job.transfer_id:
            raise RuntimeError(f"transfer {job.transfer_id} acknowledged as {int(ack[0])}")
        if valid and int(ack[1]) == ACK_ACCEPTED:
            seconds = time.monotonic() - began
            owner.done(job, KVTransferResult(job.transfer_id, True, num_bytes=num_bytes, seconds=seconds, wire_seconds=seconds - computing))
        elif int(ack[1]) == ACK_CORRUPTED:
            owner.done(job, KVTransferResult(job.transfer_id, False, error="the decode replica received it corrupted"))
        elif valid:
            owner.done(job, KVTransferResult(job.transfer_id, False, error="the decode replica had cancelled it", cancelled=True))
        else:
            owner.done(job, KVTransferResult(job.transfer_id, False, error=reason, cancelled=job.progress.cancelled))

    def _break(self, error: str) -> None:
        """Fail the transfer under way; move the others (once each) to a new pair."""
        owner = self.owner
        with owner._lock:
            if owner._pairs.get(self.endpoint) is self:
                del owner._pairs[self.endpoint]
            waiting, self.jobs = self.jobs, []
        if self.active is not None:
            owner.done(self.active, KVTransferResult(self.active.transfer_id, False, error=f"pair {self.pair_key} broke: {error}"))
        for job in waiting:
            if job.moved:
                owner.done(job, KVTransferResult(job.transfer_id, False, error=f"pair {self.pair_key} broke: {error}"))
            else:
                job.moved = True
                owner._queue(job, self.endpoint)


_RETIRE = _Send(-1, 0, LayerProgress(0), 0.0, (0, 0), (0, 0))  # what ``_next_job`` returns to end an idle pair's thread
