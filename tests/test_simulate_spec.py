"""Speculative decoding in ``duet simulate``: a pool's decode work scaled by the factor ``duet
profile`` measured decoding with its drafts, and that measurement on a real engine."""

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


def test_drafts_scale_a_pools_decode_work_and_leave_its_prompt_work():
    drafting = PoolModel(PROMPT, DECODE, SETTINGS, draft_factor=0.6)
    plain = PoolModel(PROMPT, DECODE, SETTINGS)
    assert drafting.step_seconds(0, 0, 4, 400) == pytest.approx(0.6 * _decode_s(4, 400))
    assert drafting.step_seconds(128, 128 * 64, 0, 0) == pytest.approx(plain.step_seconds(128, 128 * 64, 0, 0))
    mixed = max(PROMPT["base_s"], 0.6 * DECODE["base_s"]) + plain.step_seconds(128, 128 * 64, 0, 0) - PROMPT["base_s"]
    mixed += 0.6 * (_decode_s(4, 400) - DECODE["base_s"])
    assert drafting.step_seconds(128, 128 * 64, 4, 400) == pytest.approx(mixed)


def test_a_request_alone_decodes_in_the_factor_of_the_time():
    def alone(pool: PoolModel):
        cluster = ClusterModel(True, [], [pool], 16, False, 1000, 1.5, 0.2, None)
        (result,), _ = Simulation(cluster).run([[TurnSpec(list(range(100, 300)), 6)]], [0.0])
        return result

    plain, drafting = alone(PoolModel(PROMPT, DECODE, SETTINGS)), alone(PoolModel(PROMPT, DECODE, SETTINGS, draft_factor=0.5))
    assert drafting.ttft == pytest.approx(plain.ttft)
    assert drafting.e2e - drafting.ttft == pytest.approx(0.5 * (plain.e2e - plain.ttft))


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
