"""Speculative decoding in ``duet simulate`` and the planner: a drafting pool's decode step gives
each sequence the tokens ``duet profile`` measured a step gives, each row costing what it
measured verifying them costs, so drafts pay most in small batches; that measurement on a real
engine, and what it gives from known step times."""

from __future__ import annotations

import pytest

from duet.benchmarks.sim_model import ClusterModel, PoolModel
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.workloads import TurnSpec

PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}
SETTINGS = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}


def _decode_s(rows: int, context: int) -> float:
    return DECODE["base_s"] + DECODE["per_row_s"] * rows + DECODE["per_row_context_s"] * context


def _drafted_s(rows: int, context: int, tokens: float = 2.0, verify: float = 1.5) -> float:
    """A decode step's time a token with drafts: its fixed cost and its rows' (``verify`` times a
    plain row's) over the ``tokens`` a sequence gets from it."""
    return (DECODE["base_s"] + verify * (_decode_s(rows, context) - DECODE["base_s"])) / tokens


def test_drafts_scale_a_pools_decode_work_by_the_batch_and_leave_its_prompt_work():
    drafting = PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=2.0, draft_verify=1.5)
    plain = PoolModel(PROMPT, DECODE, SETTINGS)
    assert drafting.step_seconds(0, 0, 4, 400) == pytest.approx(_drafted_s(4, 400))
    # The fixed cost is most of a small batch's step: drafts pay more there.
    assert drafting.step_seconds(0, 0, 1, 100) / plain.step_seconds(0, 0, 1, 100) < drafting.step_seconds(0, 0, 8, 800) / plain.step_seconds(0, 0, 8, 800)
    assert drafting.step_seconds(128, 128 * 64, 0, 0) == pytest.approx(plain.step_seconds(128, 128 * 64, 0, 0))
    mixed = max(PROMPT["base_s"], DECODE["base_s"] / 2.0) + plain.step_seconds(128, 128 * 64, 0, 0) - PROMPT["base_s"]
    mixed += _drafted_s(4, 400) - DECODE["base_s"] / 2.0
    assert drafting.step_seconds(128, 128 * 64, 4, 400) == pytest.approx(mixed)


def test_a_request_alone_decodes_each_token_in_a_drafted_steps_share_of_the_time():
    def alone(pool: PoolModel):
        cluster = ClusterModel(True, [], [pool], 16, False, 1000, 1.5, 0.2, None)
        (result,), _ = Simulation(cluster).run([[TurnSpec(list(range(100, 300)), 6)]], [0.0])
        return result

    plain = alone(PoolModel(PROMPT, DECODE, SETTINGS))
    drafting = alone(PoolModel(PROMPT, DECODE, SETTINGS, draft_tokens=2.0, draft_verify=1.5))
    assert drafting.ttft == pytest.approx(plain.ttft)
    assert drafting.e2e - drafting.ttft == pytest.approx(sum(_drafted_s(1, 200 + index) for index in range(5)))


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


def test_the_profile_times_a_drafting_engine_decoding_and_none_for_one_that_does_not(tiny_llama_dir):
    from duet import LLM
    from duet.benchmarks.profile_spec import BATCH, OUTPUT, measure

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "adaptive": False}
    fit = {"base_s": 0.001, "per_row_s": 0.0001, "per_row_context_s": 1e-7}
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, speculative_config=ngram)
    try:
        found = measure(llm, fit, seed=0)
        assert found["decode_steps"] >= 1 and found["decode_s"] > 0 and 0.0 <= found["acceptance"] <= 1.0
        assert found["plain_s"] == pytest.approx(sum(0.001 + 0.0001 * BATCH + 1e-7 * BATCH * (256 + i) for i in range(1, OUTPUT)))
        assert found["decode_factor"] == pytest.approx(found["decode_s"] / found["plain_s"])
        assert found["tokens_per_step"] == pytest.approx((OUTPUT - 1) / found["decode_steps"]) and found["verify_factor"] >= 1.0
        assert found["decode_steps"] <= OUTPUT - 1  # each gives every sequence in it a token or more
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
