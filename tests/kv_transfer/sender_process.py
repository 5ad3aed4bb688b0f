"""The far side of the transfer tests: a ``KVSender`` in a process of its own, driven by commands
over a pipe (``sender_process``; the ``start_sender`` fixture starts it), and the receiving side's
checks."""

from __future__ import annotations

import time

import torch

from duet.kv_transfer.progress import LayerProgress
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.sender import KVSender
from duet.kv_transfer.spec import KVSpec

SHAPE = (3, 2, 2, 12, 4, 8)  # layers, K/V, kv heads, blocks, block size, head dim
SPEC = KVSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="float32")
BLOCK_BYTES = 3 * 2 * 2 * 4 * 8 * 4


def sender_cache(shape=SHAPE, dtype: str = "float32") -> torch.Tensor:
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


def sender_process(
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
    cache = sender_cache(shape, dtype)
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


def wait_results(receiver: KVReceiver, count: int, timeout_s: float = 30, counters=None) -> dict[int, tuple[bool, str | None]]:
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


def assert_arrived(receiver: KVReceiver, src_blocks: list[int], dst_blocks: list[int], dtype: str = "float32") -> None:
    source = sender_cache(dtype=dtype)
    for src, dst in zip(src_blocks, dst_blocks):
        assert torch.equal(receiver.kv_cache[:, :, :, dst], source[:, :, :, src])
