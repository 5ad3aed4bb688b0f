"""The Mixtral-style mixture of experts against transformers' Mixtral with the same weights:
in one process, with its experts spread over two ranks (expert parallelism), and with every
expert's features split over two ranks (tensor parallelism)."""

from __future__ import annotations

import pytest

from duet import LLM, SamplingParams
from duet.config import ConfigError
from tests.conftest import make_tiny_mixtral
from tests.reference import check_outputs, hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917))]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny-mixtral"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def references(mixtral_dir):
    return hf_greedy(mixtral_dir, PROMPTS, 10)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)


def test_mixtral_routes_and_sums_experts_as_transformers_does(mixtral_dir, references):
    """Guards the router (fp32 softmax, top-2, renormalised), the experts' fused w1/w3 rows, and
    the sum in expert order, batched with chunked prompts."""
    llm = LLM(model=str(mixtral_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, "mixtral")
    llm.engine.check_integrity()


def test_a_moe_layout_that_cannot_split_says_why(mixtral_dir, tiny_llama_dir):
    with pytest.raises(ConfigError, match="4 experts cannot spread over 8 ranks"):
        LLM(model=str(mixtral_dir), num_kv_blocks=16, tensor_parallel_size=8, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        LLM(model=str(tiny_llama_dir), num_kv_blocks=16, enable_expert_parallel=True)


@pytest.mark.slow
def test_ep2_matches_transformers_and_one_process(ray_cluster, mixtral_dir, references):
    """Two experts a rank; a token's two experts on two ranks add up as in one process."""
    import ray

    settings = dict(model=str(mixtral_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    ep2 = LLM(**settings, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        tokens = check_outputs(ep2.generate(PROMPTS, _greedy()), references, "mixtral")
        ep2.engine.check_integrity()
        held = [
            ray.get(worker.__ray_call__.remote(lambda worker: list(worker.runner.model.layers[0].mlp.module.local_experts)))
            for worker in ep2.engine.executor.workers
        ]
        assert held == [[0, 1], [2, 3]]
    finally:
        ep2.engine.close()
    assert tokens == [output.outputs[0].token_ids for output in LLM(**settings).generate(PROMPTS, _greedy())]


@pytest.mark.slow
def test_tp2_without_expert_parallelism_splits_every_expert_and_matches_transformers(ray_cluster, mixtral_dir, references):
    """Every rank holds all four experts, each with half its features (w1/w3 rows, w2 columns):
    the ranks' parts of each expert's down projection add up to transformers' tokens."""
    import ray

    settings = dict(model=str(mixtral_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    tp2 = LLM(**settings, tensor_parallel_size=2)
    try:
        check_outputs(tp2.generate(PROMPTS, _greedy()), references, "mixtral")
        tp2.engine.check_integrity()
        held = [
            ray.get(worker.__ray_call__.remote(lambda worker: (
                list(worker.runner.model.layers[0].mlp.module.local_experts), worker.runner.model.layers[0].mlp.module.intermediate_size,
            )))
            for worker in tp2.engine.executor.workers
        ]
    finally:
        tp2.engine.close()
    assert held == [([0, 1, 2, 3], 48)] * 2  # the tiny Mixtral's experts have 96 features each


@pytest.mark.slow
def test_ep2_batch_invariant_gives_a_request_the_same_bits_in_any_batch(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """``batch_invariant`` with the experts over two ranks (heads of 64): each rank's experts
    compute as alone whatever rows the batch routes to them, and the ranks' parts are added in
    rank order, so a request's tokens and logprobs alone equal those in batches."""
    from tests.duet.test_batch_invariant import check_alone_and_in_batches

    model_dir = make_tiny_mixtral(tmp_path, tiny_tokenizer_dir, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128)
    ep2 = LLM(model=str(model_dir), batch_invariant=True, max_model_len=512, max_num_batched_tokens=64, tensor_parallel_size=2,
              enable_expert_parallel=True)
    try:
        check_alone_and_in_batches(ep2)
    finally:
        ep2.engine.close()
