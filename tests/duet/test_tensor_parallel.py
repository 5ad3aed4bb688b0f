"""Tensor parallelism: how heads, features and the vocabulary split over ranks, and TP=2 engines
(workers as Ray actors, talking over gloo) against transformers and TP=1."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from duet import LLM, SamplingParams
from duet.config import ConfigError
from duet.errors import WorkerDiedError
from duet.messages import EngineRequest
from duet.models.tensor_parallel import HeadShard, shard_heads, split_range
from tests.conftest import make_tiny_llama
from tests.gguf_writer import make_tiny_gguf_llama
from tests.duet.schemas import SMALL_SCHEMA, small_schema_greedy
from tests.reference import compare_to_reference, hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917))]


def test_ranges_split_near_equally_and_cover_everything():
    assert [split_range(10, 3, index) for index in range(3)] == [slice(0, 3), slice(3, 6), slice(6, 10)]
    assert [split_range(1536, 2, index, unit=32) for index in range(2)] == [slice(0, 768), slice(768, 1536)]
    assert [split_range(96, 2, index, unit=32) for index in range(2)] == [slice(0, 32), slice(32, 96)]


def test_ranks_take_whole_kv_groups_when_there_are_enough_kv_heads():
    """SmolLM2 (9 heads over 3 KV heads) at TP=2: one group on rank 0, two on rank 1; each
    rank's attention is a smaller model's with the same group size."""
    assert [shard_heads(9, 3, 2, rank) for rank in range(2)] == [
        HeadShard(slice(0, 3), slice(0, 1)),
        HeadShard(slice(3, 9), slice(1, 3)),
    ]
    assert shard_heads(8, 8, 4, 3) == HeadShard(slice(6, 8), slice(6, 8))


def test_a_kv_head_is_replicated_on_the_ranks_that_split_its_query_heads():
    assert [shard_heads(4, 2, 4, rank) for rank in range(4)] == [
        HeadShard(slice(0, 1), slice(0, 1)),
        HeadShard(slice(1, 2), slice(0, 1)),
        HeadShard(slice(2, 3), slice(1, 2)),
        HeadShard(slice(3, 4), slice(1, 2)),
    ]
    assert [shard_heads(6, 1, 2, rank) for rank in range(2)] == [
        HeadShard(slice(0, 3), slice(0, 1)),
        HeadShard(slice(3, 6), slice(0, 1)),
    ]


def test_layouts_that_cannot_split_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 cannot split 9 attention heads over 3 KV heads"):
        shard_heads(9, 3, 4, 0)
    with pytest.raises(ConfigError, match="at most 2"):
        shard_heads(2, 1, 4, 0)


def test_an_engine_refuses_a_layout_before_any_worker_starts(tiny_llama_dir):
    with pytest.raises(ConfigError, match="cannot split 4 attention heads over 2 KV heads"):
        LLM(model=str(tiny_llama_dir), num_kv_blocks=16, tensor_parallel_size=8)
    with pytest.raises(ConfigError, match="distributed_executor_backend='ray'"):
        LLM(model=str(tiny_llama_dir), num_kv_blocks=16, tensor_parallel_size=2, distributed_executor_backend="uni")


def _greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kv_heads, gguf",
    [(3, False), (1, True)],
    ids=["uneven-kv-groups", "replicated-kv-head-gguf"],
)
def test_tp2_greedy_matches_transformers_and_tp1(ray_cluster, tmp_path, tiny_tokenizer_dir, kv_heads, gguf):
    """Guards the shards (q/k/v rows, o/down columns, vocabulary), the all-reduces and the
    gathered logits: 6 heads over 3 KV heads split 1:2 groups, and over 1 KV head replicated on
    both ranks (GGUF blocks sharded with it), with chunked prompts, against the oracle."""
    make = make_tiny_gguf_llama if gguf else make_tiny_llama
    model_dir = make(tmp_path, tiny_tokenizer_dir, hidden_size=192, num_attention_heads=6, num_key_value_heads=kv_heads, intermediate_size=256)
    references = hf_greedy(model_dir, PROMPTS, 10)
    settings = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    tp2 = LLM(**settings, tensor_parallel_size=2)
    try:
        outputs = [output.outputs[0].token_ids for output in tp2.generate(PROMPTS, _greedy())]
        for index, (tokens, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(tokens, reference, f"prompt {index}") is None
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=8)
        assert len(tp2.generate(PROMPTS[:2], seeded)[1].outputs[0].token_ids) == 8
        constrained = [output.outputs[0] for output in tp2.generate(PROMPTS, small_schema_greedy())]
        tp2.engine.check_integrity()
    finally:
        tp2.engine.close()
    tp1 = LLM(**settings)
    assert outputs == [output.outputs[0].token_ids for output in tp1.generate(PROMPTS, _greedy())]
    # Every rank samples under the schema, each with its own matchers, and they agree.
    assert [c.token_ids for c in constrained] == [output.outputs[0].token_ids for output in tp1.generate(PROMPTS, small_schema_greedy())]
    for completion in constrained:
        jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)


@pytest.mark.slow
def test_tp2_with_int8_weights_and_kv_matches_tp1(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """Quantization and tensor parallelism together: each rank keeps its rows (and, past the
    o/down split, its block columns) of the load-time Q8_0 blocks, no float weight, and an int8
    KV cache of its heads; the tokens are TP=1's with the same settings."""
    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, hidden_size=192, num_attention_heads=6, num_key_value_heads=2, intermediate_size=256)
    settings = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, quantization="int8", kv_cache_dtype="int8")
    tp2 = LLM(**settings, tensor_parallel_size=2)
    try:
        outputs = [output.outputs[0].token_ids for output in tp2.generate(PROMPTS, _greedy())]
        tp2.engine.check_integrity()
    finally:
        tp2.engine.close()
    assert outputs == [output.outputs[0].token_ids for output in LLM(**settings).generate(PROMPTS, _greedy())]


@pytest.mark.slow
def test_smollm2_at_tp2_matches_transformers(ray_cluster, smollm2_dir, parity_prompts, parity_references):
    """The real model's 9 heads over 3 KV heads, its Q4_1/Q8_0 blocks sharded, batched."""
    llm = LLM(model=str(smollm2_dir), num_kv_blocks=256, max_model_len=1024, tensor_parallel_size=2)
    try:
        from duet.benchmarks.prompts import PARITY_NEW_TOKENS

        outputs = llm.generate(parity_prompts, _greedy(PARITY_NEW_TOKENS))
        notes = [
            compare_to_reference(output.outputs[0].token_ids, reference, f"prompt {index}")
            for index, (output, reference) in enumerate(zip(outputs, parity_references))
        ]
        assert sum(note is not None for note in notes) <= 1, notes
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_tp2_batch_invariant_gives_a_request_the_same_bits_in_any_batch(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """``batch_invariant`` at TP=2 (heads of 64 split 2:2 over 2 KV heads): each rank's products
    and attention rows are batch-invariant, the partial sums added in rank order and the logits
    gathered, so a request's tokens and logprobs alone equal those in batches, greedy and seeded."""
    from tests.duet.test_batch_invariant import check_alone_and_in_batches

    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, batch_invariant=True, max_model_len=512, max_num_batched_tokens=64)
    try:
        check_alone_and_in_batches(llm)
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_a_dead_worker_fails_the_step_and_the_health_check_at_once(ray_cluster, tiny_llama_dir):
    """Guards against a hang in a collective: with rank 1 killed, rank 0 would wait in its
    all-reduce until the group's timeout; the executor fails the step as soon as rank 1 is
    gone, stays failed, and the health check says so."""
    import ray

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256, tensor_parallel_size=2)
    try:
        assert len(llm.generate([PROMPTS[0]], _greedy(4))[0].outputs[0].token_ids) == 4
        llm.engine.check_health()
        ray.kill(llm.engine.executor.workers[1])
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            # ray.kill returns before the actor is gone: a ping just after it may still answer.
            while time.monotonic() - started < 10:
                llm.engine.check_health()
                time.sleep(0.05)
        llm.engine.add_request(EngineRequest("after", PROMPTS[1], _greedy(4)))
        with pytest.raises(WorkerDiedError):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert time.monotonic() - started < 15
    finally:
        llm.engine.close()
