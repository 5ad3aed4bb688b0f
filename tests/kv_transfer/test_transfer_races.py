"""Races at a pair's edges, with the sender and the receiver in one process: a failure that
comes after a transfer's verdict, or while a sender gives one up, is still reported once, a
transfer nobody expects is drained before its sender's wait runs out, and transfers for a receiver
that is gone fail at once."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import torch

from duet.kv_transfer import channel
from duet.kv_transfer.progress import LayerProgress
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.sender import KVSender
from duet.kv_transfer.spec import KVSpec
from duet.messages import KVEndpoint

SHAPE = (3, 2, 2, 12, 4, 8)  # layers, K/V, kv heads, blocks, block size, head dim
SPEC = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="float32")
TIMEOUT_S = 2.0


@pytest.fixture
def pair():
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=TIMEOUT_S)
    sender = KVSender(torch.arange(torch.Size(SHAPE).numel()).view(SHAPE).float(), SPEC, timeout_s=TIMEOUT_S)
    yield sender, receiver
    sender.close()
    receiver.close()


def _results(endpoint, count: int, within_s: float = 15.0) -> list[tuple[int, bool, str | None]]:
    """What ``endpoint`` reports within ``within_s`` (waiting on a little past ``count``
    results, so that a second report of one transfer shows)."""
    results, deadline = [], time.monotonic() + within_s
    while time.monotonic() < deadline and len(results) < count:
        results += endpoint.poll()
        time.sleep(0.01)
    time.sleep(0.2)
    results += endpoint.poll()
    return [(result.transfer_id, result.ok, result.error) for result in results]


def test_an_acknowledgement_that_cannot_go_out_still_reports_the_transfer_once(pair):
    """Guards against the pair's failure handler settling a part a second time: its count of
    parts coming in went to -1, the transfer was never reported, and the decode request waited
    for its KV, holding its blocks, for good."""
    sender, receiver = pair
    wait = receiver.wait

    def ack_lost(work, what: str) -> None:
        if what.startswith("ack"):
            raise TimeoutError(f"{what} timed out (the sender died after its trailer)")
        wait(work, what)

    receiver.wait = ack_lost
    receiver.expect(1, [0])
    sender.send(1, receiver.endpoint, LayerProgress.complete(3, [5], 7), 1)
    assert _results(receiver, 1) == [(1, True, None)]  # every byte arrived and summed right
    assert receiver._active == {} and receiver._expected == {}
    assert torch.equal(receiver.kv_cache[:, :, :, 0], sender.kv_cache[:, :, :, 5])


def test_a_give_up_whose_announcement_fails_is_still_reported(pair, monkeypatch):
    """Guards against a sender losing a transfer it gave up on when the receiver's store went
    away as it said so: the prefill replica held its blocks for good."""
    sender, receiver = pair
    post = channel.Channel.post

    def store_gone(self, *words) -> None:
        if words[0] == "cancel":
            raise ConnectionError("the decode replica's store went away")
        post(self, *words)

    monkeypatch.setattr(channel.Channel, "post", store_gone)
    progress = LayerProgress(3)
    sender.send(1, receiver.endpoint, progress, 1)
    progress.cancel()
    assert _results(sender, 1) == [(1, False, "cancelled")]
    assert sender._jobs == {}


@pytest.mark.slow
def test_a_transfer_nobody_expects_is_drained_and_the_pair_goes_on(pair):
    """Guards against the receiver waiting as long for an expectation as the sender waits for
    its data to be taken: the sender gave up first and the pair broke where a drain keeps it."""
    sender, receiver = pair
    receiver.expect(1, [1])
    sender.send(1, receiver.endpoint, LayerProgress.complete(3, [5], 7), 1)
    assert _results(receiver, 1) == [(1, True, None)] and _results(sender, 1) == [(1, True, None)]
    sender.send(2, receiver.endpoint, LayerProgress.complete(3, [6], 8), 1)  # never expected
    assert _results(sender, 1) == [(2, False, "the decode replica had cancelled it")]
    receiver.expect(3, [2])
    sender.send(3, receiver.endpoint, LayerProgress.complete(3, [7], 9), 1)
    assert _results(receiver, 1) == [(3, True, None)] and _results(sender, 1) == [(3, True, None)]
    assert receiver.num_threads == 2  # the listener and the one pair's thread: it never broke


def test_transfers_for_a_receiver_that_is_gone_fail_at_once():
    """Guards the soak's slow release after a decode replica died: each transfer queued for it
    held its prompt's blocks on the prefill replica while the store's client retried a refused
    connection (for twice the pair's timeout), once for the broken pair and once more for the new
    pair the transfers moved to."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there: a receiver whose process has ended
    sender = KVSender(torch.zeros(SHAPE), SPEC, timeout_s=60)
    try:
        for transfer_id in (1, 2, 3):
            sender.send(transfer_id, KVEndpoint("127.0.0.1", port), LayerProgress.complete(3, [transfer_id], 7), 1)
        results = _results(sender, 3, within_s=30)
    finally:
        sender.close()
    assert sorted(transfer_id for transfer_id, _, _ in results) == [1, 2, 3]
    assert all(not ok and f"no KV receiver at 127.0.0.1:{port}" in error for _, ok, error in results), results


def test_a_sends_wire_time_leaves_out_its_waits_for_the_forward(pair, monkeypatch):
    """#40's cost of a pull: a send reports the seconds it took less those it spent waiting for
    the forward to compute its layers and first token (``wire_seconds``), and the connector's
    counters total them with the bytes of those sends alone (a receive cannot tell its wire
    from its sender's forward). The sender's clock is moved on by each wait here: 5 s for the
    layers, 1 s for the first token."""
    from types import SimpleNamespace

    from duet.kv_connector import TransferCounters
    from duet.kv_transfer import sender as sender_module

    moved = [0.0]
    clock = SimpleNamespace(monotonic=lambda: time.monotonic() + moved[0])
    monkeypatch.setattr(sender_module, "time", clock)

    class Forward(LayerProgress):
        def wait_for(self, num_layers, timeout_s):
            moved[0] += 5.0
            return super().wait_for(num_layers, timeout_s)

        def wait_first_token(self, timeout_s):
            moved[0] += 1.0
            return super().wait_first_token(timeout_s)

    sender, receiver = pair
    progress = Forward(3)
    progress.mark_ready(3, [5])
    progress.set_first_token(7)
    receiver.expect(1, [0])
    sender.send(1, receiver.endpoint, progress, 1)
    received = _results(receiver, 1)
    deadline, sent = time.monotonic() + 15.0, []
    while not sent and time.monotonic() < deadline:
        sent = sender.poll()
        time.sleep(0.01)
    assert received == [(1, True, None)] and [(result.transfer_id, result.ok) for result in sent] == [(1, True)]
    result = sent[0]
    assert result.seconds - result.wire_seconds == pytest.approx(6.0, abs=0.5) and 0 <= result.wire_seconds < result.seconds
    counters = TransferCounters()
    counters.count(result)
    counters.count(dataclasses.replace(result, wire_seconds=None))  # a receive of the same bytes
    assert (counters.bytes, counters.wire_bytes, counters.wire_seconds) == (2 * result.num_bytes, result.num_bytes, result.wire_seconds)
