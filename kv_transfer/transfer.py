"""Sender and receiver threads that move requests' KV blocks over pairwise groups.

The decode side (receiver) decides a transfer: it allocates blocks, calls
``KVReceiver.expect`` and hands the prefill side the transfer id, its endpoint and the
pair key; the prefill side (sender) calls ``KVSender.send``. On each pair one thread per
side works through transfers in order, so the engines' step loops never wait on the
network. A transfer is a header ``[transfer_id, num_blocks]``, then each run of layers'
packed K/V (see ``wire.py``), then an acknowledgement back to the sender. Every wait has a timeout; a failure is
reported per transfer through ``poll()``, and the pair's group is dropped so the next
transfer rebuilds it under a new key.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from duet.kv_transfer.group import Endpoint, PairGroup, RECEIVER_RANK, SENDER_RANK, connect_store, host_store
from duet.kv_transfer.spec import KVSpec
from duet.kv_transfer.wire import layer_runs, pack_layers, packed_shape, unpack_layers

logger = logging.getLogger(__name__)

_HEADER_TAG = 0
_ACK_TAG = 1
_FIRST_LAYER_TAG = 2


@dataclass
class TransferResult:
    """One transfer's outcome. ``seconds`` runs from the header to the acknowledgement: the
    wire time of a pulled transfer; a streamed one also spans the prefill it overlapped."""

    transfer_id: int
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class TransferStats:
    """Counters for metrics: bytes moved, transfers done and failed, time spent."""

    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


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

    def wait_for(self, num_layers: int, timeout_s: float) -> list[int]:
        """Block ids, once the first ``num_layers`` layers are computed; TimeoutError otherwise."""
        with self._condition:
            ready = self._condition.wait_for(lambda: self._num_ready >= num_layers and self._block_ids is not None, timeout_s)
            if not ready:
                raise TimeoutError(f"layers 0-{num_layers - 1} not computed within {timeout_s}s")
            return self._block_ids


@dataclass
class _Job:
    transfer_id: int
    block_ids: list[int]  # the receiver's blocks (empty on the sender, which reads ``progress``)
    pair_key: str
    num_blocks: int
    endpoint: Endpoint | None = None
    progress: LayerProgress | None = None


class _PairWorker:
    """One thread per pair and direction, running jobs in order from a bounded queue."""

    def __init__(self, owner: _TransferEndpoint, pair_key: str, max_pending: int) -> None:
        self.owner = owner
        self.pair_key = pair_key
        self.jobs: queue.Queue[_Job] = queue.Queue(maxsize=max_pending)
        self.group: PairGroup | None = None
        self.broken = False
        self.thread = threading.Thread(target=self._run, name=f"kv-{pair_key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.owner.closed.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if self.broken:
                self.owner._report(TransferResult(job.transfer_id, False, error=f"pair {self.pair_key} is broken"))
                continue
            try:
                if self.group is None:
                    self.group = self.owner._make_group(self.pair_key, job)
                num_bytes, seconds = self.owner._transfer(self.group, job)
                self.owner._report(TransferResult(job.transfer_id, True, num_bytes, seconds))
            except Exception as error:  # a network failure must reach the request, not kill the thread
                self.broken = True
                logger.warning("KV transfer %d on pair %s failed: %s", job.transfer_id, self.pair_key, error)
                self.owner._report(TransferResult(job.transfer_id, False, error=str(error)))


class _TransferEndpoint:
    def __init__(self, kv_cache: torch.Tensor, spec: KVSpec, timeout_s: float = 30.0, max_pending: int = 64) -> None:
        self.kv_cache = kv_cache
        self.spec = spec
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.use_cuda = kv_cache.is_cuda
        self.closed = threading.Event()
        self.stats = TransferStats()
        self._workers: dict[str, _PairWorker] = {}
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._lock = threading.Lock()

    def _submit(self, job: _Job) -> None:
        with self._lock:
            worker = self._workers.get(job.pair_key)
            if worker is None or worker.broken:
                worker = self._workers[job.pair_key] = _PairWorker(self, job.pair_key, self.max_pending)
        worker.jobs.put(job, timeout=self.timeout_s)

    def _report(self, result: TransferResult) -> None:
        if result.ok:
            self.stats.bytes += result.num_bytes
            self.stats.transfers += 1
            self.stats.seconds += result.seconds
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

    def _wait(self, work, what: str) -> None:
        if not work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"{what} timed out after {self.timeout_s}s")

    def close(self) -> None:
        """Stop the pair threads (each notices within 0.1 s unless it is mid-transfer)."""
        self.closed.set()
        for worker in list(self._workers.values()):
            worker.thread.join(timeout=1.0)


class KVReceiver(_TransferEndpoint):
    """The decode side: hosts the store, receives KV straight into its own blocks."""

    def __init__(self, kv_cache, spec: KVSpec, host: str = "127.0.0.1", timeout_s: float = 30.0, max_pending: int = 64):
        super().__init__(kv_cache, spec, timeout_s, max_pending)
        self.store = host_store(host, 0, timeout_s)
        self.endpoint = Endpoint(host, self.store.port)

    def expect(self, transfer_id: int, block_ids: list[int], pair_key: str) -> None:
        """Receive transfer ``transfer_id`` into ``block_ids`` from the sender of ``pair_key``."""
        self._submit(_Job(transfer_id, list(block_ids), pair_key, len(block_ids)))

    def _make_group(self, pair_key: str, job: _Job) -> PairGroup:
        return PairGroup(self.store, pair_key, RECEIVER_RANK, self.spec, self.use_cuda, self.timeout_s)

    def _transfer(self, group: PairGroup, job: _Job) -> tuple[int, float]:
        header = torch.zeros(2, dtype=torch.int64)
        self._wait(group.recv(header, _HEADER_TAG), f"header of transfer {job.transfer_id}")
        start = time.monotonic()
        transfer_id, num_blocks = (int(v) for v in header)
        if transfer_id != job.transfer_id or num_blocks != len(job.block_ids):
            raise RuntimeError(
                f"expected transfer {job.transfer_id} of {len(job.block_ids)} blocks, got {transfer_id} of {num_blocks}"
            )
        runs = layer_runs(self.kv_cache, num_blocks)
        # Two buffers in turn: run i+1 is already on its way while run i is scattered. Runs
        # are equal but for a shorter last one, which uses a prefix of its buffer.
        shape = packed_shape(self.kv_cache, *runs[0], num_blocks)
        buffers = [torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device) for _ in range(2)]
        received = [buffers[index % 2][: end - start_layer] for index, (start_layer, end) in enumerate(runs)]
        work = group.recv(received[0], _FIRST_LAYER_TAG)
        for index, (start_layer, end) in enumerate(runs):
            self._wait(work, f"layers {start_layer}-{end - 1} of transfer {transfer_id}")
            if index + 1 < len(runs):
                work = group.recv(received[index + 1], _FIRST_LAYER_TAG + index + 1)
            unpack_layers(self.kv_cache, start_layer, end, job.block_ids, received[index])
        self._wait(group.send(header.clone(), _ACK_TAG), f"ack of transfer {transfer_id}")
        num_bytes = sum(buffer.numel() * buffer.element_size() for buffer in received)
        return num_bytes, time.monotonic() - start


class KVSender(_TransferEndpoint):
    """The prefill side: connects to receivers' stores and streams requests' blocks to them."""

    def send(
        self,
        transfer_id: int,
        block_ids: list[int] | None,
        endpoint: Endpoint,
        pair_key: str,
        progress: LayerProgress | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """Ship ``block_ids`` now, or, with ``progress``, ``num_blocks`` blocks layer run by
        layer run as the engine computes them."""
        if progress is None:
            progress = LayerProgress.complete(self.kv_cache.shape[0], block_ids)
            num_blocks = len(block_ids)
        self._submit(_Job(transfer_id, [], pair_key, num_blocks, endpoint, progress))

    def _make_group(self, pair_key: str, job: _Job) -> PairGroup:
        store = connect_store(job.endpoint, self.timeout_s)
        return PairGroup(store, pair_key, SENDER_RANK, self.spec, self.use_cuda, self.timeout_s)

    def _transfer(self, group: PairGroup, job: _Job) -> tuple[int, float]:
        runs = layer_runs(self.kv_cache, job.num_blocks)
        # The header goes once the first run is computed, so the clock starts with real data.
        job.progress.wait_for(runs[0][1], self.timeout_s)
        header = torch.tensor([job.transfer_id, job.num_blocks], dtype=torch.int64)
        self._wait(group.send(header, _HEADER_TAG), f"header of transfer {job.transfer_id}")
        start = time.monotonic()
        num_bytes = 0
        in_flight = None  # (work, buffer): one run on the wire while the next is packed
        for index, (start_layer, end) in enumerate(runs):
            block_ids = job.progress.wait_for(end, self.timeout_s)
            packed = pack_layers(self.kv_cache, start_layer, end, block_ids)
            work = group.send(packed, _FIRST_LAYER_TAG + index)
            if in_flight is not None:
                self._wait(in_flight[0], f"layers before {start_layer} of transfer {job.transfer_id}")
            in_flight = (work, packed)
            num_bytes += packed.numel() * packed.element_size()
        self._wait(in_flight[0], f"last layers of transfer {job.transfer_id}")
        ack = torch.zeros(2, dtype=torch.int64)
        self._wait(group.recv(ack, _ACK_TAG), f"ack of transfer {job.transfer_id}")
        if int(ack[0]) != job.transfer_id:
            raise RuntimeError(f"transfer {job.transfer_id} acknowledged as {int(ack[0])}")
        return num_bytes, time.monotonic() - start
