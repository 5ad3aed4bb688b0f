"""The scheduler side of the KV connector: prompt KV that arrives from, or leaves for, another
replica.

Decode side: ``reserve`` takes blocks for a request's prompt at once, so the destination the
router hands the prefill replica is ready before the prefill starts; the request waits
(``WAITING_FOR_REMOTE_KV``) until the workers report its transfer, then joins the batch with
the first token the prefill replica sampled. Prefill side: a request's transfer starts in the
step that computes its prompt's last chunk (layers travel as that forward writes them); when the
request ends after its first token, its blocks are held until the workers report the send done.

What to start or cancel reaches the workers in ``SchedulerOutput.kv_connector``; how transfers
ended comes back in ``RunnerOutput.kv_results``. Blocks are freed, held and released only
through the KV cache manager; a transfer's held blocks are keyed by its transfer id.
"""

from __future__ import annotations

from dataclasses import dataclass

from duet.kv_cache_manager import KVCacheManager
from duet.messages import TransferStats
from duet.outputs import KVConnectorMetadata, KVReceiveSpec, KVSendSpec, KVTransferResult
from duet.request import Request, RequestStatus


@dataclass
class TransferCounters:
    """For metrics: bytes moved, transfers done, failed and cancelled (their request was
    aborted: not a failure), seconds from announcement to acknowledgement; and of the sends, the
    bytes and the seconds they took less their waits for the forward (what the wire costs)."""

    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    cancelled: int = 0
    seconds: float = 0.0
    wire_bytes: int = 0
    wire_seconds: float = 0.0

    def count(self, result: KVTransferResult) -> None:
        if result.ok:
            self.bytes += result.num_bytes
            self.transfers += 1
            self.seconds += result.seconds
            if result.wire_seconds is not None:
                self.wire_bytes += result.num_bytes
                self.wire_seconds += result.wire_seconds
        elif result.cancelled:
            self.cancelled += 1
        else:
            self.failures += 1


# A request that ends with its first token out keeps sending its KV: the decode side goes on.
_SENT_ON = (
    RequestStatus.FINISHED_REMOTE, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_MIGRATED,
)


class KVConnectorScheduler:
    """Every receive ends in a report from the workers: each of their waits is bounded, from the
    moment the sender queues the transfer (see ``duet.kv_transfer.receiver``), so a receive
    needs no deadline here."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._receiving: dict[int, Request] = {}  # transfer id -> request waiting for its prompt's KV
        self._sending: dict[int, Request] = {}  # transfer id -> request whose KV is on its way out
        self.held: set[int] = set()  # transfers still holding the blocks of a request that ended
        self._metadata = KVConnectorMetadata()
        self.counters = TransferCounters()

    @property
    def num_in_flight(self) -> int:
        return len(self._receiving) + len(self._sending) + len(self.held)

    def stats(self) -> TransferStats:
        counters = self.counters
        return TransferStats(
            bytes=counters.bytes, transfers=counters.transfers, failures=counters.failures, cancelled=counters.cancelled,
            seconds=counters.seconds, pending=self.num_in_flight, wire_bytes=counters.wire_bytes, wire_seconds=counters.wire_seconds,
        )

    def reserve(self, request: Request, transfer_id: int, num_next_slots: int = 0) -> bool:
        """Take blocks for the KV a transfer brings (a prompt's, or a migrating sequence's), and for
        ``num_next_slots`` more: the slots of its first step here; False if there is no room.

        Those slots are taken now because a request waiting for its KV, or with its KV in and
        not running yet, cannot be preempted: with reservations holding every block and nothing
        running, the first step's slots never came free, and the replica stopped for good."""
        num_tokens = request.num_transfer_tokens
        skipped = self.kv_cache_manager.blocks_before_window(num_tokens)  # no step here reads them: they do not travel
        if self.kv_cache_manager.allocate_for_transfer(request, num_tokens + num_next_slots, skipped) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.kv_receive_id = transfer_id
        self._receiving[transfer_id] = request
        num_blocks = -(-num_tokens // self.kv_cache_manager.block_size)  # what the transfer fills
        block_ids = self.kv_cache_manager.block_ids(request.request_id)[skipped:num_blocks]
        self._metadata.receives.append(KVReceiveSpec(request.request_id, transfer_id, block_ids))
        return True

    def start_send(self, request: Request, computed: bool = False) -> None:
        """Ship the request's KV to ``request.kv_send``: as the step about to run computes its
        last prompt chunk, or (``computed``) from its blocks as they are (a migration)."""
        destination = request.kv_send
        num_tokens = request.num_transfer_tokens
        # Those before the window the receiver's next step sees stay (see ``reserve``).
        skipped = self.kv_cache_manager.blocks_before_window(num_tokens)
        num_blocks = -(-num_tokens // self.kv_cache_manager.block_size)
        block_ids = self.kv_cache_manager.block_ids(request.request_id)[skipped:num_blocks] if computed else None
        self._metadata.sends.append(
            KVSendSpec(
                request.request_id, destination.transfer_id, destination.endpoints, num_blocks - skipped, block_ids, skipped
            )
        )
        self._sending[destination.transfer_id] = request

    def sending(self, request: Request) -> bool:
        return request.kv_send is not None and request.kv_send.transfer_id in self._sending

    def release_or_hold(self, request: Request) -> None:
        """The request ends, or restarts: its blocks go back, unless a transfer may still read or
        write them; those are held until it ends. A transfer no longer wanted is cancelled."""
        if request.kv_receive_id in self._receiving:
            transfer_id = request.kv_receive_id
        elif self.sending(request):
            transfer_id = request.kv_send.transfer_id
        else:
            self.kv_cache_manager.free(request)
            return
        if not (transfer_id in self._sending and request.status in _SENT_ON):
            self._metadata.cancels.append(transfer_id)  # the peer stops, or drains what it sends
            request.kv_send = None
        self._receiving.pop(transfer_id, None)
        self._sending.pop(transfer_id, None)
        unannounced = [spec for spec in self._metadata.receives if spec.transfer_id == transfer_id]
        if unannounced:  # the workers never heard of it: nothing writes these blocks
            self._metadata.receives.remove(unannounced[0])
            self.kv_cache_manager.free(request)
            return
        self.kv_cache_manager.hold(request, transfer_id)
        self.held.add(transfer_id)

    def take_metadata(self) -> KVConnectorMetadata:
        """What the next step's workers must start and cancel (each named once)."""
        metadata, self._metadata = self._metadata, KVConnectorMetadata()
        return metadata

    def finished_transfers(self, results: list[KVTransferResult]) -> tuple[list[tuple[Request, int]], list[tuple[Request, str]]]:
        """Apply the workers' reports. Returns the requests whose prompt KV arrived (with their
        first token) and those whose KV was lost (with why); releases what ended transfers held."""
        arrived, lost = [], []
        for result in results:
            self.counters.count(result)
            if result.transfer_id in self.held:
                self.held.discard(result.transfer_id)
                self.kv_cache_manager.release(result.transfer_id)
            elif (request := self._receiving.pop(result.transfer_id, None)) is not None:
                if result.ok:
                    arrived.append((request, result.first_token_id))
                else:
                    lost.append((request, result.error or "the transfer failed"))
            elif (request := self._sending.pop(result.transfer_id, None)) is not None:
                request.kv_send = None  # it ended before the request did: the blocks are the request's
        return arrived, lost
