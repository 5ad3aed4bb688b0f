"""``duet simulate``'s roles that move (``benchmarks/sim_roles.py``): the router's own ``plan``
lends a spare decode replica to a prompt backlog once its hold is over, calls of the role reach
it as the router routes them, every request keeps its length, and without ``roles.move`` nothing
moves."""

from __future__ import annotations

import pytest

from duet.benchmarks.sim_model import ClusterModel, PoolModel
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.workloads import TurnSpec
from duet.router.roles import RoleSettings

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}
SETTINGS = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}


def _pd(move: bool, hold_s: float = 2.0) -> ClusterModel:
    """One prefill and two decode replicas; the router's threshold rule alone (every prompt of 16
    tokens or more through the replicas serving prefill)."""
    pool = PoolModel(PROMPT, DECODE, SETTINGS)
    roles = RoleSettings(move=move, lend_idle=False, min_prefill=0, min_decode=1, hold_s=hold_s)
    return ClusterModel(False, [pool], [pool, pool], 16, False, 1000, 1.5, 0.2, None, roles=roles)


def _burst() -> tuple[list[list[TurnSpec]], list[float]]:
    """400-token prompts every 0.4 s for 40 s: more than one replica computes (about 0.48 s each)."""
    return [[TurnSpec([100 + i] * 400, 4)] for i in range(100)], [0.4 * i for i in range(100)]


def test_a_spare_decode_replica_takes_the_prefill_role_after_its_hold_and_computes_prompts():
    sessions, arrivals = _burst()
    simulation = Simulation(_pd(move=True, hold_s=8.0))
    results, _ = simulation.run(sessions, arrivals)
    assert all(result.ok and result.output_tokens == 4 for result in results)
    (at, name, role, reason), *_ = simulation.roles.changes
    assert name.startswith("decode-") and role == "prefill" and reason == "prefill_prompt_backlog"
    assert 8.0 <= at < 8.0 + 0.5 + 1e-9  # its hold from its start, then the keeper's next round
    lent = next(replica for replica in simulation.decode if replica.name == name)
    assert lent.home == "decode" and lent.prompts_sent > 10  # it computed prompts for the replicas serving decode
    assert simulation.prefill[0].prompts_sent + lent.prompts_sent == 100
    # Without moves the prompts queue on the one prefill replica.
    fixed = Simulation(_pd(move=False))
    fixed_results, _ = fixed.run(sessions, arrivals)
    assert fixed.roles.changes == [] and all(result.ok for result in fixed_results)
    assert fixed.prefill[0].prompts_sent == 100
    assert max(result.ttft for result in results) < 0.5 * max(result.ttft for result in fixed_results)


def test_the_lent_replica_goes_home_when_its_role_is_spare_again():
    sessions, arrivals = _burst()
    simulation = Simulation(_pd(move=True))
    simulation.run(sessions, arrivals, until=80.0)
    (_, lent, _, _), (at, back, role, reason) = simulation.roles.changes
    assert (back, role, reason) == (lent, "decode", "home") and at > arrivals[-1]
    assert {replica.stage for replica in simulation.decode} == {"decode"}


@pytest.mark.parametrize("move", [True, False])
def test_the_autoscaler_sees_a_lent_replica_as_away(move):
    from duet.benchmarks.sim_scale import PoolScaling
    from duet.cluster.autoscale import Targets

    cluster = _pd(move)
    cluster.scaling = {"decode": PoolScaling(2, 2, 2, 1.0, 4.0, 0.5, 1.0, Targets(100.0, 100.0))}
    simulation = Simulation(cluster)
    sessions, arrivals = _burst()
    simulation.run(sessions, arrivals)
    away = {name: max(metrics["away"] for _, metrics in records) for name, records in simulation.autoscaling._records.items()}
    assert sorted(away.values()) == ([0.0, 1.0] if move else [0.0, 0.0])
