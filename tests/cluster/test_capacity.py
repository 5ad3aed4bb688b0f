"""The planning autoscaler: the replicas a demand needs by a profile, on cases with closed-form
answers (a prompt's chunks, M/D/1 waits, Little's law for decode batches), the routers' reports
read as one demand, and the policy sizing pools ahead of their queues."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from duet.cluster import capacity
from duet.cluster.autoscale import PoolPolicy, PoolView, Targets, decide
from duet.cluster.board import LocalBoard
from duet.cluster.capacity import Demand, StageModel

NOW = 1000.0


def model(prompt=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0), budget=512, max_num_seqs=64, num_blocks=10_000) -> StageModel:
    return StageModel(
        dict(zip(("base_s", "per_token_s", "per_token_context_s"), prompt)),
        dict(zip(("base_s", "per_row_s", "per_row_context_s"), decode)), budget, max_num_seqs, num_blocks, 16,
    )


def test_a_prompt_is_priced_chunk_by_chunk_each_over_the_context_before_it():
    stage = model(prompt=(0.01, 0.001, 1e-6), budget=512)
    first = 0.01 + 0.001 * 512 + 1e-6 * 512 * 256
    second = 0.01 + 0.001 * 488 + 1e-6 * 488 * (512 + 244)
    assert stage.prompt_seconds(1000) == pytest.approx(first + second)
    floored = StageModel(stage.prompt | {"floor_s": 0.7}, stage.decode, 512, 64, 1000, 16)  # a roofline's: the weights read
    assert floored.prompt_seconds(1000) == pytest.approx(0.7 + second)


def test_prefill_replicas_meet_the_ttft_target_by_an_md1_queue():
    """A 500-token prompt takes 0.5 s. At 1/s one replica waits 0.25 s on average (TTFT 0.75 s,
    within 0.8 x 2 s); at 3/s one cannot keep up and two wait 0.75 s (1.25 s); with a 1 s target
    (0.8 s of it planned) two are too slow and three wait 0.25 s."""
    stage = model()
    assert capacity.prefill_replicas(stage, Demand(0.0, 500, 64), 2.0) == 0
    assert capacity.prefill_replicas(stage, Demand(1.0, 500, 64), 2.0) == 1
    assert capacity.prefill_replicas(stage, Demand(3.0, 500, 64), 2.0) == 2
    assert capacity.prefill_replicas(stage, Demand(3.0, 500, 64), 1.0) == 3
    # Measured twice as slow as profiled: 1 s a prompt; six replicas wait 0.5 s (TTFT 1.5 s).
    assert capacity.prefill_replicas(stage, Demand(3.0, 500, 64), 2.0, factor=2.0) == 6
    # A prompt longer than the target alone (3 s): it may still wait a quarter of its time, 0.75 s, at
    # utilization 1/3: nine replicas. And one just under it (1.5 s) likewise: no cliff between the two.
    assert capacity.prefill_replicas(stage, Demand(1.0, 3000, 64), 2.0) == 9
    assert capacity.prefill_replicas(stage, Demand(1.0, 1500, 64), 2.0) == 5


def test_decode_batches_follow_littles_law_and_replicas_meet_the_tpot_target():
    """Steps of 10 ms + 1 ms a sequence; 100 tokens a sequence. At 2/s one replica holds
    B = 200 t(B): B = 2.5, a 12.5 ms step. At 10/s one falls behind at any batch; two hold 10
    (20 ms steps), three 5 (15 ms)."""
    stage = model()
    assert capacity.decode_batch(stage, Demand(2.0, 0, 100), 1) == pytest.approx(2.5)
    assert capacity.decode_batch(stage, Demand(10.0, 0, 100), 1) is None
    assert capacity.decode_batch(stage, Demand(10.0, 0, 100), 2) == pytest.approx(10.0)
    assert capacity.decode_replicas(stage, Demand(2.0, 0, 100), tpot_s=0.2, kv_usage=1.0) == 1
    assert capacity.decode_replicas(stage, Demand(10.0, 0, 100), tpot_s=0.2, kv_usage=1.0) == 2
    assert capacity.decode_replicas(stage, Demand(10.0, 0, 100), tpot_s=0.02, kv_usage=1.0) == 3  # 16 ms planned
    # The KV: 10 sequences of 100 + 100 tokens (13 blocks each) do not fit 0.5 x 200 blocks; 5 do.
    small = model(num_blocks=200)
    assert capacity.decode_replicas(small, Demand(10.0, 100, 100), tpot_s=0.2, kv_usage=0.5) == 3
    # Colocated, prompts take a sixth of each of three replicas' time: 16.7 ms steps over the other 5/6 of it
    # are 20 ms a token, past the 16.8 ms planned, where three decode-only replicas step 15 ms; four take 16 ms.
    assert capacity.decode_replicas(stage, Demand(10.0, 50, 100), 0.021, 1.0) == 3
    assert capacity.colocated_replicas(stage, Demand(10.0, 50, 100), 2.0, 0.021, 1.0) == 4


def test_drafts_give_each_sequence_more_tokens_a_step_at_a_dearer_row():
    """Each step gives a sequence 2 tokens, a row costing 1.5 ms: at 2/s one replica holds
    B = 100 (10 + 1.5 B) ms / 1000: B = 1.176, a 11.76 ms step for two tokens each; a plain
    replica 2.5 (above)."""
    stage = dataclasses.replace(model(), draft_tokens=2.0, draft_verify=1.5)
    assert capacity.decode_batch(stage, Demand(2.0, 0, 100), 1) == pytest.approx(1.0 / 0.85)
    assert stage.step_seconds(4, 0) == pytest.approx((0.01 + 1.5 * 0.001 * 4) / 2)
    assert capacity.decode_rate(stage, 0, 100, tpot_s=0.2, kv_usage=1.0) > capacity.decode_rate(model(), 0, 100, tpot_s=0.2, kv_usage=1.0)


def test_drafts_measured_by_batch_price_each_batch_by_its_own_figures():
    """Drafts by batch, (1: 2 tokens a step, a row 1.5 times dearer) and (3: 1 token, 1): at a
    batch B between, T = (5 - B) / 2 tokens and V = (7 - B) / 4. At 2/s one replica holds B =
    200 (10 + V B) ms / T: 9 B^2 - 43 B + 40 = 0, the lesser root; at 4/s it is past batch 3
    and holds 400 x 10 ms / (1 - 0.4) with the last batch's figures."""
    stage = dataclasses.replace(model(), drafts_by_batch=((1, 2.0, 1.5), (3, 1.0, 1.0)))
    assert stage.step_seconds(2, 0) == pytest.approx(0.01 / 1.5 + 0.001 * 1.25 / 1.5 * 2)
    assert capacity.decode_batch(stage, Demand(2.0, 0, 100), 1) == pytest.approx((43 - 409 ** 0.5) / 18)
    assert capacity.decode_batch(stage, Demand(4.0, 0, 100), 1) == pytest.approx(4.0 / 0.6)
    assert capacity.decode_batch(stage, Demand(10.0, 0, 100), 1) is None
    # the same figures at every batch: as a profile measured at one batch
    same = dataclasses.replace(model(), drafts_by_batch=((1, 2.0, 1.5), (8, 2.0, 1.5)))
    assert capacity.decode_batch(same, Demand(2.0, 0, 100), 1) == pytest.approx(1.0 / 0.85)
    # one replica's rate is where the plan steps up to two
    rate = capacity.decode_rate(stage, 0, 100, tpot_s=0.02, kv_usage=1.0)
    assert capacity.decode_replicas(stage, Demand(rate * 0.99, 0, 100), 0.02, 1.0) == 1
    assert capacity.decode_replicas(stage, Demand(rate * 1.01, 0, 100), 0.02, 1.0) == 2


def test_a_profiles_drafts_by_batch_reach_the_plan_and_the_simulation_alike():
    from duet.benchmarks.sim_model import PoolModel

    pool = {"prompt": {"fit": model().prompt}, "decode": {"fit": model().decode}, "num_threads": 1,
            "settings": {"max_num_batched_tokens": 512, "max_num_seqs": 64, "num_blocks": 100, "block_size": 16},
            "speculation": {"tokens_per_step": 2.2, "verify_factor": 2.1, "by_batch": [[8, 2.2, 2.1], [1, 2.6, 2.0]]}}
    stage = StageModel.from_profile({"pools": {"decode": pool}}, "decode")
    assert stage.drafts_by_batch == ((1, 2.6, 2.0), (8, 2.2, 2.1))
    for batch in (1, 4, 8, 20):
        assert stage.drafts_at(batch) == PoolModel.from_profile(pool).drafts_at(batch)


def test_the_correction_is_the_measured_over_the_profiled_time_within_bounds():
    assert capacity.correction(0.3, 0.2) == pytest.approx(1.5)
    assert capacity.correction(10.0, 0.1) == capacity.CORRECTION_BOUNDS[1]
    assert capacity.correction(0.0, 0.2) == 1.0


def report(seconds, requests, prompt_tokens, max_tokens=0, finished=0, output_tokens=0, running=0, running_tokens=0, running_expected=0):
    return {"seconds": seconds, "requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "finished": finished, "output_tokens": output_tokens, "running": running, "running_tokens": running_tokens,
            "running_expected": running_expected}


def test_the_routers_reports_are_a_demand_per_window_each_rate_with_its_own_lengths():
    rising = [[report(10, 20, 4000, 2000), report(60, 30, 6000, 3000)], [report(10, 10, 2000), report(60, 10, 2000)]]
    short, long = Demand.from_reports(rising)
    assert short == Demand(20 / 10 + 10 / 10, 6000 / 30, 2000 / 30)  # nothing finished yet: what they asked for
    assert long == Demand(40 / 60, 8000 / 40, 3000 / 40)
    # Longer outputs begin: 4 in flight are likely to end with 200 tokens each, past the 50 the finished ones ended with.
    switching = [[report(10, 4, 800, running=4, running_tokens=400, running_expected=800),
                  report(60, 34, 6800, finished=30, output_tokens=1500, running=4, running_tokens=400, running_expected=800)]]
    assert [demand.output_tokens for demand in Demand.from_reports(switching)] == [200, 200]
    lull = [[report(10, 0, 0), report(60, 30, 6000, 3000, finished=30, output_tokens=1500)]]
    assert Demand.from_reports(lull)[1] == Demand(0.5, 200, 50)  # what they ended with
    young = [[report(1, 2, 200), report(1, 2, 200)]]
    assert Demand.from_reports(young)[0].rate == pytest.approx(2 / capacity.MIN_WINDOW_S)
    assert Demand.from_reports([[report(10, 1, 10)]])[0].output_tokens == capacity.DEFAULT_OUTPUT_TOKENS
    assert Demand.from_reports([]) == []


def test_a_pool_is_planned_for_the_window_that_needs_most_and_down_only_past_a_margin():
    """Guards a flapping pool: the short window's Poisson count crossed a replica's threshold every
    few seconds, and a planned pool went 2, 1, 2, 1 within a phase of steady arrivals."""
    targets = {"prefill": Targets(cooldown_s=0)}
    models = {"prefill": model()}
    view = PoolView("prefill", 2, 1, 4, [{"prompt_tokens_pending": 0.0, "ttft_s": 0.1}] * 2, 0.0)
    # 500-token prompts (0.5 s): 1.9/s needs two replicas (one waits 3.4 s at 0.95), 1.5/s one (0.75: 1.5 s).
    rising = decide({"prefill": dataclasses.replace(view, target=1)}, targets, NOW, demands=[Demand(1.9, 500, 1), Demand(0.5, 500, 1)],
                    models=models)["prefill"]
    assert (rising.target, rising.numbers["rate"]) == (2, 1.9)  # the short window's rise
    held = decide({"prefill": view}, targets, NOW, demands=[Demand(1.5, 500, 1), Demand(1.5, 500, 1)], models=models)["prefill"]
    assert (held.target, held.reason) == (2, "steady")  # 1.25 x 1.5/s would not fit one
    fallen = decide({"prefill": view}, targets, NOW, demands=[Demand(1.0, 500, 1), Demand(1.0, 500, 1)], models=models)["prefill"]
    assert (fallen.target, fallen.reason) == (1, "planned")
    # Both windows fit one replica, only the long one's 1.25 x 1.5/s does not: it holds two, and its numbers show it.
    kept = decide({"prefill": view}, targets, NOW, demands=[Demand(1.0, 500, 1), Demand(1.5, 500, 1)], models=models)["prefill"]
    assert (kept.target, kept.numbers["rate"]) == (2, 1.5)


def decode_view(target: int, blocks_used: float, running: float = 0.0, tpot_s: float = 0.0, bounds=(1, 4)) -> PoolView:
    replica = {"num_decoding_blocks": blocks_used, "num_blocks": 1000.0, "tpot_s": tpot_s, "num_decode_waiting": 0.0, "num_running": running}
    return PoolView("decode", target, *bounds, [replica] * target, 0.0)


def test_a_planned_pool_grows_before_any_queue_shows_and_shrinks_to_the_plan():
    """Guards the plan being computed and left out: the reactive rules see an idle decode pool and
    hold it at one replica while the arrivals already need three."""
    targets = {"decode": Targets(tpot_s=0.02, kv_usage=1.0, cooldown_s=0)}
    models = {"decode": model()}
    idle = decode_view(1, 0.0)
    assert decide({"decode": idle}, targets, NOW)["decode"].target == 1
    grown = decide({"decode": idle}, targets, NOW, demands=[Demand(10.0, 0, 100)], models=models)["decode"]
    assert (grown.target, grown.reason, grown.numbers["planned"]) == (3, "planned", 3)
    # Arrivals gone: down to the plan (at its bounds), not one at a time ...
    shrunk = decide({"decode": decode_view(4, 0.0)}, targets, NOW, demands=[Demand(0.0, 0, 100)], models=models)["decode"]
    assert (shrunk.target, shrunk.reason) == (1, "planned, bounded")
    # ... but never below what the decoding KV holds now.
    held = decide({"decode": decode_view(4, 900.0)}, targets, NOW, demands=[Demand(0.0, 0, 100)], models=models)["decode"]
    assert held.target == 4 and held.numbers["needed"] == 4
    # Replicas measured slower than profiled (TPOT 30 ms at 5 sequences, profiled 15 ms): planned for as they run.
    slow = decide({"decode": decode_view(3, 0.0, running=5.0, tpot_s=0.03)}, targets, NOW, demands=[Demand(10.0, 0, 100)], models=models)
    assert slow["decode"].numbers["correction"] == pytest.approx(2.0) and slow["decode"].target == 4


def test_a_planned_prefill_pool_counts_the_backlog_the_routers_hold():
    targets = {"prefill": Targets(prompt_tokens_per_replica=1000, cooldown_s=0)}
    view = PoolView("prefill", 1, 1, 4, [{"prompt_tokens_pending": 0.0, "ttft_s": 0.1}], 0.0)
    quiet = Demand(0.2, 500, 64)
    assert decide({"prefill": view}, targets, NOW, demands=[quiet], models={"prefill": model()})["prefill"].target == 1
    backed_up = decide({"prefill": view}, targets, NOW, waiting_tokens=2500, demands=[quiet], models={"prefill": model()})["prefill"]
    assert (backed_up.target, backed_up.numbers["planned"]) == (3, 1)


def _profile(path, stages=("prefill", "decode")) -> str:
    pool = {
        "prompt": {"fit": {"base_s": 0.0, "per_token_s": 0.001, "per_token_context_s": 0.0}},
        "decode": {"fit": {"base_s": 0.01, "per_row_s": 0.001, "per_row_context_s": 0.0}},
        "settings": {"max_num_batched_tokens": 512, "max_num_seqs": 64, "num_blocks": 10_000, "block_size": 16},
    }
    path.write_text(json.dumps({"machine": {"cpu": "test", "cores": 2}, "pools": {stage: pool for stage in stages}}))
    return str(path)


def test_the_policy_plans_from_the_arrivals_its_routersreport(tmp_path):
    from tests.cluster.test_autoscale import _context

    targets = {"decode": {"tpot_s": 0.02, "kv_usage": 1.0, "cooldown_s": 0, "profile": _profile(tmp_path / "p.json")}}
    board = LocalBoard()
    policy = PoolPolicy("decode", targets, board)
    idle = {"num_decoding_blocks": 0.0, "num_blocks": 1000.0, "tpot_s": 0.0, "num_decode_waiting": 0.0}
    assert policy(_context("plan", "decode", {"d1": idle}, 1, NOW))[0] == 1
    board.report_waiting("plan", "router-a", 0, at=NOW, arrivals=[report(10, 100, 0, 10_000), report(60, 100, 0, 10_000)])
    assert policy(_context("plan", "decode", {"d1": idle}, 1, NOW + 1))[0] == 3
    # A router's report ages out with it: no demand known, the reactive rules decide (one down).
    assert policy(_context("plan", "decode", {"d1": idle}, 3, NOW + 30))[0] == 2
    assert policy._last.reason == "low_load"


def test_a_profile_that_does_not_read_or_lacks_the_pool_fails_at_deploy_naming_the_setting(tmp_path, monkeypatch):
    from duet.cluster.config import AppConfigError, parse_args

    def args(path):
        return {"decode": {"autoscaling_config": {"max_replicas": 2, "profile": path}}}

    with pytest.raises(AppConfigError, match=r"decode.autoscaling_config.profile: .*cannot be read"):
        parse_args(args(str(tmp_path / "missing.json")))
    with pytest.raises(AppConfigError, match=r"decode.autoscaling_config.profile: .* has no decode pool"):
        parse_args(args(_profile(tmp_path / "prefill-only.json", stages=("prefill",))))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(AppConfigError, match="not a `duet profile` JSON"):
        parse_args(args(str(tmp_path / "bad.json")))
    monkeypatch.chdir(tmp_path)  # a path relative to where `duet up` runs: Serve's controller reads it from its own folder
    config = parse_args(args(Path(_profile(tmp_path / "ok.json")).name))
    assert config.decode.policy_targets("decode", config.slo)["profile"] == str((tmp_path / "ok.json").resolve())
