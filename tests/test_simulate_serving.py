"""The serving path in ``duet simulate`` and ``duet profile --serving``: the engines' steps
stretched by closed-form amounts when the serving path leaves them too few cores, its latency
added before admission, and the profile's figures recovered from known CPU readings."""

from __future__ import annotations

import os

import pytest

from duet.benchmarks.profile_serving import LONG_PROMPT, SHORT_PROMPT, fit, reading, served_engine, serving_seconds
from duet.benchmarks.sim_model import MIN_ENGINE_SHARE, ClusterModel, PoolModel, cpu_stretch
from duet.benchmarks.sim_run import SERVING_WINDOW_S, Simulation
from duet.benchmarks.workloads import TurnSpec

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}


def _colocated(cores: int, serving: dict | None) -> ClusterModel:
    settings = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    pool = PoolModel(PROMPT, DECODE, settings)
    return ClusterModel(True, [], [pool], 16, False, 1000, 1.5, 0.2, None, cores=cores, serving=serving)


def _prompt_s(tokens: int) -> float:
    return PROMPT["base_s"] + PROMPT["per_token_s"] * tokens + PROMPT["per_token_context_s"] * tokens * tokens / 2


def _decode_s(context: int) -> float:
    return DECODE["base_s"] + DECODE["per_row_s"] + DECODE["per_row_context_s"] * context


def _serving(base: float = 0.0, request: float = 0.0, token: float = 0.0, prompt_token: float = 0.0, latency: float = 0.0) -> dict:
    return {"base_cores": base, "per_request_s": request, "per_prompt_token_s": prompt_token, "per_token_s": token, "latency_s": latency}


def test_the_engines_share_what_the_serving_path_leaves_of_the_cores():
    assert cpu_stretch(2, 0.0, 2) == 1.0  # two engines on two free cores
    assert cpu_stretch(2, 0.5, 2) == pytest.approx(2 / 1.5)
    assert cpu_stretch(1, 0.5, 2) == 1.0  # one engine fits in what is left
    assert cpu_stretch(1, 0.5, 1) == pytest.approx(2.0)
    assert cpu_stretch(2, 5.0, 2) == pytest.approx(2 / (MIN_ENGINE_SHARE * 2))  # the engines keep their floor
    assert cpu_stretch(3, 1.0, 0) == 1.0  # no machine given: nothing modelled
    assert cpu_stretch(0, 1.0, 2) == 1.0


def test_a_serving_path_that_takes_half_the_only_core_doubles_every_step():
    prompt = list(range(100, 300))
    plain, _ = Simulation(_colocated(1, None)).run([[TurnSpec(prompt, 4)]], [0.0])
    halved, _ = Simulation(_colocated(1, _serving(base=0.5))).run([[TurnSpec(prompt, 4)]], [0.0])
    assert plain[0].ttft == pytest.approx(_prompt_s(200))
    assert halved[0].ttft == pytest.approx(2 * plain[0].ttft) and halved[0].e2e == pytest.approx(2 * plain[0].e2e)
    on_two_cores, _ = Simulation(_colocated(2, _serving(base=0.5))).run([[TurnSpec(prompt, 4)]], [0.0])
    assert on_two_cores[0].e2e == pytest.approx(plain[0].e2e)  # the engine's one thread fits in the 1.5 cores left


def test_each_streamed_token_adds_its_cpu_for_the_window_and_the_steps_after_it_wait_longer():
    """0.25 CPU-seconds a token on one core: after k tokens within the window, the serving path
    uses 0.25 k cores and a step takes 1 / max(1 - 0.25 k, MIN_ENGINE_SHARE) times as long."""
    (result,), _ = Simulation(_colocated(1, _serving(token=0.25))).run([[TurnSpec(list(range(100, 300)), 5)]], [0.0])
    times = [_prompt_s(200)]  # the first step starts before any token
    for k in range(1, 5):
        times.append(times[-1] + _decode_s(200 + k - 1) / max(1 - 0.25 * k, MIN_ENGINE_SHARE))
    assert times[-1] < SERVING_WINDOW_S  # every token still counts
    assert result.ttft == pytest.approx(times[0]) and result.e2e == pytest.approx(times[-1])
    assert result.itls == pytest.approx([b - a for a, b in zip(times, times[1:])])


def test_a_requests_cpu_counts_its_prompt_and_leaves_the_window_after_it():
    """A request's 0.1 CPU-seconds and 0.002 a prompt token on one core: the step that starts
    with a 200-token prompt takes 1 / (1 - 0.5) times as long, a 100-token one 1 / (1 - 0.3); a
    request arriving after the window has left finds none of the first one's CPU in it."""
    sessions = [[TurnSpec(list(range(100, 300)), 1)], [TurnSpec(list(range(1000, 1100)), 1)]]
    results, _ = Simulation(_colocated(1, _serving(request=0.1, prompt_token=0.002))).run(sessions, [0.0, 5.0])
    assert results[0].ttft == pytest.approx(_prompt_s(200) / 0.5)
    assert results[1].ttft == pytest.approx(_prompt_s(100) / 0.7)


def test_the_profiles_figures_come_back_from_its_windows():
    base, request, prompt_token, token = 0.12, 0.009, 0.00004, 0.0016
    loads = [(seconds, 0.0, 25, prompt, tokens) for seconds, prompt, tokens in ((3.0, 776, 28), (9.0, 6152, 28), (12.0, 776, 1540))]
    loads = [(s, base * s + request * n + prompt_token * p + token * k, n, p, k) for s, _, n, p, k in loads]
    figures = fit((5.0, base * 5.0), loads)
    want = {"base_cores": base, "per_request_s": request, "per_prompt_token_s": prompt_token, "per_token_s": token}
    assert figures == pytest.approx(want)
    # a window that spent less than the base (noise) leaves every figure at zero or above
    figures = fit((5.0, 1.0), [(s, 0.0, n, p, k) for s, _, n, p, k in loads])
    assert figures["base_cores"] == 0.2 and all(value >= 0.0 for value in figures.values())


def test_the_serving_path_is_every_process_but_the_client_less_each_replicas_engine_threads():
    before = {
        1: ("ray::ServeReplica:duet:prefill", 11.0, {10: 10.0, 11: 1.0, 12: 0.0}),
        2: ("ray::ServeReplica:duet:colocated.handle_request", 20.0, {20: 10.0, 21: 10.0, 22: 0.0}),
        3: ("ray::ServeReplica:duet:router", 5.0, {30: 5.0}),
        4: ("the benchmark client", 1.0, {}),
    }
    after = {
        1: ("ray::ServeReplica:duet:prefill", 16.7, {10: 15.0, 11: 1.5, 12: 0.2}),  # engine +5.0, the rest +0.7
        2: ("ray::ServeReplica:duet:colocated.handle_request", 26.3, {20: 13.0, 21: 13.0, 22: 0.3}),  # two engine threads
        3: ("ray::ServeReplica:duet:router", 6.5, {30: 6.5}),  # not an engine pool: all of it
        4: ("the benchmark client", 9.0, {}),
        5: ("/usr/bin/raylet", 0.4, {}),  # new since the first reading
    }
    spent = serving_seconds(before, after, {"prefill": 1, "colocated": 2}, exclude={4})
    assert spent == pytest.approx(0.7 + 0.3 + 1.5 + 0.4)


def test_a_reading_holds_this_process_and_its_cpu():
    sum(i * i for i in range(200_000))
    title, cpu, _ = reading()[os.getpid()]
    assert ("python" in title.lower() or "pytest" in title) and cpu > 0


def test_a_config_is_simulated_with_its_own_modes_serving_path_and_the_machines_cores():
    from pathlib import Path

    from duet.benchmarks.sim_model import cluster_model

    configs = Path(__file__).resolve().parents[1] / "configs"
    settings = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    pool = {"prompt": {"fit": PROMPT}, "decode": {"fit": DECODE}, "settings": settings, "num_threads": 1}
    pd, colocated = _serving(0.2, 0.02, 0.001), _serving(0.1, 0.01, 0.0005)
    profile = {
        "machine": {"cores": 2}, "pools": {"prefill": pool, "decode": pool, "colocated": pool},
        "serving": {"pd": {"fit": pd}, "colocated": {"fit": colocated}},
    }
    assert cluster_model(str(configs / "local-pd.yaml"), profile).serving == pd
    model = cluster_model(str(configs / "colocated.yaml"), profile)
    assert model.serving == colocated and model.cores == 2 and model.decode[0].threads == 1
    del profile["serving"]
    assert cluster_model(str(configs / "local-pd.yaml"), profile).serving is None


def test_through_pd_the_first_token_streamed_from_the_prefill_pool_costs_the_serving_path_too():
    settings = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    pool = PoolModel(PROMPT, DECODE, settings)

    def second_token_gap(serving: dict | None) -> float:
        cluster = ClusterModel(False, [pool], [pool], 16, False, 1000, 1.5, 0.2, None, cores=1, serving=serving)
        (result,), _ = Simulation(cluster).run([[TurnSpec(list(range(100, 300)), 2)]], [0.0])
        return result.itls[0]

    # the only token streamed before the decode pool's first step is the prefill pool's
    assert second_token_gap(_serving(token=0.5)) > second_token_gap(None)


def test_a_request_reaches_the_pools_after_the_serving_paths_latency():
    prompt = list(range(100, 300))
    plain, _ = Simulation(_colocated(4, None)).run([[TurnSpec(prompt, 3)]], [1.0])
    late, duration = Simulation(_colocated(4, _serving(latency=0.07))).run([[TurnSpec(prompt, 3)]], [1.0])
    assert late[0].sent_s == 1.0 and late[0].ttft == pytest.approx(plain[0].ttft + 0.07)
    assert late[0].itls == pytest.approx(plain[0].itls) and duration == pytest.approx(1.0 + plain[0].e2e + 0.07)


def test_a_served_engine_is_as_much_slower_as_its_lone_first_tokens_say():
    steps = {SHORT_PROMPT: 0.1, LONG_PROMPT: 0.6}
    # the long prompt's first token 0.7 s after the short one's, for steps 0.5 s apart: x1.4;
    # the short one's 0.2 s less its step at that speed is the path's latency
    assert served_engine({SHORT_PROMPT: 0.2, LONG_PROMPT: 0.9}, steps) == pytest.approx({"engine_factor": 1.4, "latency_s": 0.06})
    # never faster than the profile's engine, never a negative latency
    assert served_engine({SHORT_PROMPT: 0.05, LONG_PROMPT: 0.3}, steps) == pytest.approx({"engine_factor": 1.0, "latency_s": 0.0})


def test_every_step_of_a_served_engine_takes_the_profiles_factor_longer():
    prompt = list(range(100, 300))
    plain, _ = Simulation(_colocated(4, None)).run([[TurnSpec(prompt, 4)]], [0.0])
    served, _ = Simulation(_colocated(4, _serving() | {"engine_factor": 1.5})).run([[TurnSpec(prompt, 4)]], [0.0])
    assert served[0].ttft == pytest.approx(1.5 * _prompt_s(200)) and served[0].e2e == pytest.approx(1.5 * plain[0].e2e)


def test_profile_serving_makes_ray_local_before_it_reads_a_config(tmp_path):
    """``duet profile --serving`` brings configs up on 127.0.0.1, which needs Ray's loopback
    switch set before ray is first imported; reading the config imports it (Serve's
    autoscaling config), so the switch comes first."""
    import subprocess
    import sys

    probe = (
        "import os, sys\n"
        "from duet.benchmarks import profile\n"
        "def pools_of(*args, **kwargs):\n"
        "    import ray\n"
        "    raise SystemExit(os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', 'unset'))\n"
        "profile.pools_of = pools_of\n"
        f"profile.main(['configs/autoscale.yaml', '--serving', '--out', {str(tmp_path / 'p.json')!r}])\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "0", done.stderr[-2000:]


def test_through_pd_a_contexts_cpu_is_spent_as_its_kv_moves_not_while_its_prompt_is_computed():
    """The serving path's CPU a prompt token is, through PD, mostly its KV's transfer: the prompt
    step runs unstretched, and the steps after the KV moved share the core with it."""
    settings = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    pool = PoolModel(PROMPT, DECODE, settings)

    def result(serving: dict | None):
        cluster = ClusterModel(False, [pool], [pool], 16, False, 1000, 1.5, 0.2, None, cores=1, serving=serving)
        (only,), _ = Simulation(cluster).run([[TurnSpec(list(range(100, 300)), 2)]], [0.0])
        return only

    charged, free = result(_serving(prompt_token=0.002)), result(None)
    assert charged.ttft == pytest.approx(_prompt_s(200)) == pytest.approx(free.ttft)
    assert charged.itls[0] > 1.5 * free.itls[0]  # 0.4 CPU-s in the last second: 0.6 of the core left
