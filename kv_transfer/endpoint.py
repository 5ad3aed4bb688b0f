"""What a KV sender and receiver share: the KV cache they read or write, the results ``poll()``
returns, counters, the wire's waits and buffers, and their pairs' threads.

One transfer on a pair, after its announcement (``channel.py``): each run of layers' packed K/V
(``wire.py``; where the pair shares memory, a signal that the run is in its slot: ``shm.py``),
then a trailer ``[transfer id, valid, first token, checksum of each run]`` (a request aborted
mid-way still sends its remaining runs, from blocks its engine holds until the transfer ends,
marked invalid, so the pair stays in step; a run whose bytes do not sum to its checksum fails
the transfer: ``faults.py``), then an acknowledgement ``[transfer id, accepted | refused |
corrupted]``. Only data that does not come in time (the peer died or hung) breaks a pair: its
group is dropped and its thread ends; the sender opens a new pair, under a new key, for what it
still has to send.
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
from collections.abc import Callable

import torch

from duet.kv_transfer.group import PairGroup
from duet.kv_transfer.spec import KVSpec
from duet.kv_transfer.wire import TARGET_MESSAGE_BYTES, block_ops, layer_runs, packed_shape
from duet.outputs import KVTransferResult

logger = logging.getLogger(__name__)

TRAILER_TAG = 0
ACK_TAG = 1
# What an acknowledgement says of a transfer (or of a receiver's part of it).
ACK_ACCEPTED, ACK_REFUSED, ACK_CORRUPTED = 1, 0, -1
FIRST_LAYER_TAG = 2
NO_TOKEN = -1
# A pair with nothing to do for this long ends its threads; the next transfer opens a new one.
PAIR_IDLE_S = 600.0
# How long a receiver waits for a prompt's transfer to be queued on its sender: the prompt may
# wait behind others on the prefill replica first. A request aborted meanwhile cancels it at once.
STREAM_START_TIMEOUT_S = 600.0
# Once its sender has queued it, how many of the pair's timeouts a transfer has to be announced:
# its sender gives its first layers one; a transfer ahead of it that stalls holds the pair for
# the sender's own timeout, and a new pair is then set up. Past that its sender is taken for
# gone (it died, or its replica stopped). Two timeouts failed a transfer queued behind a stalled
# one, now and then, where a new pair was on its way (one full run in two on a 2-core Xeon).
QUEUED_START_TIMEOUTS = 4
# While it has transfers queued for a receiver, a sender says so this often; a receiver that
# has not heard from the sender of a queued transfer for SENDER_SILENT_S takes it for gone (its
# process died: a killed prefill replica's queued transfers fail in seconds, not in
# QUEUED_START_TIMEOUTS timeouts, and their requests are recomputed).
SENDER_ALIVE_S = 1.0
SENDER_SILENT_S = 10.0
# A pair's thread keeps its two run buffers from one transfer to the next up to this size each
# (a fresh one is written page by page: about 1 ms per 8 MiB of page faults on the wire's path);
# a longer run's (one layer of a very long prompt) are the transfer's own.
KEPT_BUFFER_BYTES = 4 * TARGET_MESSAGE_BYTES


class TransferEndpoint:
    def __init__(
        self, kv_cache: torch.Tensor, spec: KVSpec, host: str, timeout_s: float, kv_heads: tuple[int, int] | None,
        layers: tuple[int, int] | None = None, shared_memory: bool = True,
    ) -> None:
        self.kv_cache = kv_cache
        self.spec = spec
        # The model's KV heads and layers this cache holds (a tensor-parallel rank holds a range
        # of the heads, a pipeline stage a range of the layers).
        self.kv_heads = kv_heads or (0, kv_cache.shape[2])
        self.layers = layers or (0, kv_cache.shape[0])
        self.host = host
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory  # runs through shared memory where a pair's ends share a machine (shm.py)
        self.use_cuda = kv_cache.is_cuda
        self.block_ops = block_ops(kv_cache)  # blocks copied and summed in one pass (built now, not in a transfer)
        self.closed = threading.Event()
        self._results: queue.SimpleQueue[KVTransferResult] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()  # each pair thread's run buffers
        self.on_report: Callable[[], None] | None = None  # called (from the reporting thread) after each result

    def report(self, result: KVTransferResult) -> None:
        self._results.put(result)
        if self.on_report is not None:  # the engine waiting on it steps now, not at its next poll
            self.on_report()

    def poll(self) -> list[KVTransferResult]:
        """Transfers finished (or failed, or cancelled) since the last call."""
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def start_thread(self, target, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads = [running for running in self._threads if running.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    @property
    def num_threads(self) -> int:
        """Threads still running, those of pairs that broke or retired included."""
        with self._lock:
            return sum(thread.is_alive() for thread in self._threads)

    def group(self, store, pair_key: str, rank: int) -> PairGroup:
        return PairGroup(store, pair_key, rank, self.spec, self.use_cuda, self.timeout_s, self.host, self.shared_memory)

    def wait(self, work, what: str) -> None:
        if not work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"{what} timed out after {self.timeout_s}s")

    def local_heads(self, heads: tuple[int, int]) -> slice:
        """Where the model's KV ``heads`` lie in this cache."""
        return slice(heads[0] - self.kv_heads[0], heads[1] - self.kv_heads[0])

    def runs(self, num_blocks: int, heads: tuple[int, int], layers: tuple[int, int]) -> tuple[list[tuple[int, int]], int]:
        """The layer runs of a transfer of the model's ``layers`` (of its KV ``heads``), counted
        from its first layer, and where that layer lies in this cache."""
        return layer_runs(self.kv_cache, num_blocks, heads[1] - heads[0], layers[1] - layers[0]), layers[0] - self.layers[0]

    def held(self, heads: tuple[int, int], layers: tuple[int, int]) -> bool:
        """Whether this cache holds all of those heads of those layers."""
        return self.kv_heads[0] <= heads[0] < heads[1] <= self.kv_heads[1] and self.layers[0] <= layers[0] < layers[1] <= self.layers[1]

    def buffers(self, runs: list[tuple[int, int]], num_blocks: int, num_heads: int) -> list[torch.Tensor]:
        """For each of a transfer's layer ``runs`` (of ``num_heads`` KV heads), a view of one of
        two buffers in turn: run i+1 is on its way while run i is handled. Runs are equal but for
        a shorter last one. The buffers are the calling pair thread's, kept for its next
        transfer (up to ``KEPT_BUFFER_BYTES``): a pair moves one transfer at a time."""
        shape = packed_shape(self.kv_cache, *runs[0], num_blocks, num_heads)
        size = math.prod(shape)
        held = getattr(self._local, "buffers", None)
        if held is None or held[0].numel() < size:
            held = [torch.empty(size, dtype=self.kv_cache.dtype, device=self.kv_cache.device) for _ in range(2)]
            if size * self.kv_cache.element_size() <= KEPT_BUFFER_BYTES:
                self._local.buffers = held
        whole = [buffer[:size].view(shape) for buffer in held]
        return [whole[index % 2][: end - start] for index, (start, end) in enumerate(runs)]

    def close(self) -> None:
        """Stop the threads (each notices at once unless it is mid-transfer)."""
        self.closed.set()
        with self._lock:
            self._lock.notify_all()
            threads = list(self._threads)
        self.wake_threads()
        for thread in threads:
            thread.join(timeout=1.0)

    def wake_threads(self) -> None:
        pass
