"""KV runs through shared memory between two processes of one machine: the pair's ends agree on
it (or fall back to the socket), the receiver reads what the sender packed, slots are reused
only once given back, and no file outlives the pair."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from duet.distributed import connect_store, host_store
from duet.kv_transfer.shm import SHM_DIR, SharedRuns, agree
from duet.kv_transfer.receiver import KVReceiver
from tests.kv_transfer.sender_process import SHAPE, SPEC, assert_arrived, wait_results

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")


def _kv_files() -> set[str]:
    return {path.name for path in SHM_DIR.glob("duet-kv-*")}


def _count_mappings(monkeypatch) -> list[int]:
    """The generation each transfer that came through the slots was read from, as the receiver maps them."""
    mapped, incoming = [], SharedRuns.incoming

    def counted(self, signal, *args):
        mapped.append(int(signal[1]))
        return incoming(self, signal, *args)

    monkeypatch.setattr(SharedRuns, "incoming", counted)
    return mapped


def _agree(sender_wants: bool, receiver_wants: bool) -> tuple[SharedRuns | None, SharedRuns | None]:
    server = host_store("127.0.0.1", 0, 10)
    client = connect_store("127.0.0.1", server.port, 10)
    answers = {}
    thread = threading.Thread(target=lambda: answers.update(receiver=agree(server, False, receiver_wants, timedelta(seconds=10))))
    thread.start()
    answers["sender"] = agree(client, True, sender_wants, timedelta(seconds=10))
    thread.join(10)
    return answers["sender"], answers["receiver"]


@pytest.mark.parametrize("sender_wants, receiver_wants", [(True, True), (True, False), (False, True)])
def test_both_ends_agree_on_shared_memory_only_when_both_want_it(sender_wants, receiver_wants):
    before = _kv_files()
    sender, receiver = _agree(sender_wants, receiver_wants)
    if sender_wants and receiver_wants:
        assert sender is not None and receiver is not None and sender.prefix == receiver.prefix
        assert sender.is_sender and not receiver.is_sender
    else:
        assert sender is None and receiver is None
    assert _kv_files() == before  # the probe is gone


def test_runs_packed_into_the_slots_are_read_by_the_receiver_and_the_files_go():
    """Three runs in two slots, then a transfer too big for them: a new file (generation 2),
    the old one removed; the receiver maps each file when a signal names it and removes it."""
    before = _kv_files()
    sender, receiver = _agree(True, True)
    for generation, (layers, blocks) in enumerate([(3, 4), (3, 40)], start=1):
        shape = (1, 2, 2, blocks, 4, 8)
        runs = [(index, index + 1) for index in range(layers)]
        outgoing = sender.outgoing(shape, runs, torch.float32)
        assert sender.generation == generation and len(_kv_files() - before) == 1
        values = [torch.randn(shape) for _ in runs]
        for index in range(2):  # the two slots hold runs 0 and 1
            outgoing[index].copy_(values[index])
        incoming = receiver.incoming(sender.signal(0), shape, runs, torch.float32)
        assert _kv_files() == before  # mapped, then removed by the receiver
        assert torch.equal(incoming[0], values[0]) and torch.equal(incoming[1], values[1])
        outgoing[2].copy_(values[2])  # run 2 in run 0's slot, once it was given back
        assert torch.equal(incoming[2], values[2]) and incoming[2].data_ptr() == incoming[0].data_ptr()
    with pytest.raises(RuntimeError, match="announced in slots of"):
        receiver.incoming(sender.signal(0), (1, 2, 2, 400, 4, 8), [(0, 1)], torch.float32)
    sender.close()
    receiver.close()
    assert _kv_files() == before


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_transfers_of_many_runs_and_growing_sizes_arrive_intact_through_shared_memory(start_sender, monkeypatch):
    """One layer a run (three runs, so a slot is reused after the receiver gives it back), and
    transfers that outgrow the slots: every block arrives, and the pair leaves no file behind."""
    import duet.kv_transfer.wire as wire

    monkeypatch.setattr(wire, "TARGET_MESSAGE_BYTES", 1)  # one layer a run, on both sides
    mapped = _count_mappings(monkeypatch)
    before = _kv_files()
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender(message_bytes=1)
    jobs = [(1, [3], [0]), (2, [0, 1, 2, 4, 5], [6, 7, 8, 9, 10]), (3, [11, 10], [1, 2]), (4, list(range(12)), list(range(11, -1, -1)))]
    try:
        results = {}
        for transfer_id, src, dst in jobs:  # one at a time: each lands in blocks the next may overwrite
            receiver.expect(transfer_id, dst)
            conn.send(("send", transfer_id, src, receiver.endpoint))
            results |= wait_results(receiver, 1)
            assert results[transfer_id] == (True, None)
            assert_arrived(receiver, src, dst)
        conn.send(("results", len(jobs)))
        assert sorted(r[:2] for r in conn.recv()) == [(j[0], True) for j in jobs]
    finally:
        receiver.close()
    start_sender.processes[0].join(30)
    assert _kv_files() == before
    assert len(mapped) == len(jobs) and mapped == sorted(mapped) and mapped[-1] > 1  # each transfer, in slots that grew


@pytest.mark.slow  # a sender in a process of its own: seconds
def test_a_sender_whose_shared_memory_is_full_sends_on_the_wire(start_sender, monkeypatch):
    """A /dev/shm with no room for the slots (a container's 64 MiB, say): every transfer goes
    over the socket instead, intact, rather than into pages that are not there."""
    import duet.kv_transfer.wire as wire

    monkeypatch.setattr(wire, "TARGET_MESSAGE_BYTES", 1)  # several runs a transfer on the wire, after the signal
    mapped = _count_mappings(monkeypatch)
    before = _kv_files()
    receiver = KVReceiver(torch.zeros(SHAPE), SPEC, timeout_s=20)
    conn = start_sender(message_bytes=1, shm_full=True)
    jobs = [(1, [3, 4], [0, 1]), (2, list(range(12)), list(range(11, -1, -1)))]
    try:
        for transfer_id, src, dst in jobs:
            receiver.expect(transfer_id, dst)
            conn.send(("send", transfer_id, src, receiver.endpoint))
            assert wait_results(receiver, 1) == {transfer_id: (True, None)}
            assert_arrived(receiver, src, dst)
        conn.send(("results", len(jobs)))
        assert sorted(r[:2] for r in conn.recv()) == [(j[0], True) for j in jobs]
    finally:
        receiver.close()
    assert mapped == [] and _kv_files() == before
