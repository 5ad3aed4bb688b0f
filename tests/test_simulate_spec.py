"""Speculative decoding in ``duet simulate`` and the planner: a drafting sequence verifies drafts
through the engine's own scheduler, each drafting row costing what ``duet profile`` measured
verifying them costs and giving the tokens it measured a step gives (at the step's batch), in
steps with prompt chunks too; that measurement on a real engine, and what it gives from known
step times."""

from __future__ import annotations

import pytest

from duet.benchmarks.sim_model import TOKEN, ClusterModel, PoolModel, Replica, decode_seconds
from duet.benchmarks.sim_run import Simulation, inter_token_latencies
from duet.benchmarks.workloads import TurnSpec

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}
SETTINGS = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}


def _add(replica: Replica, request_id: str, prompt_len: int, output_len: int, first: int = 100) -> None:
    from duet.request import Request
    from duet.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    replica.scheduler.add_request(Request(request_id, list(range(first, first + prompt_len)), params, None, arrival_time=0.0))


def _outputs(replica: Replica) -> dict[str, int]:
    return {request.request_id: request.num_output_tokens for request in replica.scheduler.requests.values()}


def test_a_drafting_row_costs_its_verify_factor_and_gives_its_tokens_beside_a_prompt_too():
    pool = PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=2.0, draft_verify=1.5)
    replica = Replica("r", "colocated", pool, clock=lambda: 0.0)
    _add(replica, "a", 200, 20)
    assert replica.start() == pytest.approx(pool.step_seconds(200, 200 * 100, 0, 0))  # the prompt: no drafts
    replica.finish()
    assert _outputs(replica) == {"a": 1} and replica.scheduler.requests["a"].spec_token_ids == [TOKEN]  # its draft for the next step
    assert replica.start() == pytest.approx(decode_seconds(DECODE, 1.5, 1.5 * 200))  # one row verifying: 1.5 rows' cost
    replica.finish()
    assert _outputs(replica) == {"a": 3}
    _add(replica, "b", 100, 2, first=5000)
    # b's prompt and a's drafting row in one step: a gets its two tokens from it all the same
    assert replica.start() == pytest.approx(pool.step_seconds(100, 100 * 50, 1.5, 1.5 * 202))
    replica.finish()
    assert _outputs(replica) == {"a": 5, "b": 1}


def test_a_fraction_of_a_token_a_step_is_carried_to_the_next_and_drafts_stop_at_the_length():
    replica = Replica("r", "colocated", PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=1.5, draft_verify=1.0), clock=lambda: 0.0)
    _add(replica, "a", 64, 9)
    counts, emitted = [], 0
    while replica.start() is not None:
        (request,) = replica.finish()
        counts.append(request.num_output_tokens - emitted)
        emitted = request.num_output_tokens
    assert counts == [1, 1, 2, 1, 2, 1, 1]  # the prompt's token, then 1.5 a step; the last with no room for a draft
    assert request.is_finished and replica._credit == {}


def test_the_drafts_figures_by_batch_go_straight_between_the_batches_measured():
    points = ((1, 2.6, 2.0), (4, 2.0, 1.7), (8, 2.2, 2.1))
    pool = PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=2.2, draft_verify=2.1, drafts_by_batch=points)
    assert pool.drafts_at(1) == pytest.approx((2.6, 2.0)) and pool.drafts_at(0) == pytest.approx((2.6, 2.0))
    assert pool.drafts_at(2) == pytest.approx((2.4, 1.9))
    assert pool.drafts_at(6) == pytest.approx((2.1, 1.9)) and pool.drafts_at(32) == pytest.approx((2.2, 2.1))
    assert PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=1.8, draft_verify=1.6).drafts_at(3) == (1.8, 1.6)  # measured at one batch
    profile = {
        "prompt": {"fit": PROMPT}, "decode": {"fit": DECODE}, "settings": SETTINGS,
        "speculation": {"tokens_per_step": 2.2, "verify_factor": 2.1, "by_batch": [list(point) for point in reversed(points)]},
    }
    assert PoolModel.from_profile(profile).drafts_by_batch == points


def test_a_request_alone_decodes_in_drafted_steps_each_costing_its_rows_verification():
    def alone(pool: PoolModel):
        cluster = ClusterModel(True, [], [pool], 16, False, 1000, 1.5, 0.2, None)
        (result,), _ = Simulation(cluster).run([[TurnSpec(list(range(100, 300)), 6)]], [0.0])
        return result

    plain = alone(PoolModel(PROMPT, DECODE, SETTINGS))
    drafting = alone(PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=2.0, draft_verify=1.5))
    assert drafting.ttft == pytest.approx(plain.ttft)
    # two tokens a step while a draft fits in its length, then the last token alone
    steps = [decode_seconds(DECODE, 1.5, 1.5 * 200), decode_seconds(DECODE, 1.5, 1.5 * 202), decode_seconds(DECODE, 1, 204)]
    assert drafting.e2e - drafting.ttft == pytest.approx(sum(steps))
    assert drafting.itls == pytest.approx([steps[0] / 2] * 2 + [steps[1] / 2] * 2 + [steps[2]])  # as the client counts them


def test_tokens_streamed_together_share_the_gap_before_them():
    assert inter_token_latencies([1.0, 1.1, 1.3, 1.3, 1.4]) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert inter_token_latencies([2.0, 2.0, 2.5]) == pytest.approx([0.5]) and inter_token_latencies([2.0]) == []


def test_the_drafts_figures_come_back_from_known_steps_and_older_profiles_keep_their_factor():
    from duet.benchmarks.profile_spec import OUTPUT, drafts
    from duet.cluster import capacity

    fit = {"base_s": 0.01, "per_row_s": 0.002, "per_row_context_s": 0.0}
    tokens = OUTPUT - 1
    plain = tokens * (0.01 + 0.002 * 8)
    steps = 30  # 2.1 tokens a step, each row costing 1.6 times a plain one
    found = {"decode_steps": steps, "plain_s": plain, "decode_s": steps * (0.01 + 1.6 * 0.002 * 8)}
    assert drafts(found, fit) == pytest.approx({"tokens_per_step": tokens / steps, "verify_factor": 1.6})
    assert drafts(found | {"decode_s": steps * 0.01}, fit)["verify_factor"] == 1.0  # never cheaper than a plain row
    assert capacity.drafts(found | drafts(found, fit)) == pytest.approx((tokens / steps, 1.6))
    assert capacity.drafts({"decode_factor": 0.8}) == pytest.approx((1.25, 1.0)) and capacity.drafts(None) == (1.0, 1.0)
    # decoded in two waves: each sequence's tokens twice over as many steps and plain steps
    waves = {"decode_steps": 2 * steps, "plain_s": 2 * plain, "decode_s": 2 * found["decode_s"], "tokens": 2 * tokens}
    assert drafts(waves, fit) == pytest.approx(drafts(found, fit))


def test_the_profile_times_a_drafting_engine_decoding_and_none_for_one_that_does_not(tiny_llama_dir):
    from duet import LLM
    from duet.benchmarks.profile_spec import BATCH, BATCHES, OUTPUT, SEQUENCES, measure

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "adaptive": False}
    fit = {"base_s": 0.001, "per_row_s": 0.0001, "per_row_context_s": 1e-7}
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, speculative_config=ngram)
    added = []
    add_request = llm.engine.add_request
    llm.engine.add_request = lambda request: (added.append(request.request_id), add_request(request))[1]
    try:
        found = measure(llm, fit, seed=0)
        assert len(added) == len(set(added)) == SEQUENCES * len(BATCHES)  # every batch over as many sequences
        assert found["decode_steps"] >= 1 and found["decode_s"] > 0 and 0.0 <= found["acceptance"] <= 1.0
        assert found["plain_s"] == pytest.approx(sum(0.001 + 0.0001 * BATCH + 1e-7 * BATCH * (256 + i) for i in range(1, OUTPUT)))
        assert found["decode_factor"] == pytest.approx(found["decode_s"] / found["plain_s"])
        assert found["tokens_per_step"] == pytest.approx((OUTPUT - 1) / found["decode_steps"]) and found["verify_factor"] >= 1.0
        assert found["decode_steps"] <= OUTPUT - 1  # each gives every sequence in it a token or more
        assert [batch for batch, *_ in found["by_batch"]] == list(BATCHES)
        assert all(tokens >= 1.0 and verify >= 1.0 for _, tokens, verify in found["by_batch"])
        # at the largest batch, the figures above
        assert found["by_batch"][-1] == [BATCH, found["tokens_per_step"], found["verify_factor"]]
        assert llm.engine.scheduler.spec_stats.stats().num_drafts > 0
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.close()
    plain = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512)
    try:
        assert measure(plain, fit, seed=0) is None
    finally:
        plain.engine.close()


def test_a_decode_step_is_one_whose_every_sequence_computes_its_next_token_and_drafts():
    from duet.benchmarks.profile_spec import _decoding_only
    from duet.outputs import SchedulerOutput

    def output(tokens: dict[str, int], drafts: dict[str, list[int]]) -> SchedulerOutput:
        return SchedulerOutput([], [], tokens, scheduled_spec_token_ids=drafts)

    assert _decoding_only(output({"a": 1, "b": 4}, {"b": [5, 6, 7]}))
    assert not _decoding_only(output({"a": 1, "b": 4}, {"b": [5, 6]}))  # b computes a chunk too
    assert not _decoding_only(output({"a": 256}, {}))  # a prompt
