"""The sender in a process of its own that the transfer tests drive (``sender_process``)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from duet.kv_transfer.spec import KVSpec
from tests.kv_transfer.sender_process import SHAPE, SPEC, sender_process


@pytest.fixture
def start_sender():
    processes = []

    def start(
        spec: KVSpec = SPEC, shape=SHAPE, crash: bool = False, message_bytes: int | None = None, faults: str | None = None,
        dtype: str = "float32", layers: tuple[int, int] | None = None, cancel_at_start: bool = False, shared_memory: bool = True,
        shm_full: bool = False,
    ):
        parent, child = mp.get_context("spawn").Pipe()
        args = (child, spec.to_dict(), shape, crash, message_bytes, faults, dtype, layers, cancel_at_start, shared_memory, shm_full)
        process = mp.get_context("spawn").Process(target=sender_process, args=args)
        process.start()
        processes.append(process)
        return parent

    start.processes = processes  # for a test that kills one
    yield start
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.kill()
