"""Tensor-parallel collectives between real processes: through shared memory and through gloo
they give the same sums (the same bits on every rank) and the same gathers."""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import pytest
import torch

from duet.distributed import SharedMemoryExchange, TensorParallelGroup, connect_store, host_store

WORLD_SIZE = 3
ROWS = (1, 32, 1, 7, 3)


def _rank_main(rank: int, port: int, same_machine: bool, results, ordered_sums: bool = False) -> None:
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    group = TensorParallelGroup(store, rank, WORLD_SIZE, False, "127.0.0.1", 30, same_machine, ordered_sums=ordered_sums)
    generator = torch.Generator().manual_seed(rank)
    out = {"backend": group.backend}
    # More calls than the two alternating slot sets, with shapes that change between calls.
    out["sums"] = [group.all_reduce(torch.randn(rows, 576, generator=generator)) for rows in ROWS]
    out["bf16"] = group.all_reduce(torch.randn(4, 64, generator=generator).bfloat16())
    large = torch.full((SharedMemoryExchange.SLOT_BYTES // 4 + 1,), float(rank + 1))  # past a slot: gloo
    out["large"] = group.all_reduce(large)[:3]
    out["gathered"] = [part.clone() for part in group.all_gather(torch.arange(5.0) + 10 * rank)]
    # Pickled here, by value: a tensor put on the queue as it is travels as a shared-memory
    # handle, which the parent cannot open once this process has exited.
    results.put((rank, pickle.dumps(out)))


def _run(same_machine: bool, ordered_sums: bool = False) -> dict[int, dict]:
    store = host_store("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rank, store.port, same_machine, results, ordered_sums)) for rank in range(WORLD_SIZE)]
    for process in processes:
        process.start()
    gathered = {rank: pickle.loads(out) for rank, out in (results.get(timeout=120) for _ in processes)}
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    return gathered


@pytest.mark.slow  # processes and a gloo group: seconds
def test_shared_memory_and_gloo_collectives_agree_bit_for_bit():
    before = set(Path("/dev/shm").glob("duet-tp-*"))
    shared, gloo = _run(same_machine=True), _run(same_machine=False)
    assert set(Path("/dev/shm").glob("duet-tp-*")) == before  # the segment's name went once all had mapped it
    assert shared[0]["backend"] == "shared memory, gloo beyond it" and gloo[0]["backend"] == "gloo"
    generators = [torch.Generator().manual_seed(rank) for rank in range(WORLD_SIZE)]
    draws = [[torch.randn(rows, 576, generator=generator) for rows in ROWS] for generator in generators]
    expected = [sum(parts) for parts in zip(*draws)]
    for run in (shared, gloo):
        for rank in range(WORLD_SIZE):
            assert all(torch.allclose(got, want, atol=1e-5) for got, want in zip(run[rank]["sums"], expected))
            for key in ("sums", "bf16", "large"):
                values = run[rank][key] if key == "sums" else [run[rank][key]]
                references = run[0][key] if key == "sums" else [run[0][key]]
                assert all(torch.equal(a, b) for a, b in zip(values, references)), f"{key}: rank {rank} differs from rank 0"
            assert torch.equal(run[rank]["large"], torch.full((3,), 6.0))
            assert [part.tolist() for part in run[rank]["gathered"]] == [[10.0 * r + i for i in range(5)] for r in range(WORLD_SIZE)]


@pytest.mark.slow  # processes and a gloo group: seconds
def test_ordered_sums_add_the_ranks_parts_in_rank_order_over_gloo():
    """``batch_invariant``'s sums over gloo (past two ranks a ring adds in an order that depends
    on the tensor's size): rank 0's part, plus rank 1's, plus rank 2's, bit for bit, on every rank."""
    ordered = _run(same_machine=False, ordered_sums=True)
    generators = [torch.Generator().manual_seed(rank) for rank in range(WORLD_SIZE)]
    draws = [[torch.randn(rows, 576, generator=generator) for rows in ROWS] for generator in generators]
    for rank in range(WORLD_SIZE):
        for got, parts in zip(ordered[rank]["sums"], zip(*draws)):
            expected = parts[0].clone()
            for part in parts[1:]:
                expected.add_(part)
            assert torch.equal(got, expected)
        assert torch.equal(ordered[rank]["large"], torch.full((3,), 6.0))
