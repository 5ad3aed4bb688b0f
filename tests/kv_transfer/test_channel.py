"""The control channel: messages posted by any number of writers are read once each, in
slots that fill with no gap."""

from __future__ import annotations

import threading

import torch.distributed as dist

from duet.kv_transfer.channel import Channel


def _log(store: dist.TCPStore, count: int) -> list[list[str] | None]:
    """Slots 1..count, as the listener reads them (None: still empty)."""
    slots = dist.PrefixStore("duet/channel", store)
    channel = Channel(store)
    return [channel.read(index, lambda: True) if slots.check([f"m/{index}"]) else None for index in range(1, count + 1)]


def test_identical_messages_posted_at_once_leave_no_empty_slot():
    """Guards against two prefill ranks cancelling the same transfer at the same instant: each
    compare-and-set found the other's identical message and took the slot for its own, the
    count moved past a slot no one wrote, and the decode worker's listener waited on it for
    good (every later transfer to that worker failed)."""
    for _ in range(5):
        host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        writers = [Channel(dist.TCPStore("127.0.0.1", host.port, is_master=False)) for _ in range(2)]
        start = threading.Barrier(len(writers))

        def post(channel: Channel) -> None:
            start.wait()
            channel.post("cancel", 42, "timeout")

        threads = [threading.Thread(target=post, args=(channel,)) for channel in writers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        Channel(host).post("send", "pair", 43)
        assert _log(host, 4) == [["cancel", "42", "timeout"], ["cancel", "42", "timeout"], ["send", "pair", "43"], None]
