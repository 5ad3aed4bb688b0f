"""KV blocks cross process boundaries intact over a pairwise gloo group built at run time."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from duet.kv_transfer.group import Endpoint
from duet.kv_transfer.spec import KVSpec, KVSpecMismatchError
from duet.kv_transfer.transfer import KVReceiver, KVSender
from duet.kv_transfer.wire import layer_runs, pack_layers, unpack_layers

SHAPE = (3, 2, 2, 12, 4, 8)  # layers, K/V, kv heads, blocks, block size, head dim
SPEC = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="float32")


def _sender_cache() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)


def _sender_process(conn, spec_dict, die_after_header: bool) -> None:
    """Runs a KVSender on commands from the test: (transfer_id, block_ids, endpoint, pair_key)."""
    sender = KVSender(_sender_cache(), KVSpec.from_dict(spec_dict), timeout_s=10)
    if die_after_header:
        # Simulate a crash mid-transfer: send only the header, then exit abruptly.
        from duet.kv_transfer.group import SENDER_RANK, PairGroup, connect_store

        transfer_id, block_ids, endpoint, pair_key = conn.recv()
        group = PairGroup(connect_store(endpoint, 10), pair_key, SENDER_RANK, sender.spec, False, 10)
        group.send(torch.tensor([transfer_id, len(block_ids)]), 0).wait()
        import os

        os._exit(1)
    while True:
        command = conn.recv()
        if command is None:
            break
        sender.send(*command)
    expected, deadline = conn.recv(), time.monotonic() + 30
    done = []
    while len(done) < expected and time.monotonic() < deadline:
        done += sender.poll()
        time.sleep(0.01)
    conn.send([(r.transfer_id, r.ok, r.error) for r in done])


def _start_sender(spec: KVSpec, die_after_header: bool = False):
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_sender_process, args=(child, spec.to_dict(), die_after_header))
    process.start()
    return process, parent


def _wait_results(receiver: KVReceiver, count: int, timeout_s: float = 30):
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < count and time.monotonic() < deadline:
        results += receiver.poll()
        time.sleep(0.01)
    return results


def test_pack_and_unpack_move_blocks_between_different_ids():
    """Guards the wire layout: the receiver's block ids differ from the sender's."""
    source = _sender_cache()
    target = torch.zeros(SHAPE)
    for start, end in [(0, 2), (2, 3)]:
        unpack_layers(target, start, end, [7, 0, 3], pack_layers(source, start, end, [2, 5, 11]))
    for src, dst in [(2, 7), (5, 0), (11, 3)]:
        assert torch.equal(target[:, :, :, dst], source[:, :, :, src])
    assert int((target != 0).any(dim=(0, 1, 2, 4, 5)).sum()) == 3


def test_layers_travel_in_runs_of_about_eight_megabytes():
    """Guards against one gloo message per layer (~1 ms each) for small prompts."""
    cache = torch.empty(30, 2, 3, 600, 16, 64)  # SmolLM2's layout: 24 KB per block and layer
    assert layer_runs(cache, 8) == [(0, 30)]
    assert layer_runs(cache, 128) == [(start, start + 2) for start in range(0, 30, 2)]  # 3.1 MB a layer
    assert layer_runs(cache, 512) == [(layer, layer + 1) for layer in range(30)]  # 12.6 MB a layer


def test_many_transfers_on_one_pair_arrive_in_order_and_intact():
    """Two processes over gloo: several requests queued on one pair, each scattered into its own blocks."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    process, conn = _start_sender(SPEC)
    jobs = [(1, [0, 1, 2], [4, 5, 6]), (2, [3], [7]), (3, [11, 10], [8, 9]), (4, [9], [10])]
    try:
        for transfer_id, src_blocks, dst_blocks in jobs:
            receiver.expect(transfer_id, dst_blocks, "prefill-0/0")
            conn.send((transfer_id, src_blocks, receiver.endpoint, "prefill-0/0"))
        conn.send(None)
        conn.send(len(jobs))
        results = _wait_results(receiver, len(jobs))
        sender_results = conn.recv()
    finally:
        process.join(30)
        receiver.close()
    assert [(r.transfer_id, r.ok) for r in results] == [(j[0], True) for j in jobs]
    assert sorted(r[:2] for r in sender_results) == [(j[0], True) for j in jobs]
    source = _sender_cache()
    for _, src_blocks, dst_blocks in jobs:
        for src, dst in zip(src_blocks, dst_blocks):
            assert torch.equal(receiver.kv_cache[:, :, :, dst], source[:, :, :, src])
    assert receiver.stats.bytes == sum(len(j[1]) for j in jobs) * 3 * 2 * 2 * 4 * 8 * 4


def test_mismatched_block_size_is_refused_with_a_clear_error():
    """Guards against scattering KV of another layout: the handshake names the differing fields."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=10)
    other = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, kv_dtype="bfloat16")
    process, conn = _start_sender(other)
    try:
        receiver.expect(1, [0], "prefill-1/0")
        conn.send((1, [0], receiver.endpoint, "prefill-1/0"))
        conn.send(None)
        conn.send(1)
        results = _wait_results(receiver, 1)
        sender_results = conn.recv()
    finally:
        process.join(30)
        receiver.close()
    assert not results[0].ok and "block_size: here 4, peer 16" in results[0].error
    assert "kv_dtype" in results[0].error
    assert sender_results[0][1] is False
    with pytest.raises(KVSpecMismatchError, match="block_size"):
        SPEC.check_compatible(other)


def test_sender_killed_mid_transfer_fails_the_request_after_the_timeout():
    """Guards against a decode replica waiting forever on a dead prefill replica."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=3)
    process, conn = _start_sender(SPEC, die_after_header=True)
    try:
        receiver.expect(5, [0, 1], "prefill-2/0")
        conn.send((5, [3, 4], receiver.endpoint, "prefill-2/0"))
        results = _wait_results(receiver, 1, timeout_s=30)
    finally:
        process.join(30)
        receiver.close()
    assert [(r.transfer_id, r.ok) for r in results] == [(5, False)]
    assert receiver.stats.failures == 1


def test_endpoint_is_small_and_picklable():
    import pickle

    endpoint = Endpoint("127.0.0.1", 12345)
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint
