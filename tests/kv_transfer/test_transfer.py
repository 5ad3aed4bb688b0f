"""KV blocks cross process boundaries intact over a pairwise gloo group built at run time, in
whatever order transfers are announced, with cancellations and timeouts that never break a pair.
Two processes of one machine move the runs through shared memory by default (``kv_transfer/shm.py``);
the tests marked ``wire`` move them over the socket, as between machines."""

from __future__ import annotations

import random
import time

import pytest
import torch

from duet.kv_connector import TransferCounters
from duet.kv_transfer import receiver as receiver_module
from duet.kv_transfer.endpoint import QUEUED_START_TIMEOUTS, SENDER_ALIVE_S, STREAM_START_TIMEOUT_S
from duet.kv_transfer.progress import LayerProgress
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.sender import KVSender
from duet.kv_transfer.spec import KVSpec, KVSpecMismatchError
from duet.kv_transfer.wire import layer_runs, pack_layers, unpack_layers
from duet.messages import KVEndpoint

SHAPE = (3, 2, 2, 12, 4, 8)  # layers, K/V, kv heads, blocks, block size, head dim
SPEC = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="float32")
BLOCK_BYTES = 3 * 2 * 2 * 4 * 8 * 4


def _sender_cache(shape=SHAPE, dtype: str = "float32") -> torch.Tensor:
    values = torch.arange(torch.Size(shape).numel()).view(shape)
    return values.float() if dtype == "float32" else (values % 251 - 125).to(getattr(torch, dtype))


def _crash_mid_transfer(pair, group, job) -> None:
    """A sender that has announced its transfer and joined the group dies before any data."""
    import os

    os._exit(1)


def _cancel_as_it_starts(send):
    """A request aborted in the instant between its transfer being picked and its first run."""

    def cancelled_first(pair, group, job) -> None:
        job.progress.cancel()
        send(pair, group, job)

    return cancelled_first


def _sender_process(
    conn, spec_dict, shape, crash: bool, message_bytes: int | None, faults: str | None, dtype: str, layers: tuple[int, int] | None,
    cancel_at_start: bool, shared_memory: bool, shm_full: bool,
) -> None:
    """A KVSender driven by commands from the test (holding ``layers`` of the model, if given:
    those of the whole cache ``shape``):
    ("send", id, blocks, endpoint[, layers]) ships ready blocks (first token: the id); ("stream", id,
    num_blocks, endpoint) queues a transfer whose layers come later with ("mark", id, layers, blocks);
    ("cancel", id); ("await_start", id) answers once that transfer is under way; ("results",
    count) answers with the first ``count`` results. ``faults``: its ``DUET_KV_FAULTS``;
    ``cancel_at_start``: every transfer's request is aborted as its first run is about to go;
    ``shm_full``: /dev/shm has no room for any page (as a small container's may not)."""
    if faults is not None:
        import os

        from duet.kv_transfer.faults import FAULTS_ENV

        os.environ[FAULTS_ENV] = faults
    if crash:
        from duet.kv_transfer.sender import _SenderPair

        _SenderPair._send = _crash_mid_transfer
    if cancel_at_start:
        from duet.kv_transfer.sender import _SenderPair

        _SenderPair._send = _cancel_as_it_starts(_SenderPair._send)
    if shm_full:
        import errno
        import os

        def no_room(descriptor, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = no_room
    if message_bytes is not None:
        import duet.kv_transfer.wire as wire

        wire.TARGET_MESSAGE_BYTES = message_bytes
    cache = _sender_cache(shape, dtype)
    if layers is not None:
        cache = cache[layers[0] : layers[1]].clone()
    name = "prefill" if layers is None else f"prefill.stage{layers[0]}"  # a pair's key names its sender
    sender = KVSender(cache, KVSpec.from_dict(spec_dict), timeout_s=5, name=name, layers=layers, shared_memory=shared_memory)
    progress: dict[int, LayerProgress] = {}
    while True:
        command, *args = conn.recv()
        if command == "send":
            transfer_id, block_ids, endpoint, *part = args
            complete = LayerProgress.complete(cache.shape[0], block_ids, transfer_id)
            sender.send(transfer_id, endpoint, complete, len(block_ids), layers=part[0] if part else None)
        elif command == "stream":
            transfer_id, num_blocks, endpoint = args
            progress[transfer_id] = LayerProgress(shape[0])
            sender.send(transfer_id, endpoint, progress[transfer_id], num_blocks, timeout_s=30)
        elif command == "mark":
            transfer_id, num_layers, block_ids = args
            progress[transfer_id].mark_ready(num_layers, block_ids)
        elif command == "cancel":
            sender.cancel(args[0])
        elif command == "await_start":  # answers once that transfer is on the wire
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                getattr(pair.active, "transfer_id", None) == args[0] for pair in list(sender._pairs.values())
            ):
                time.sleep(0.01)
            conn.send("started")
        elif command == "results":
            done, deadline = [], time.monotonic() + 60
            while len(done) < args[0] and time.monotonic() < deadline:
                done += sender.poll()
                time.sleep(0.01)
            conn.send([(r.transfer_id, r.ok, r.error) for r in done])
            sender.close()
            return


def _wait_results(receiver: KVReceiver, count: int, timeout_s: float = 30, counters=None) -> dict[int, tuple[bool, str | None]]:
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < count and time.monotonic() < deadline:
        for result in receiver.poll():
            if counters is not None:
                counters.count(result)
            assert result.transfer_id not in results, f"transfer {result.transfer_id} reported twice"
            results[result.transfer_id] = (result.ok, result.error)
            if result.ok:  # the sender in these tests sends the transfer id as the first token
                assert result.first_token_id == result.transfer_id
        time.sleep(0.01)
    return results


def _assert_arrived(receiver: KVReceiver, src_blocks: list[int], dst_blocks: list[int], dtype: str = "float32") -> None:
    source = _sender_cache(dtype=dtype)
    for src, dst in zip(src_blocks, dst_blocks):
        assert torch.equal(receiver.kv_cache[:, :, :, dst], source[:, :, :, src])


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
    source = _sender_cache()
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
        results = _wait_results(receiver, len(jobs), counters=counters)
        conn.send(("results", len(jobs)))
        sender_results = conn.recv()
    finally:
        receiver.close()
    assert results == {transfer_id: (True, None) for transfer_id, _, _ in jobs}
    assert sorted(r[:2] for r in sender_results) == [(j[0], True) for j in jobs]
    for _, src, dst in jobs:
        _assert_arrived(receiver, src, dst)
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
        results = _wait_results(receiver, 1)
        conn.send(("results", 1))
        conn.recv()
    finally:
        receiver.close()
    assert results == {7: (True, None)}
    _assert_arrived(receiver, [2, 3], [9, 10])


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
        assert _wait_results(receiver, 1, timeout_s=1) == {1: (False, "cancelled")}
        conn.send(("send", 1, [5, 6], receiver.endpoint))  # sent anyway: drained
        receiver.expect(2, [3])
        conn.send(("send", 2, [7], receiver.endpoint))
        results = _wait_results(receiver, 1)
        conn.send(("results", 2))
        sender_results = dict((r[0], r[1]) for r in conn.recv())
    finally:
        receiver.close()
    assert results == {2: (True, None)}
    assert sender_results == {1: False, 2: True}
    assert not receiver.kv_cache[:, :, :, [0, 1]].any()  # the cancelled blocks were never written
    _assert_arrived(receiver, [7], [3])


def test_cancelling_a_transfer_never_expected_here_reports_it_at_once():
    """Blocks an engine holds for a receive its workers never heard of (its expectation lost)
    come free: the cancel is answered at once, and a late announcement would be drained."""
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    try:
        receiver.cancel(9)
        assert _wait_results(receiver, 1, timeout_s=1) == {9: (False, "cancelled")}
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
        results = _wait_results(receiver, 1)
        receiver.expect(2, [4])
        conn.send(("send", 2, [8], receiver.endpoint))
        results |= _wait_results(receiver, 1)
        conn.send(("results", 2))
        sender_results = dict((r[0], r[1]) for r in conn.recv())
    finally:
        receiver.close()
    assert results[1] == (False, "the prefill replica aborted the request mid-transfer")
    assert results[2] == (True, None)
    assert sender_results == {1: False, 2: True}
    _assert_arrived(receiver, [8], [4])


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
        results = _wait_results(receiver, 1)
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
        results = _wait_results(receiver, 2)
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
        results = _wait_results(receiver, 1, timeout_s=15)
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
        alive = _wait_results(receiver, 1, timeout_s=2 * silent_s)
        start_sender.processes[-1].kill()
        killed = time.monotonic()
        results = _wait_results(receiver, 1, timeout_s=QUEUED_START_TIMEOUTS * receiver.timeout_s)
        waited = time.monotonic() - killed
    finally:
        receiver.close()
    assert alive == {}
    assert results == {1: (False, "its sender fell silent before announcing it")}
    assert waited < QUEUED_START_TIMEOUTS * receiver.timeout_s / 4  # its sender's silence, not the queued window


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
        results = _wait_results(receiver, len(jobs), timeout_s=60, counters=counters)
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
        results = _wait_results(receiver, 1, counters=counters)
        conn.send(("results", 1))
        conn.recv()
    finally:
        receiver.close()
    assert results == {1: (True, None)}
    _assert_arrived(receiver, [2, 5, 11], [4, 0, 9], dtype)
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
        results = _wait_results(receiver, 1)
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
        results = _wait_results(receiver, 2, timeout_s=30)
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
        results = _wait_results(receiver, 1)
        conn.send(("send", 2, [8], receiver.endpoint))
        results |= _wait_results(receiver, 1)
        conn.send(("results", 2))
        sender_results = {r[0]: (r[1], r[2]) for r in conn.recv()}
    finally:
        receiver.close()
    assert not results[1][0] and results[1][1].startswith("the KV of layers 0-2 arrived corrupted (checksum ")
    assert results[2] == (True, None)
    assert sender_results == {1: (False, "the decode replica received it corrupted"), 2: (True, None)}
    _assert_arrived(receiver, [8], [4])


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
        results = _wait_results(receiver, 1)
        conn.send(("send", 2, [8], receiver.endpoint))
        conn.send(("send", 3, [9], other.endpoint))
        other_results = _wait_results(other, 1)
        results |= _wait_results(receiver, 1, timeout_s=30)
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
    _assert_arrived(receiver, [8], [4])
    _assert_arrived(other, [9], [5])


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_pipeline_stages_cut_differently_on_each_side_send_each_layer_where_it_is_held(start_sender):
    """A prefill of two stages (layer 0; layers 1-2) into a decode of two (layers 0-1; layer 2):
    each part goes straight from the stage that has the layers to the one that holds them, the
    receiver of layers 0-1 completes once both its parts are in, and each part lands at its
    place in the stage's own (smaller) cache."""
    source = _sender_cache()
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
        assert [_wait_results(receiver, 1) for receiver in receivers] == [{7: (True, None)}] * 2
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
