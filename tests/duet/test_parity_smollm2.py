"""Greedy output equals transformers token for token on SmolLM2, however the engine batches.

Each case runs the same 16 chat prompts (19 to 572 tokens, 64 new tokens each) through
the engine under one scheduling regime and compares with transformers' greedy generate.
SmolLM2 computes its decode steps from its GGUF blocks by default (``tests/duet/test_gguf.py``);
one case keeps the dequantized float weights alone.
"""

from __future__ import annotations

import gc

import pytest

from duet import LLM, SamplingParams
from duet.kernels import cpu_ops
from duet.benchmarks.prompts import PARITY_NEW_TOKENS, encode_conversations, shared_prefix_conversations
from tests.reference import compare_to_reference, hf_greedy

pytestmark = pytest.mark.slow

# min_tokens bars EOS exactly as transformers' min_new_tokens does.
GREEDY = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS, min_tokens=PARITY_NEW_TOKENS)


@pytest.fixture(scope="module")
def shared_prompts(smollm2_tokenizer) -> list[list[int]]:
    return encode_conversations(smollm2_tokenizer, shared_prefix_conversations())


@pytest.fixture(scope="module")
def shared_references(smollm2_dir, shared_prompts):
    return hf_greedy(smollm2_dir, shared_prompts, PARITY_NEW_TOKENS, processes=2)


def _check(outputs, refs, label) -> list[str]:
    notes = []
    for index, (output, ref) in enumerate(zip(outputs, refs)):
        note = compare_to_reference(output.outputs[0].token_ids, ref, f"{label} prompt {index}")
        if note:
            notes.append(note)
    for note in notes:
        print(note)
    return notes


def _run(engine_kwargs, prompts, one_at_a_time=False):
    llm = LLM(model="smollm2", max_model_len=1024, **engine_kwargs)
    if one_at_a_time:
        outputs = [llm.generate([prompt], GREEDY)[0] for prompt in prompts]
    else:
        outputs = llm.generate(prompts, GREEDY)
    llm.engine.check_integrity()
    stats = (llm.engine.scheduler.num_preemptions, llm.engine.kv_cache_manager.prefix_cache_hits)
    del llm
    gc.collect()
    return outputs, stats


def test_one_request_at_a_time_matches_transformers(parity_prompts, parity_references):
    outputs, _ = _run({}, parity_prompts, one_at_a_time=True)
    _check(outputs, parity_references, "sequential")


def test_all_requests_batched_together_match_transformers(parity_prompts, parity_references):
    outputs, _ = _run({"enable_prefix_caching": False}, parity_prompts)
    _check(outputs, parity_references, "batched")


def test_the_dequantized_float_weights_alone_match_transformers(parity_prompts, parity_references):
    outputs, _ = _run({"enable_prefix_caching": False, "quantization": "dequantized"}, parity_prompts)
    _check(outputs, parity_references, "dequantized, batched")
    outputs, _ = _run({"quantization": "dequantized"}, parity_prompts[:4], one_at_a_time=True)
    _check(outputs, parity_references[:4], "dequantized, sequential")


def test_chunked_prefill_with_32_token_budget_matches_transformers(parity_prompts, parity_references):
    outputs, _ = _run({"max_num_batched_tokens": 32, "enable_prefix_caching": False}, parity_prompts)
    _check(outputs, parity_references, "chunked")


def test_preemption_under_a_small_kv_pool_matches_transformers(parity_prompts, parity_references):
    # 60 blocks hold 960 tokens: the two longest prompts plus growth cannot all stay resident.
    outputs, (num_preemptions, _) = _run({"num_kv_blocks": 60, "enable_prefix_caching": False}, parity_prompts)
    assert num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    _check(outputs, parity_references, "preempted")


def test_shared_prefix_cache_hits_match_transformers(shared_prompts, shared_references):
    outputs, (_, hit_tokens) = _run({}, shared_prompts, one_at_a_time=True)
    assert hit_tokens >= 16 * 7 * (len(shared_prompts[0]) // 32), "later prompts should hit the shared system prompt"
    assert all(output.num_cached_tokens > 0 for output in outputs[1:])
    _check(outputs, shared_references, "prefix-hit")


@pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU kernels do not build here")
def test_shared_prefix_decoded_by_cascade_attention_matches_transformers(shared_prompts, shared_references):
    """The first prompt alone caches the system prompt; the other 15 then decode together over its
    blocks, with cascade attention forced on (its products over the shared prefix, once a group)."""
    llm = LLM(model="smollm2", max_model_len=1024, cascade_attention="on")
    outputs = llm.generate(shared_prompts[:1], GREEDY) + llm.generate(shared_prompts[1:], GREEDY)
    planner = llm.engine.executor.worker.runner.cascade
    llm.engine.check_integrity()
    assert planner.num_groups >= PARITY_NEW_TOKENS // 2, "the batched decode steps should cascade over the system prompt"
    del llm
    gc.collect()
    _check(outputs, shared_references, "cascade")
