"""Pipeline parallelism: layers split into stages (Ray actors, hidden states passed over gloo,
micro-batches in flight), against transformers and one process."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import ray

from duet import LLM, SamplingParams
from duet.config import ConfigError, EngineArgs
from duet.engine import LLMEngine
from duet.messages import EngineRequest
from duet.models.pipeline_parallel import stage_layers
from tests.conftest import make_tiny_llama
from tests.duet.schemas import SMALL_SCHEMA, small_schema_greedy
from tests.reference import compare_to_reference, hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917)), [42]]


def test_stages_take_near_equal_runs_of_layers():
    assert [stage_layers(30, 2, stage) for stage in range(2)] == [range(0, 15), range(15, 30)]
    assert [stage_layers(3, 2, stage) for stage in range(2)] == [range(0, 1), range(1, 3)]
    with pytest.raises(ConfigError, match="pipeline_parallel_size=4 needs at least as many layers; the model has 3"):
        stage_layers(3, 4, 0)


def test_what_pipeline_parallelism_does_not_combine_with_yet_is_refused():
    draft = {"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 1}
    with pytest.raises(ConfigError, match="pipeline parallelism with speculative_config.method='layer_skip' is not built yet"):
        EngineArgs(pipeline_parallel_size=2, speculative_config=draft)
    EngineArgs(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, kv_transfer_config={})


def _greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


@pytest.mark.slow
def test_pp2_greedy_matches_transformers_and_one_process(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """Guards the cut between stages (the MLP output and the residual stream, before the next
    layer's fused add-and-norm), the micro-batches' logits in order, and the sampled tokens
    shared back to the first stage: 3 layers split 1 + 2, chunked prompts, batched."""
    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, num_hidden_layers=3)
    references = hf_greedy(model_dir, PROMPTS, 10)
    settings = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    pp2 = LLM(**settings, pipeline_parallel_size=2)
    try:
        outputs = [output.outputs[0].token_ids for output in pp2.generate(PROMPTS, _greedy())]
        for index, (tokens, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(tokens, reference, f"prompt {index}") is None
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2)
        sampled = pp2.generate(PROMPTS[:2], seeded)[1].outputs[0]
        assert len(sampled.token_ids) == len(sampled.logprobs) == 8
        constrained = [output.outputs[0] for output in pp2.generate(PROMPTS, small_schema_greedy())]
        pp2.engine.check_integrity()
    finally:
        pp2.engine.close()
    local = LLM(**settings)
    assert outputs == [output.outputs[0].token_ids for output in local.generate(PROMPTS, _greedy())]
    # The last stage samples under the schema; the others take its tokens.
    assert [c.token_ids for c in constrained] == [output.outputs[0].token_ids for output in local.generate(PROMPTS, small_schema_greedy())]
    for completion in constrained:
        jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)
    assert local.generate(PROMPTS[:2], seeded)[1].outputs[0].token_ids == sampled.token_ids


@pytest.mark.slow
def test_pp2_batch_invariant_gives_a_request_the_bits_it_has_alone_and_in_one_process(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """``batch_invariant`` over two stages (heads of 64, 3 layers split 1 + 2): each stage's rows
    are computed as alone whatever the micro-batches hold, so a request's tokens and logprobs
    alone equal those in batches, and those of one process, greedy and seeded."""
    from tests.duet.test_batch_invariant import GREEDY, SEEDED, TARGET, _signature, check_alone_and_in_batches

    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, num_hidden_layers=3, hidden_size=256, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=256)
    settings = dict(model=str(model_dir), batch_invariant=True, max_model_len=512, max_num_batched_tokens=64)
    local = LLM(**settings)
    alone = {params.temperature: _signature(local.generate([TARGET], params)[0]) for params in (GREEDY, SEEDED)}
    pp2 = LLM(**settings, pipeline_parallel_size=2)
    try:
        check_alone_and_in_batches(pp2, alone)
    finally:
        pp2.engine.close()


@pytest.mark.slow
def test_tp2_inside_each_of_two_stages_matches_transformers_and_tp2(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """Four ranks: two stages (1 + 2 layers), each split over two ranks (6 heads over 3 KV heads,
    3 + 6); hidden states go from a stage's rank to the same place in the next."""
    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, num_hidden_layers=3, hidden_size=192, num_attention_heads=6,
                                num_key_value_heads=3, intermediate_size=256)
    references = hf_greedy(model_dir, PROMPTS, 10)
    settings = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2)
    outputs = {}
    for stages in (2, 1):
        llm = LLM(**settings, pipeline_parallel_size=stages)
        try:
            outputs[stages] = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, _greedy())]
            llm.engine.check_integrity()
        finally:
            llm.engine.close()
    for index, (tokens, reference) in enumerate(zip(outputs[2], references)):
        assert compare_to_reference(tokens, reference, f"prompt {index}") is None
    assert outputs[2] == outputs[1]  # the stages add nothing to tensor parallelism's arithmetic


@pytest.mark.slow
def test_smollm2_at_pp2_matches_transformers(ray_cluster, smollm2_dir, parity_prompts, parity_references):
    from duet.benchmarks.prompts import PARITY_NEW_TOKENS

    llm = LLM(model=str(smollm2_dir), num_kv_blocks=256, max_model_len=1024, pipeline_parallel_size=2)
    try:
        outputs = llm.generate(parity_prompts, _greedy(PARITY_NEW_TOKENS))
        for index, (output, reference) in enumerate(zip(outputs, parity_references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"prompt {index}") is None
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_pp2_with_ngram_speculation_matches_one_process(ray_cluster, tmp_path, tiny_tokenizer_dir):
    """The last stage verifies the drafts and proposes the next ones; every stage takes the same
    accepted tokens (a variable number per request) and rolls back the same rejected ones."""
    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, num_hidden_layers=3)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}
    settings = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    prompts = [list(range(40, 52)) * 3, [7, 8, 9] * 9, PROMPTS[1], PROMPTS[4]]
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=24)
    pp2 = LLM(**settings, pipeline_parallel_size=2, speculative_config=ngram)
    try:
        greedy = [output.outputs[0].token_ids for output in pp2.generate(prompts, _greedy(24))]
        sampled = [output.outputs[0].token_ids for output in pp2.generate(prompts, seeded)]
        stats = pp2.engine.stats()
        pp2.engine.check_integrity()
        # What `duet bench parallel` reports: each stage's time waiting on the other, and how often.
        waits = ray.get([worker.collective_stats.remote() for worker in pp2.engine.executor.workers])
        assert all(seconds > 0 and calls > 0 for seconds, calls in waits), waits
    finally:
        pp2.engine.close()
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens, stats
    assert greedy == [output.outputs[0].token_ids for output in LLM(**settings).generate(prompts, _greedy(24))]
    assert sampled == [output.outputs[0].token_ids for output in LLM(**settings, speculative_config=ngram).generate(prompts, seeded)]


def _disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params, timeout_s: float = 300) -> list[list[int]]:
    """Each prompt prefilled by ``prefill`` and decoded by ``decode``, both stepped here in turn
    (their workers move the KV on threads of their own), as the router drives two replicas."""
    ids = [f"r{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        destination = decode.add_request(EngineRequest(request_id, prompt, params, kv_receive=True))
        prefill.add_request(EngineRequest(request_id, prompt, params, kv_send=destination))
    first, rest = {request_id: [] for request_id in ids}, {request_id: [] for request_id in ids}
    deadline = time.monotonic() + timeout_s
    while (prefill.has_unfinished_requests() or decode.has_unfinished_requests()) and time.monotonic() < deadline:
        for engine, tokens in ((prefill, first), (decode, rest)):
            for delta in engine.step():
                assert delta.error is None and not delta.kv_lost, delta
                tokens[delta.request_id] += delta.token_ids
    assert not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()), "unfinished after the deadline"
    for engine in (prefill, decode):
        engine.check_integrity()
    return [first[request_id] + rest[request_id] for request_id in ids]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["pp2-to-pp1", "pp1-to-pp2"])
def test_pd_between_pipeline_stages_and_one_worker_gives_the_single_process_tokens(ray_cluster, tmp_path, tiny_tokenizer_dir, layout):
    """A prompt's KV leaves each prefill stage with its own layers (3 layers split 1 + 2) for a
    decode worker that holds them all, or one decode worker's KV splits over the stages that
    hold each layer; the first token travels with it, and decode speculates (n-gram). Tokens as
    one process gives them."""
    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, num_hidden_layers=3)
    settings = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    expected = [output.outputs[0].token_ids for output in LLM(**settings).generate(PROMPTS, _greedy())]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    engines = [
        LLMEngine(EngineArgs(
            **settings, pipeline_parallel_size=size, kv_transfer_config={"name": name, "timeout_s": 30.0},
            speculative_config=ngram if name == "decode" else None,
        ))
        for size, name in zip(layout, ("prefill", "decode"))
    ]
    try:
        assert _disaggregated(*engines, PROMPTS, _greedy()) == expected
        assert engines[0].scheduler.kv_connector.counters.transfers == len(PROMPTS)
        assert engines[1].stats().spec.num_draft_tokens > 0
    finally:
        for engine in engines:
            engine.close()
