"""KV blocks cross process boundaries intact over a pairwise gloo group built at run time, in
whatever order transfers are announced, with cancellations and timeouts that never break a pair.
Two processes of one machine move the runs through shared memory by default (``kv_transfer/shm.py``);
the tests marked ``wire`` move them over the socket, as between machines. The sender runs in a
process of its own (``sender_process``)."""

from __future__ import annotations

import time

import pytest
import torch

from duet.kv_connector import TransferCounters
from duet.kv_transfer import receiver as receiver_module
from duet.kv_transfer.endpoint import QUEUED_START_TIMEOUTS, SENDER_ALIVE_S, STREAM_START_TIMEOUT_S
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.wire import layer_runs, pack_layers, unpack_layers
from tests.kv_transfer.sender_process import BLOCK_BYTES, SHAPE, SPEC, assert_arrived, sender_cache, wait_results


@pytest.mark.parametrize(
    "src, dst",
    [
        ([2, 5, 11], [7, 0, 3]),
        ([1, 2, 3, 4, 5, 6, 7, 8], [11, 10, 9, 0, 1, 2, 3, 4]),
        ([9, 3, 5, 0, 11, 1, 7, 2], [2, 3, 4, 5, 6, 7, 8, 9]),
        ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 0, 1, 2, 3]),
    ],
    ids=["scattered", "run-to-scattered", "scattered-to-run", "runs-to-runs"],
)
def test_pack_and_unpack_move_blocks_between_different_ids(src, dst):
    """Guards the wire layout: the receiver's block ids differ from the sender's, scattered or
    in runs of consecutive ids (copied a run at a time), packed into a buffer or a new tensor."""
    source = sender_cache()
    target = torch.zeros(SHAPE)
    for start, end in [(0, 2), (2, 3)]:
        into = torch.full((end - start, 2, 2, len(src), 4, 8), -1.0)
        packed = pack_layers(source, start, end, src, out=into if start else None)
        assert torch.equal(packed, source[start:end].index_select(3, torch.tensor(src)))
        unpack_layers(target, start, end, dst, packed)
    for s, d in zip(src, dst):
        assert torch.equal(target[:, :, :, d], source[:, :, :, s])
    assert int((target != 0).any(dim=(0, 1, 2, 4, 5)).sum()) == len(dst)


def test_layers_travel_in_runs_of_about_eight_megabytes():
    """Guards against one gloo message per layer (~1 ms each) for small prompts."""
    cache = torch.empty(30, 2, 3, 600, 16, 64)  # SmolLM2's layout: 24 KB per block and layer
    assert layer_runs(cache, 8) == [(0, 30)]
    assert layer_runs(cache, 128) == [(start, start + 2) for start in range(0, 30, 2)]  # 3.1 MB a layer
    assert layer_runs(cache, 512) == [(layer, layer + 1) for layer in range(30)]  # 12.6 MB a layer


@pytest.mark.slow  # a sender in a process of its own: seconds
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "wire"])
def test_transfers_sent_in_another_order_than_expected_all_arrive_intact(start_sender, shared_memory):
    """Guards against 'expected transfer A, got B': under load the prefill side sends in the
    order its requests finish, not the order the decode side expected them, and each mix-up
    broke the pair and failed every transfer queued behind it."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20, shared_memory=shared_memory)
    conn = start_sender(shared_memory=shared_memory)
    jobs = [(1, [0, 1, 2], [4, 5, 6]), (2, [3], [7]), (3, [11, 10], [8, 9]), (4, [9], [10])]
    try:
        for transfer_id, _, dst in jobs:
            receiver.expect(transfer_id, dst)
        for transfer_id, src, _ in reversed(jobs):
            conn.send(("send", transfer_id, src, receiver.endpoint))
        counters = TransferCounters()
        results = wait_results(receiver, len(jobs), counters=counters)
        conn.send(("results", len(jobs)))
        sender_results = conn.recv()
    finally:
        receiver.close()
    assert results == {transfer_id: (True, None) for transfer_id, _, _ in jobs}
    assert sorted(r[:2] for r in sender_results) == [(j[0], True) for j in jobs]
    for _, src, dst in jobs:
        assert_arrived(receiver, src, dst)
    assert counters.bytes == sum(len(j[1]) for j in jobs) * BLOCK_BYTES


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_an_announcement_before_its_expectation_waits_for_it(start_sender):
    """The decode engine tells its workers what to expect between two steps; a prefill replica
    quick enough announces its transfer first. The receiver waits for the expectation."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender()
    try:
        conn.send(("send", 7, [2, 3], receiver.endpoint))
        time.sleep(1.0)
        assert receiver.poll() == []
        receiver.expect(7, [9, 10])
        results = wait_results(receiver, 1)
        conn.send(("results", 1))
        conn.recv()
    finally:
        receiver.close()
    assert results == {7: (True, None)}
    assert_arrived(receiver, [2, 3], [9, 10])


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_a_cancelled_transfer_ends_at_once_and_the_pair_goes_on(start_sender):
    """Guards the leak of aborted requests' blocks: a transfer the decode side cancels reports
    at once (its blocks can be freed), its data is drained when it comes, and the next transfer
    on the same pair arrives."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender()
    try:
        receiver.expect(1, [0, 1])
        receiver.cancel(1)
        assert wait_results(receiver, 1, timeout_s=1) == {1: (False, "cancelled")}
        conn.send(("send", 1, [5, 6], receiver.endpoint))  # sent anyway: drained
        receiver.expect(2, [3])
        conn.send(("send", 2, [7], receiver.endpoint))
        results = wait_results(receiver, 1)
        conn.send(("results", 2))
        sender_results = dict((r[0], r[1]) for r in conn.recv())
    finally:
        receiver.close()
    assert results == {2: (True, None)}
    assert sender_results == {1: False, 2: True}
    assert not receiver.kv_cache[:, :, :, [0, 1]].any()  # the cancelled blocks were never written
    assert_arrived(receiver, [7], [3])


def test_each_result_wakes_whoever_waits_on_the_endpoint():
    """``on_report`` (``KVConnectorWorker.on_results``: a replica's engine loop) is called once per
    result, after the result can be polled: an engine waiting on a transfer steps at once,
    rather than at its next busy poll."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    polled_when_woken = []
    receiver.on_report = lambda: polled_when_woken.append(receiver.poll())
    try:
        receiver.cancel(9)
        receiver.cancel(10)
        deadline = time.monotonic() + 5
        while len(polled_when_woken) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        receiver.close()
    assert [[(result.transfer_id, result.ok) for result in results] for results in polled_when_woken] == [[(9, False)], [(10, False)]]


def test_cancelling_a_transfer_never_expected_here_reports_it_at_once():
    """Blocks an engine holds for a receive its workers never heard of (its expectation lost)
    come free: the cancel is answered at once, and a late announcement would be drained."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    try:
        receiver.cancel(9)
        assert wait_results(receiver, 1, timeout_s=1) == {9: (False, "cancelled")}
    finally:
        receiver.close()


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_a_sender_that_gives_up_mid_stream_fails_only_that_transfer(start_sender, monkeypatch):
    """A prefill request aborted after its first layers went out: the rest goes as filler marked
    invalid, the decode side fails that transfer, and the pair stays in step."""
    import duet.kv_transfer.wire as wire

    monkeypatch.setattr(wire, "TARGET_MESSAGE_BYTES", 1)  # one layer a run, on both sides
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender(message_bytes=1)
    try:
        receiver.expect(1, [0, 1])
        conn.send(("stream", 1, 2, receiver.endpoint))
        conn.send(("mark", 1, 1, [2, 3]))  # layer 0 computed and sent, then the request is aborted
        conn.send(("await_start", 1))
        assert conn.recv() == "started"
        conn.send(("cancel", 1))
        results = wait_results(receiver, 1)
        receiver.expect(2, [4])
        conn.send(("send", 2, [8], receiver.endpoint))
        results |= wait_results(receiver, 1)
        conn.send(("results", 2))
        sender_results = dict((r[0], r[1]) for r in conn.recv())
    finally:
        receiver.close()
    assert results[1] == (False, "the prefill replica aborted the request mid-transfer")
    assert results[2] == (True, None)
    assert sender_results == {1: False, 2: True}
    assert_arrived(receiver, [8], [4])


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_a_request_aborted_as_its_transfer_starts_fails_only_that_transfer(start_sender):
    """Guards against a cancel landing between a transfer being picked and its first run going
    out: that raised out of the pair's thread, broke the pair (the receiver read "Connection closed
    by peer") and failed every transfer under way on it."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender(cancel_at_start=True)
    try:
        receiver.expect(1, [0, 1])
        conn.send(("send", 1, [2, 3], receiver.endpoint))
        results = wait_results(receiver, 1)
        conn.send(("results", 1))
        sender_results = dict((r[0], r[1:]) for r in conn.recv())
    finally:
        receiver.close()
    assert results[1] == (False, "the prefill replica aborted the request mid-transfer")
    assert sender_results == {1: (False, "the request was aborted")}


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_an_expected_transfer_never_announced_times_out_alone(start_sender):
    """Guards against a decode replica holding blocks forever for a prefill that never sends:
    the expectation expires through poll(), and another transfer on the pair is unaffected."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender()
    try:
        receiver.expect(1, [0], timeout_s=0.5)
        receiver.expect(2, [1])
        conn.send(("send", 2, [4], receiver.endpoint))
        results = wait_results(receiver, 2)
        conn.send(("results", 1))
        conn.recv()
    finally:
        receiver.close()
    assert results[1] == (False, "its KV was not announced in time")
    assert results[2] == (True, None)


@pytest.mark.slow  # a sender in a process of its own: seconds
@pytest.mark.parametrize("expected_first", [True, False], ids=["expected-then-queued", "queued-then-expected"])
def test_a_transfer_queued_and_never_announced_fails_within_its_window(start_sender, expected_first):
    """Guards clients left waiting after a prefill replica died with prompts' KV queued behind
    another transfer (seen in CI): a receiver waits long for a prompt's transfer to be queued
    (the prompt may wait on its prefill replica), but once its sender has queued it, it must be
    announced within QUEUED_START_TIMEOUTS of the pair's timeout, whichever of the sender's
    notice and the receiver's expectation comes first. Here the sender holds it (its layers never
    come, and it gives up only after 30 s): the receiver fails it on its own, well before."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=1)
    conn = start_sender()
    try:
        began = time.monotonic()
        if expected_first:
            receiver.expect(1, [0], STREAM_START_TIMEOUT_S)
        conn.send(("stream", 1, 1, receiver.endpoint))
        if not expected_first:
            deadline = time.monotonic() + 10
            while 1 not in receiver._queued and time.monotonic() < deadline:
                time.sleep(0.01)
            receiver.expect(1, [0], STREAM_START_TIMEOUT_S)
        results = wait_results(receiver, 1, timeout_s=15)
        waited = time.monotonic() - began
        conn.send(("cancel", 1))
        conn.send(("results", 1))
        conn.recv()
    finally:
        receiver.close()
    assert results == {1: (False, "its KV was not announced in time")}
    assert QUEUED_START_TIMEOUTS * receiver.timeout_s <= waited < 15


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_a_queued_transfer_fails_soon_after_its_sender_dies(start_sender, monkeypatch):
    """Guards a client left waiting 120 s in CI after its prefill replica was killed: the prompt's
    first token had been answered, its transfer was queued behind others, and the receiver gave
    it QUEUED_START_TIMEOUTS of the pair's timeout to be announced. A sender says every
    SENDER_ALIVE_S which transfers it still has queued: while it lives the transfer waits (its
    layers may come), once it is killed the receiver fails it within SENDER_SILENT_S."""
    silent_s = 4 * SENDER_ALIVE_S
    monkeypatch.setattr(receiver_module, "SENDER_SILENT_S", silent_s)
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=30)
    conn = start_sender()
    try:
        receiver.expect(1, [0], STREAM_START_TIMEOUT_S)
        conn.send(("stream", 1, 1, receiver.endpoint))
        alive = wait_results(receiver, 1, timeout_s=2 * silent_s)
        start_sender.processes[-1].kill()
        killed = time.monotonic()
        results = wait_results(receiver, 1, timeout_s=QUEUED_START_TIMEOUTS * receiver.timeout_s)
        waited = time.monotonic() - killed
    finally:
        receiver.close()
    assert alive == {}
    assert results == {1: (False, "its sender fell silent before announcing it")}
    assert waited < QUEUED_START_TIMEOUTS * receiver.timeout_s / 4  # its sender's silence, not the queued window
