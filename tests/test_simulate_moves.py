"""``duet simulate``'s sequences that move (``benchmarks/sim_moves.py``): a decode replica leaving
its pool moves what it decodes by KV and each stream keeps its length and its tokens' times in
order; a colocated replica's go by recompute; the role keeper sheds a lent replica's
decoding sequences to the decode pool."""

from __future__ import annotations

from duet.benchmarks.sim_model import ClusterModel, PoolModel
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.workloads import TurnSpec
from duet.router.roles import RoleSettings

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}
TRANSFER = {"base_s": 0.004, "per_token_s": 1e-5}
SETTINGS = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}


def _pool() -> PoolModel:
    return PoolModel(PROMPT, DECODE, SETTINGS)


def _streams(count: int = 6, output: int = 300) -> tuple[list[list[TurnSpec]], list[float]]:
    return [[TurnSpec([100 + i] * 64, output)] for i in range(count)], [0.0] * count


def _retire_at(simulation: Simulation, when: float, name: str) -> None:
    simulation.at(when, lambda: simulation.retire(next(replica for replica in simulation.decode if replica.name == name)))


def test_a_leaving_decode_replica_moves_its_sequences_by_kv_and_each_keeps_its_length():
    cluster = ClusterModel(False, [_pool()], [_pool(), _pool()], 16, False, 1000, 1.5, 0.2, TRANSFER)
    simulation = Simulation(cluster)
    sessions, arrivals = _streams()
    _retire_at(simulation, 1.0, "decode-0")
    results, _ = simulation.run(sessions, arrivals)
    assert all(result.ok and result.output_tokens == 300 for result in results)
    assert all(min(result.itls) >= 0 for result in results)
    assert simulation.moves.counts == {"leave_kv": 3, "leave_recompute": 0, "shed": 0}  # half of the six were there
    (left,) = simulation.draining
    assert left.scheduler.requests == {} and not left.scheduler.has_unfinished_requests()
    assert left.scheduler.kv_cache_manager.block_pool.num_free_blocks == SETTINGS["num_blocks"]  # every block back


def test_a_leaving_colocated_replica_has_its_sequences_recomputed_elsewhere():
    cluster = ClusterModel(True, [], [_pool(), _pool()], 16, False, 1000, 1.5, 0.2, None)
    simulation = Simulation(cluster)
    sessions, arrivals = _streams()
    _retire_at(simulation, 1.0, "colocated-0")
    results, _ = simulation.run(sessions, arrivals)
    assert all(result.ok and result.output_tokens == 300 for result in results)
    assert simulation.moves.counts == {"leave_kv": 0, "leave_recompute": 3, "shed": 0}
    assert simulation.draining[0].scheduler.requests == {}


def test_the_role_keeper_sheds_sequences_to_a_prefill_replica_that_took_the_decode_role():
    """Twelve long streams on the one decode replica (eight at a time): its TPOT passes the target
    and sequences wait, the idle prefill replica takes the decode role after its hold, and the
    keeper moves half the difference in running sequences to it (``shed_plan``), each once."""
    roles = RoleSettings(move=True, lend_idle=False, min_prefill=0, min_decode=1, hold_s=2.0)
    cluster = ClusterModel(False, [_pool()], [_pool()], 16, False, 1000, 1.5, 0.02, TRANSFER, roles=roles)
    simulation = Simulation(cluster)
    sessions, arrivals = _streams(12, 400)
    results, end = simulation.run(sessions, arrivals)
    assert all(result.ok and result.output_tokens == 400 for result in results)
    (at, name, role, reason), *_ = simulation.roles.changes
    assert (name, role) == ("prefill-0", "decode") and reason.startswith("decode_") and at >= 2.0
    assert 1 <= simulation.moves.counts["shed"] <= 6 and simulation.moves.counts["leave_kv"] == 0
    fixed = Simulation(ClusterModel(False, [_pool()], [_pool()], 16, False, 1000, 1.5, 0.02, TRANSFER))
    _, fixed_end = fixed.run(sessions, arrivals)
    assert end < fixed_end  # the prefill replica's steps decoded some of them


def test_a_replica_sheds_once_per_hold_and_a_sequence_moves_so_once_at_most():
    cluster = ClusterModel(False, [_pool()], [_pool(), _pool()], 16, False, 1000, 1.5, 0.2, TRANSFER)
    simulation = Simulation(cluster)
    first, second = simulation.decode

    def shed(busiest, least, count: int) -> None:
        simulation.moves.shed(busiest, least, count, 5.0)

    simulation.at(1.0, shed, first, second, 1)
    simulation.at(1.5, shed, first, second, 1)  # within the hold: nothing
    simulation.at(7.0, shed, second, first, 10)  # its own three, not the one that came from the first
    results, _ = simulation.run(*_streams(6, 600))
    assert all(result.ok and result.output_tokens == 600 for result in results)
    assert simulation.moves.counts["shed"] == 1 + 3


def test_a_leaving_replica_with_no_other_serving_decode_keeps_its_sequences():
    """The only replica serving decode leaves: nothing can take its sequences, so they finish
    there, each computed once (none recomputed in place)."""
    cluster = ClusterModel(False, [_pool()], [_pool()], 16, False, 1000, 1.5, 0.2, TRANSFER)
    simulation = Simulation(cluster)
    _retire_at(simulation, 1.0, "decode-0")
    results, _ = simulation.run(*_streams(3, 200))
    assert all(result.ok and result.output_tokens == 200 for result in results)
    assert simulation.moves.counts == {"leave_kv": 0, "leave_recompute": 0, "shed": 0}
