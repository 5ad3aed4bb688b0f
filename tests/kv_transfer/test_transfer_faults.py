"""KV transfers under bursts, faults and mismatches: a burst with cancellations, one-byte caches,
refused layouts, a sender killed, runs corrupted, stalled or dropped on the way, pipeline stages
cut differently on each side; every fault fails its own transfer alone and the pair goes on (or a
new one is made). The sender runs in a process of its own (``sender_process``)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from duet.kv_connector import TransferCounters
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.spec import KVSpec, KVSpecMismatchError
from duet.messages import KVEndpoint
from tests.kv_transfer.sender_process import BLOCK_BYTES, SHAPE, SPEC, assert_arrived, sender_cache, wait_results


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_a_burst_of_transfers_with_cancellations_never_breaks_the_pair(start_sender):
    """Guards item 5 of the hostile-load report: hundreds of transfers on one pair, sent in a
    shuffled order, a fifth cancelled by the decode side: every transfer reports exactly once,
    every kept one arrives intact, none fails for any other reason."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender()
    rng = random.Random(0)
    jobs = [(transfer_id, [rng.randrange(12)], [rng.randrange(12)]) for transfer_id in range(1, 201)]
    cancelled = {transfer_id for transfer_id, _, _ in jobs if rng.random() < 0.2}
    try:
        for transfer_id, _, dst in jobs:
            receiver.expect(transfer_id, dst)
        order = jobs[:]
        rng.shuffle(order)
        for transfer_id, src, _ in order:
            if transfer_id in cancelled:
                receiver.cancel(transfer_id)
            conn.send(("send", transfer_id, src, receiver.endpoint))
        counters = TransferCounters()
        results = wait_results(receiver, len(jobs), timeout_s=60, counters=counters)
        conn.send(("results", len(jobs)))
        conn.recv()
    finally:
        receiver.close()
    assert len(results) == len(jobs)
    assert {tid for tid, (ok, _) in results.items() if not ok} == cancelled
    assert all(error == "cancelled" for ok, error in results.values() if not ok)
    assert counters.transfers == len(jobs) - len(cancelled)
    assert (counters.cancelled, counters.failures) == (len(cancelled), 0)


@pytest.mark.slow  # a sender in a process of its own: seconds
@pytest.mark.parametrize("dtype", ["int8", "uint8"])  # an int8 cache; an fp8 one travels as its bytes (uint8)
def test_one_byte_kv_caches_travel_as_they_are(start_sender, dtype):
    """Quantized KV (codes and their scale bytes) crosses as stored: a quarter of fp32's bytes
    for the same blocks, none of them changed."""
    receiver = KVReceiver(torch.zeros(SHAPE, dtype=getattr(torch, dtype)), SPEC, timeout_s=20)
    conn = start_sender(dtype=dtype)
    try:
        receiver.expect(1, [4, 0, 9])
        conn.send(("send", 1, [2, 5, 11], receiver.endpoint))
        counters = TransferCounters()
        results = wait_results(receiver, 1, counters=counters)
        conn.send(("results", 1))
        conn.recv()
    finally:
        receiver.close()
    assert results == {1: (True, None)}
    assert_arrived(receiver, [2, 5, 11], [4, 0, 9], dtype)
    assert counters.bytes == 3 * BLOCK_BYTES // 4


def test_kv_cache_dtypes_that_differ_are_named_in_the_refusal():
    int8 = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="int8")
    with pytest.raises(KVSpecMismatchError, match="kv_dtype: here 'int8', peer 'float8_e4m3fn'"):
        int8.check_compatible(KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="float8_e4m3fn"))


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_mismatched_block_size_is_refused_with_a_clear_error(start_sender):
    """Guards against scattering KV of another layout: the handshake names the differing fields."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=10)
    other = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, kv_dtype="bfloat16")
    conn = start_sender(other)
    try:
        receiver.expect(1, [0])
        conn.send(("send", 1, [0], receiver.endpoint))
        results = wait_results(receiver, 1)
        conn.send(("results", 1))
        sender_results = conn.recv()
    finally:
        receiver.close()
    assert not results[1][0] and "block_size: here 4, peer 16" in results[1][1]
    assert "kv_dtype" in results[1][1]
    assert sender_results[0][1] is False
    with pytest.raises(KVSpecMismatchError, match="block_size"):
        SPEC.check_compatible(other)


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_sender_killed_mid_transfer_fails_its_transfers_and_ends_the_pair(start_sender):
    """Guards against a decode replica waiting forever on a dead prefill replica, and against
    the broken pair's thread staying behind."""
    # Transfer 5's deadline is long enough for the sender process to start on a loaded machine
    # (it must fail by the pair breaking, not by its deadline); transfer 6 is never announced.
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=60)
    conn = start_sender(crash=True)
    try:
        receiver.expect(5, [0, 1])
        receiver.expect(6, [2], timeout_s=3)
        conn.send(("send", 5, [3, 4], receiver.endpoint))
        results = wait_results(receiver, 2, timeout_s=30)
        deadline = time.monotonic() + 5
        while receiver.num_threads > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.num_threads == 1  # the listener; the broken pair's thread has ended
    finally:
        receiver.close()
    assert {tid: ok for tid, (ok, _) in results.items()} == {5: False, 6: False}
    assert "broke" in results[5][1] and results[6][1] == "its KV was not announced in time"



@pytest.mark.slow  # a sender in a process of its own: seconds
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "wire"])
def test_a_run_corrupted_on_the_wire_is_refused_and_the_pair_goes_on(start_sender, shared_memory):
    """Guards against serving another request's (or garbage) KV with a 200, as vLLM's NIXL path
    has: a bit flipped after the sender summed the run fails that transfer on both sides (it is
    then recomputed), and the next transfer on the same pair arrives intact."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20, shared_memory=shared_memory)
    conn = start_sender(faults="corrupt=1", shared_memory=shared_memory)
    try:
        receiver.expect(1, [0, 1])
        receiver.expect(2, [4])
        conn.send(("send", 1, [2, 3], receiver.endpoint))
        results = wait_results(receiver, 1)
        conn.send(("send", 2, [8], receiver.endpoint))
        results |= wait_results(receiver, 1)
        conn.send(("results", 2))
        sender_results = {r[0]: (r[1], r[2]) for r in conn.recv()}
    finally:
        receiver.close()
    assert not results[1][0] and results[1][1].startswith("the KV of layers 0-2 arrived corrupted (checksum ")
    assert results[2] == (True, None)
    assert sender_results == {1: (False, "the decode replica received it corrupted"), 2: (True, None)}
    assert_arrived(receiver, [8], [4])


@pytest.mark.slow  # a sender in a process of its own: seconds
@pytest.mark.parametrize("fault", ["stall=1:6", "drop=1"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "wire"])
def test_a_transfer_that_stalls_or_drops_mid_way_fails_alone_and_the_rest_go_over_a_new_pair(start_sender, fault, shared_memory):
    """Guards against a hung or lost peer hanging the decode side or taking other transfers with
    it: after its first run, transfer 1 stalls past the receiver's timeout (or its pair drops);
    it fails on both sides within the timeouts. Transfer 2, sent next to the same receiver,
    goes over a new pair (a new key, a new group); transfer 3, to another receiver, arrives
    intact; the broken pair's thread does not stay behind."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=2, shared_memory=shared_memory)
    other = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20, shared_memory=shared_memory)
    conn = start_sender(faults=fault, shared_memory=shared_memory)
    try:
        receiver.expect(1, [0, 1], timeout_s=30)  # announced once the sender's first pair is up (slow under load)
        receiver.expect(2, [4], timeout_s=30)  # announced once the stalled pair gives up
        other.expect(3, [5])
        conn.send(("send", 1, [2, 3], receiver.endpoint))
        results = wait_results(receiver, 1)
        conn.send(("send", 2, [8], receiver.endpoint))
        conn.send(("send", 3, [9], other.endpoint))
        other_results = wait_results(other, 1)
        results |= wait_results(receiver, 1, timeout_s=30)
        conn.send(("results", 3))
        sender_results = {r[0]: r[1] for r in conn.recv()}
        deadline = time.monotonic() + 5
        while receiver.num_threads > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.num_threads == 2  # the listener and the new pair's; the broken pair's ended
    finally:
        receiver.close()
        other.close()
    assert other_results == {3: (True, None)}
    assert not results[1][0] and results[1][1].startswith("pair prefill->127.0.0.1:")
    assert results[2] == (True, None)
    assert sender_results == {1: False, 2: True, 3: True}
    assert_arrived(receiver, [8], [4])
    assert_arrived(other, [9], [5])


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_pipeline_stages_cut_differently_on_each_side_send_each_layer_where_it_is_held(start_sender):
    """A prefill of two stages (layer 0; layers 1-2) into a decode of two (layers 0-1; layer 2):
    each part goes straight from the stage that has the layers to the one that holds them, the
    receiver of layers 0-1 completes once both its parts are in, and each part lands at its
    place in the stage's own (smaller) cache."""
    source = sender_cache()
    caches = [torch.zeros((2, *SHAPE[1:])), torch.zeros((1, *SHAPE[1:]))]
    receivers = [KVReceiver(caches[0], SPEC, timeout_s=5, layers=(0, 2)), KVReceiver(caches[1], SPEC, timeout_s=5, layers=(2, 3))]
    assert [receiver.endpoint.layers for receiver in receivers] == [(0, 2), (2, 3)]
    try:
        first, second = start_sender(layers=(0, 1)), start_sender(layers=(1, 3))
        for receiver in receivers:
            receiver.expect(7, [4, 9])
        first.send(("send", 7, [3, 5], receivers[0].endpoint))  # layer 0
        second.send(("send", 7, [3, 5], receivers[0].endpoint, (1, 2)))
        second.send(("send", 7, [3, 5], receivers[1].endpoint, (2, 3)))
        assert [wait_results(receiver, 1) for receiver in receivers] == [{7: (True, None)}] * 2
        first.send(("results", 1))
        second.send(("results", 2))
        assert first.recv() == [(7, True, None)] and second.recv() == [(7, True, None)] * 2
    finally:
        for receiver in receivers:
            receiver.close()
    for src, dst in ((3, 4), (5, 9)):
        assert torch.equal(caches[0][:, :, :, dst], source[0:2, :, :, src])
        assert torch.equal(caches[1][:, :, :, dst], source[2:3, :, :, src])


def test_a_part_of_layers_the_receiver_does_not_hold_is_refused():
    receiver = KVReceiver(torch.zeros((1, *SHAPE[1:])), SPEC, timeout_s=5, layers=(2, 3))
    try:
        assert receiver.held((0, 2), (2, 3)) and not receiver.held((0, 2), (1, 3)) and not receiver.held((0, 3), (2, 3))
    finally:
        receiver.close()


def test_endpoint_is_small_and_picklable():
    import pickle

    endpoint = KVEndpoint("127.0.0.1", 12345)
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint
