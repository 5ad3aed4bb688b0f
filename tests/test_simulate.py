"""``duet simulate`` on cases with closed-form answers: a request alone (colocated and through
PD), a saturated queue, a prompt past the token budget; and ``duet profile``'s fits recovering
known step-time models."""

from __future__ import annotations

import pytest

from duet.benchmarks.profile import fit_decode, fit_prompt, fit_transfer
from duet.benchmarks.sim_model import EMPTY_STEP_S, ClusterModel, PoolModel
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.workloads import TurnSpec, arrival_times

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}
TRANSFER = {"base_s": 0.004, "per_token_s": 1e-5}


def _pool(max_num_seqs: int = 8, budget: int = 512) -> PoolModel:
    settings = {"num_blocks": 512, "block_size": 16, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget, "max_model_len": 2048}
    return PoolModel(PROMPT, DECODE, settings)


def _prompt_s(tokens: int, context: int = 0) -> float:
    return PROMPT["base_s"] + PROMPT["per_token_s"] * tokens + PROMPT["per_token_context_s"] * tokens * (context + tokens / 2)


def _decode_s(rows: int, context: int) -> float:
    return DECODE["base_s"] + DECODE["per_row_s"] * rows + DECODE["per_row_context_s"] * context


def _cluster(prefill: list[PoolModel], decode: list[PoolModel], threshold: int = 16, transfer: dict | None = None) -> ClusterModel:
    """The router's rule alone (no adaptive choice): prompts from ``threshold`` tokens go through prefill."""
    return ClusterModel(not prefill, prefill, decode, threshold, False, 1000, 1.5, 0.2, transfer)


def _colocated(pool: PoolModel, replicas: int = 1) -> ClusterModel:
    return _cluster([], [pool] * replicas)


def _alone_s(prompt: int, output: int) -> list[float]:
    """Each token's time after sending, one request alone on a colocated replica."""
    times = [_prompt_s(prompt)]
    for index in range(1, output):
        times.append(times[-1] + _decode_s(1, prompt + index - 1))
    return times


def test_a_request_alone_gets_its_prompt_step_then_one_decode_step_a_token():
    results, duration = Simulation(_colocated(_pool())).run([[TurnSpec(list(range(100, 300)), 5)]], [3.0])
    (result,) = results
    want = _alone_s(200, 5)
    assert result.ok and result.output_tokens == 5 and result.sent_s == 3.0
    assert result.ttft == pytest.approx(want[0]) and result.e2e == pytest.approx(want[-1])
    assert result.itls == pytest.approx([b - a for a, b in zip(want, want[1:])])
    assert duration == pytest.approx(3.0 + want[-1])


def test_through_pd_the_second_token_waits_for_the_transfer_and_one_step_that_takes_the_kv_in():
    (result,), _ = Simulation(_cluster([_pool()], [_pool()], transfer=TRANSFER)).run([[TurnSpec(list(range(100, 300)), 3)]], [0.0])
    ttft = _prompt_s(200)
    second = ttft + TRANSFER["base_s"] + TRANSFER["per_token_s"] * 200 + EMPTY_STEP_S + _decode_s(1, 200)
    assert result.ttft == pytest.approx(ttft) and result.tt2t == pytest.approx(second)
    assert result.e2e == pytest.approx(second + _decode_s(1, 201))
    # A prompt under the threshold is computed on its decode replica: no transfer.
    (short,), _ = Simulation(_cluster([_pool()], [_pool()], transfer=TRANSFER)).run(
        [[TurnSpec(list(range(100, 110)), 3)]], [0.0]
    )
    assert short.e2e == pytest.approx(_alone_s(10, 3)[-1])


def test_a_saturated_queue_serves_one_request_after_another():
    """One sequence at a time (``max_num_seqs`` 1), all sent at once: the k-th ends at k times a
    request's time alone, so the throughput is its inverse."""
    alone = _alone_s(64, 4)[-1]
    sessions = [[TurnSpec([100 + i] * 64, 4)] for i in range(6)]
    results, duration = Simulation(_colocated(_pool(max_num_seqs=1))).run(sessions, arrival_times(6, 0, seed=0))
    assert sorted(result.e2e for result in results) == pytest.approx([alone * k for k in range(1, 7)])
    assert duration == pytest.approx(6 * alone)


def test_a_prompt_past_the_token_budget_is_computed_in_chunks():
    (result,), _ = Simulation(_colocated(_pool(budget=128))).run([[TurnSpec(list(range(100, 400)), 2)]], [0.0])
    assert result.ttft == pytest.approx(_prompt_s(128) + _prompt_s(128, 128) + _prompt_s(44, 256))


def test_arrivals_follow_bench_serves_poisson_schedule():
    import random

    rng = random.Random(7)
    gaps = [rng.expovariate(2.0) for _ in range(3)]
    assert arrival_times(4, 2.0, seed=7) == pytest.approx([0.0, gaps[0], gaps[0] + gaps[1], sum(gaps)])
    assert arrival_times(3, 0, seed=7) == [0.0, 0.0, 0.0]


def test_the_profiles_fits_recover_known_step_times_and_keep_every_cost_at_zero_or_above():
    prompts = [[t, c, _prompt_s(t, c)] for t in (16, 64, 256, 512) for c in (0, 256, 1024)]
    assert fit_prompt(prompts) == pytest.approx(PROMPT, rel=1e-6)
    decodes = [[b, c, _decode_s(b, b * c)] for b in (1, 4, 16, 32) for c in (64, 512)]
    assert fit_decode(decodes) == pytest.approx(DECODE, rel=1e-6)
    # Times that fall with the context would fit a negative cost: that term is dropped.
    falling = [[b, c, 0.01 + 0.003 * b - 1e-7 * b * c] for b in (1, 4, 16) for c in (64, 512)]
    fit = fit_decode(falling)
    assert fit["per_row_context_s"] == 0.0 and min(fit.values()) >= 0.0
    assert fit_transfer([[128, 0.005], [1024, 0.012]]) == pytest.approx({"base_s": 0.004, "per_token_s": 7.8125e-6})


def test_the_routers_own_balancer_sends_prompts_to_the_decode_pool_when_the_prefill_pool_falls_behind():
    """With ``adaptive_local_prefill`` the simulated router asks ``duet.router.balance``'s
    ``StageBalancer`` on the replicas' reports, in simulated time: a burst the prefill replica
    cannot take in time has some of its prompts computed on the decode replica, and every
    request still completes exactly its length."""
    burst = [[TurnSpec([100 + i] * 400, 8)] for i in range(24)]
    cluster = ClusterModel(False, [_pool()], [_pool(max_num_seqs=32)], 16, True, 1000, 1.5, 0.2, TRANSFER)
    simulation = Simulation(cluster)
    results, _ = simulation.run(burst, arrival_times(24, 20.0, seed=3))
    assert all(result.ok and result.output_tokens == 8 for result in results)
    assert simulation.balancer.decisions[True] > 0 and simulation.balancer.decisions[False] > 0
    # The threshold rule alone sends every one of them through the prefill replica.
    rule = Simulation(ClusterModel(False, [_pool()], [_pool(max_num_seqs=32)], 16, False, 1000, 1.5, 0.2, TRANSFER))
    rule.run(burst, arrival_times(24, 20.0, seed=3))
    assert rule.balancer.decisions[True] == 0


def test_predictions_compare_with_measured_runs_figure_by_figure(tmp_path):
    from duet.benchmarks.simulate import errors, matched

    def summary(config: str, ttft: float, goodput: float) -> dict:
        shape = {"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft, "mean": ttft}
        return {
            "config": config, "workload": "random@1/s", "goodput": goodput, "request_throughput": 1.0,
            "percentiles": {name: shape for name in ("ttft_ms", "tpot_ms", "e2e_ms")},
        }

    pairs = matched([summary("pd", 110, 0.9), summary("other", 1, 1)], [summary("pd", 100, 0.0)])
    ((config, workload, row),) = errors(pairs)
    assert (config, workload) == ("pd", "random@1/s")
    assert row[0] == pytest.approx(0.1) and row[5] is None  # goodput measured 0: no ratio


def test_the_cli_runs_profile_and_simulate_with_their_own_options(capsys):
    from duet.cluster.cli import main

    for command, option in (("simulate", "--profile"), ("profile", "--transfer")):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0 and option in capsys.readouterr().out


@pytest.mark.slow
def test_a_profile_of_a_real_engine_times_its_prompt_and_decode_steps(tiny_llama_dir, tmp_path):
    """``duet profile`` on a config of the tiny Llama: each pool's prompt steps (a chunk after a
    context the prefix cache holds) and decode steps (a batch of sequences) are timed, alone and
    beside a busy neighbouring engine (another process), the fits cost nothing below zero, and
    ``duet simulate`` runs on the profile it wrote."""
    import json

    import yaml

    from duet.benchmarks.profile import main as profile
    from duet.benchmarks.simulate import main as simulate

    engine = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 256, "num_kv_blocks": 256}
    args = {"model": str(tiny_llama_dir), "mode": "pd", "engine": engine, "decode": {"local_prefill_threshold": 16}}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "tiny", "import_path": "duet.cluster.app:build_app", "args": args}]}))
    profile(["--quick", "--neighbours", "1", "--out", str(tmp_path / "profile.json"), str(config)])
    written = json.loads((tmp_path / "profile.json").read_text())
    assert set(written["pools"]) == {"prefill", "decode"} and written["machine"]["cores"] >= 1
    for pool in written["pools"].values():
        assert pool["settings"]["max_num_batched_tokens"] == 256 and pool["settings"]["num_blocks"] == 256
        assert {sample[0] for sample in pool["prompt"]["samples"]} == {32, 128}
        assert {sample[1] for sample in pool["prompt"]["samples"]} == {0, 512}
        assert {sample[0] for sample in pool["decode"]["samples"]} == {1, 8}
        assert all(seconds > 0 for *_, seconds in pool["prompt"]["samples"] + pool["decode"]["samples"])
        assert min(pool["prompt"]["fit"].values()) >= 0 and min(pool["decode"]["fit"].values()) >= 0
        shared = pool["neighbours"]
        assert shared["neighbours"] == 1 and shared["prompt_slowdown"] >= 1.0 and shared["decode_slowdown"] >= 1.0
        assert pool["speculation"] is None  # neither pool drafts
    simulate(["--profile", str(tmp_path / "profile.json"), "--config", str(config), "--rate", "4", "--num-requests", "6",
              "--input-len", "64", "--output-len", "4", "--workloads", "random", "--json", str(tmp_path / "sim.json")])
    (summary,) = json.loads((tmp_path / "sim.json").read_text())
    assert summary["num_requests"] == 6 and summary["failed"] == 0


def test_a_step_beside_busy_neighbours_takes_the_profiles_slowdown_in_proportion():
    shared = {"neighbours": 2, "prompt_slowdown": 1.5, "decode_slowdown": 2.0}
    pool = PoolModel(PROMPT, DECODE, _pool().settings, shared)
    assert pool.step_seconds(0, 0, 4, 400, busy_neighbours=0) == pytest.approx(_decode_s(4, 400))
    assert pool.step_seconds(0, 0, 4, 400, busy_neighbours=1) == pytest.approx(1.5 * _decode_s(4, 400))
    assert pool.step_seconds(0, 0, 4, 400, busy_neighbours=5) == pytest.approx(2.0 * _decode_s(4, 400))
    assert pool.step_seconds(128, 128 * 64, 0, 0, busy_neighbours=2) == pytest.approx(1.5 * _prompt_s(128))
    mixed = 2.0 * DECODE["base_s"] + 1.5 * (_prompt_s(128) - PROMPT["base_s"]) + 2.0 * (_decode_s(4, 400) - DECODE["base_s"])
    assert pool.step_seconds(128, 128 * 64, 4, 400, busy_neighbours=2) == pytest.approx(mixed)


def test_a_context_no_decode_replica_can_take_gets_a_503_after_the_wait_and_its_session_ends():
    """A prompt whose KV fits no decode replica waits ``ROOM_WAIT_S`` in the router, then fails; its
    session's later turn is never sent, a request after it is served, and the run ends with the 503
    (as ``duet bench serve``'s does, with the last answer)."""
    from duet.router.waiting import ROOM_WAIT_S

    small = _pool()
    small.settings = small.settings | {"num_blocks": 8}  # 128 tokens of KV
    sessions = [[TurnSpec(list(range(100, 400)), 4), TurnSpec(list(range(100, 120)), 4)], [TurnSpec(list(range(500, 540)), 4)]]
    results, duration = Simulation(_cluster([_pool()], [small])).run(sessions, [0.0, 1.0])
    assert [(result.ok, result.turn) for result in results] == [(False, 0), (True, 0)]
    assert results[1].sent_s + results[1].e2e < ROOM_WAIT_S <= duration < ROOM_WAIT_S + 1  # the run ends with the 503


def test_contexts_that_fail_together_free_their_places_for_those_admitted_after_them():
    """Two prompts that fit no decode replica reach their wait's end in the same round of the
    waiting room, beside a third one that fits, with a fourth request held at admission
    (``max_running``: 3): each 503 admits another request in the middle of that round, whose
    list must stay whole. Both fail, and the requests that fit are served."""
    from duet.router.waiting import ROOM_WAIT_S

    small = _pool()
    small.settings = small.settings | {"num_blocks": 8}  # 128 tokens of KV
    cluster = _cluster([_pool()], [small])
    cluster.max_running = 3
    too_long = [TurnSpec(list(range(100, 400)), 4)]
    sessions = [too_long, too_long, [TurnSpec(list(range(500, 540)), 4)], [TurnSpec(list(range(600, 640)), 4)]]
    results, duration = Simulation(cluster).run(sessions, [0.0, 0.0, 0.0, 0.1])
    assert [result.ok for result in results] == [False, False, True, True]
    assert ROOM_WAIT_S <= duration < ROOM_WAIT_S + 1
