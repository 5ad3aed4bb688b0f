"""``duet simulate``'s autoscaling (``benchmarks/sim_scale.py``): Serve's hold on a change as Ray
applies it, a pool growing under load with its new replica serving after its start time and
shrinking when the load is gone, a replica stopped before it served, a config's scaling read, and
``duet bench autoscale``'s phases simulated from its own schedule."""

from __future__ import annotations

import random

import pytest

from duet.benchmarks.sim_model import ClusterModel, PoolModel
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.sim_scale import Hold, PoolScaling, serve_delayed
from duet.benchmarks.workloads import TurnSpec
from duet.cluster.autoscale import Targets

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}
SETTINGS = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 512, "max_model_len": 2048}
# Only the decoding sequences' KV moves the pool: more than a few sequences' worth asks for a replica more.
LAX = Targets(ttft_s=100.0, tpot_s=100.0, kv_usage=0.05, cooldown_s=0.0)


def _scaling(upscale_s: float = 1.0, downscale_s: float = 4.0, targets: Targets = LAX) -> PoolScaling:
    return PoolScaling(1, 2, 1, upscale_s, downscale_s, 0.5, 1.0, targets)


def _colocated(scaling: PoolScaling | None) -> ClusterModel:
    pool = PoolModel(PROMPT, DECODE, SETTINGS)
    return ClusterModel(True, [], [pool], 16, False, 1000, 1.5, 0.2, None, scaling={"colocated": scaling} if scaling else {})


def _burst(count: int = 16) -> tuple[list[list[TurnSpec]], list[float]]:
    """A request every half second (the router places each as it comes: a replica that joins takes the later ones)."""
    return [[TurnSpec([100 + i] * 64, 200)] for i in range(count)], [0.5 * i for i in range(count)]


def test_serve_holds_a_change_as_rays_own_delay_logic_does():
    """The same wishes of the policy, tick by tick, give the same targets as Ray's
    ``_apply_delay_logic`` (if Ray's rule moves, this fails and the simulation must follow)."""
    from ray.serve.autoscaling_policy import _apply_delay_logic
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=6, upscale_delay_s=2.0, downscale_delay_s=5.0)
    scaling = PoolScaling(1, 6, 1, 2.0, 5.0, 1.0, 3.0, Targets())
    rng = random.Random(0)
    target, desired, hold, state, moves = 2, 2, Hold(), {}, set()
    for step in range(3000):
        now = 1000.0 + step * 0.1
        if rng.random() < 0.03:
            desired = rng.randint(1, 5)
        theirs, state = _apply_delay_logic(desired, target, config, state, _now=now)
        assert serve_delayed(desired, target, scaling, hold, now) == theirs, step
        moves.add((theirs > target) - (theirs < target))
        target = theirs
    assert moves == {-1, 0, 1}  # both delays were run through


def test_a_pool_grows_under_load_and_its_replica_serves_after_its_start_time_then_shrinks_when_idle():
    sessions, arrivals = _burst()
    alone, alone_end = Simulation(_colocated(None)).run(sessions, arrivals)
    simulation = Simulation(_colocated(_scaling()), start_s=3.0)
    results, end = simulation.run(sessions, arrivals, until=60.0)
    assert all(result.ok and result.output_tokens == 200 for result in results)
    scaling = simulation.autoscaling
    (up_at, stage, before, after, reason), (down_at, _, *down) = scaling.changes
    assert (stage, before, after, reason) == ("colocated", 1, 2, "kv_usage")
    assert up_at >= 0.5 + 1.0  # the replica's first push, then Serve's upscale delay
    assert scaling.served == {"colocated-1": pytest.approx(up_at + 3.0)}
    assert end < alone_end  # the second replica took sequences
    assert down == [2, 1, "low_load"] and down_at >= end + 4.0 - 1.0  # idle for the downscale delay (the look-back lags 1 s)
    assert len(simulation.decode) == 1 and simulation.draining[0].name == "colocated-1"
    running = [sample.running["decode"] for sample in scaling.samples]
    assert running[0] == 1 and max(running) == 2 and running[-1] == 1
    assert scaling.samples[-1].at >= 60.0 - 0.5


def test_a_replica_starting_beside_a_busy_engine_shares_its_core_and_slows_its_steps():
    """One core (``cores``: 1): while the engine steps, the starting replica gets half of it, so its
    start takes about twice ``start_s``; the engine's steps meanwhile take twice as long too."""
    sessions, arrivals = _burst(40)
    cluster = _colocated(_scaling())
    cluster.cores = 1
    simulation = Simulation(cluster, start_s=3.0)
    simulation.run(sessions, arrivals, until=30.0)
    (up_at, *_), *_ = simulation.autoscaling.changes
    took = simulation.autoscaling.served["colocated-1"] - up_at
    assert 2 * 3.0 * 0.9 <= took <= 2 * 3.0 + 0.2  # the engine idles between steps now and then
    # A start that never ends (the pool's replica-to-be computing throughout) against none.
    alone = _colocated(None)
    alone.cores = 1
    _, alone_end = Simulation(alone).run(sessions, arrivals)
    _, slowed_end = Simulation(cluster, start_s=1e6).run(sessions, arrivals)
    assert slowed_end > 1.5 * alone_end


def test_the_policy_sees_each_replicas_mean_over_the_look_back_of_what_it_pushed():
    """A replica records every 0.2 s from 10 s; it pushes every 0.5 s from then (``metrics_interval_s``),
    and the policy averages what was pushed over the last second (``look_back_period_s``)."""
    simulation = Simulation(_colocated(_scaling()))
    scaling, replica = simulation.autoscaling, simulation.decode[0]
    pool = scaling.pools["colocated"]
    scaling._born[replica.name] = 10.0
    scaling._records[replica.name] = [(10.0 + 0.2 * i, {"num_running": float(i)}) for i in range(11)]
    simulation.now = 10.4
    assert scaling._pushed(pool, replica) == {}  # not pushed yet: running, not reporting
    simulation.now = 11.7  # pushed at 11.5: the records from 10.7 to 11.5
    assert scaling._pushed(pool, replica) == {"num_running": pytest.approx((4 + 5 + 6 + 7) / 4)}


def test_a_replica_stopped_before_it_started_never_serves():
    """A start longer than the policy's grace for starting replicas (``START_GRACE_S``): the load is
    gone by then, the pool shrinks, and the replica it was starting is the one stopped."""
    from duet.cluster.autoscale import START_GRACE_S

    sessions, arrivals = _burst()
    simulation = Simulation(_colocated(_scaling()), start_s=START_GRACE_S + 40.0)
    results, _ = simulation.run(sessions, arrivals, until=START_GRACE_S + 30.0)
    assert all(result.ok for result in results)
    assert [change[2:4] for change in simulation.autoscaling.changes] == [(1, 2), (2, 1)]
    assert simulation.autoscaling.changes[1][0] >= START_GRACE_S
    assert simulation.autoscaling.served == {} and simulation.draining == []
    assert {sample.running["decode"] for sample in simulation.autoscaling.samples} == {1}


def _profile() -> dict:
    pool = {"prompt": {"fit": PROMPT}, "decode": {"fit": DECODE}, "settings": SETTINGS | {"max_num_seqs": 32}}
    return {"machine": {"cores": 0, "cpu": "test"}, "pools": {"prefill": pool, "decode": pool}}


def test_a_configs_autoscaled_pools_are_read_with_serves_timings_and_duets_targets():
    from duet.benchmarks.sim_model import cluster_model

    cluster = cluster_model("configs/autoscale.yaml", _profile())
    assert cluster.scaling == {
        "prefill": PoolScaling(1, 2, 1, 2.0, 10.0, 1.0, 3.0, Targets(2.0, 0.2, prompt_tokens_per_replica=1024, cooldown_s=5.0)),
        "decode": PoolScaling(1, 2, 1, 2.0, 10.0, 1.0, 3.0, Targets(2.0, 0.2, kv_usage=0.5, cooldown_s=5.0)),
    }
    assert cluster.scaling["prefill"].record_s == pytest.approx(0.6)
    assert cluster_model("configs/local-pd.yaml", _profile()).scaling == {}


def test_bench_autoscales_phases_are_simulated_from_its_own_schedule_and_compared_phase_by_phase():
    from duet.benchmarks.autoscale import parse_phases, poisson_arrivals
    from duet.benchmarks.sim_phases import format_errors, pairs, simulate_phases

    phases = "quiet:5:0:0:0,busy:20:2:256:8,idle:30:0:0:0"
    sent, samples, bounds, _ = simulate_phases("configs/autoscale.yaml", _profile(), phases, 5, 3.0)
    rng = random.Random(5)
    schedule = [poisson_arrivals(phase, rng) for phase in parse_phases(phases)][1]
    assert [item.start for item in sent] == pytest.approx([5.0 + offset for offset, _ in schedule])
    assert [len(item.result.itls) + 1 for item in sent] == [8] * len(schedule)
    assert {item.phase for item in sent} == {"busy"}
    assert bounds == {"quiet": (0.0, 5.0), "busy": (5.0, 25.0), "idle": (25.0, 55.0)}
    assert samples[-1].at >= 55.0 - 0.5 and set(samples[0].running) == {"prefill", "decode"}
    predicted = {"autoscale": {"config": "configs/autoscale.yaml", "phases": {"busy": {"slo_attainment": 0.9, "replica_seconds": 44.0, "ttft_p90_ms": 300.0,
                                                   "tpot_p90_ms": 0.0, "failed": 1}}}}
    measured = {"phases": {"busy": {"slo_attainment": 0.95, "replica_seconds": 40.0, "ttft_p90_ms": 200.0, "tpot_p90_ms": 0.0,
                                    "failed": 0}}}
    row = format_errors(predicted, measured).splitlines()[-1].split()
    assert row[0] == "busy"
    assert row[1:] == ["90", "/", "95", "(-5)", "44", "/", "40", "(+10%)", "300", "/", "200", "(+50%)", "0", "/", "0", "(-)",
                       "1", "/", "0", "(+1)"]
    # A --planned run's JSON: each predicted run beside the measured run of its own config.
    both = {"reactive": measured | {"config": "configs/autoscale.yaml"}, "planned": measured | {"config": "/tmp/autoscale-planned.yaml"}}
    predicted["autoscale-planned"] = predicted["autoscale"] | {"config": "/elsewhere/autoscale-planned.yaml"}
    assert [(label, name) for label, _, name, _ in pairs(predicted, both)] == [("autoscale", "reactive"), ("autoscale-planned", "planned")]


def test_the_replicas_over_time_are_plotted_predicted_against_measured(tmp_path, capsys):
    from duet.benchmarks.sim_phases import pairs, plot_replicas

    def run(config: str, steps: list[tuple[float, int]]) -> dict:
        samples = [{"at": at, "running": {"prefill": 1, "decode": decode}, "target": {}} for at, decode in steps]
        return {"config": config, "phases": {}, "samples": samples}

    predicted = {"autoscale": run("configs/autoscale.yaml", [(0.0, 1), (20.0, 2), (40.0, 2)])}
    measured = run("configs/autoscale.yaml", [(0.0, 1), (25.0, 2), (40.0, 2)])
    plot_replicas(pairs(predicted, measured), str(tmp_path / "replicas.png"))
    assert (tmp_path / "replicas.png").stat().st_size > 10_000 and "replicas written" in capsys.readouterr().out
