"""Prefill and decode in two processes over gloo give the colocated engine's tokens (tiny Llama)."""

from __future__ import annotations

import pytest

from duet import LLM, SamplingParams
from duet.config import EngineArgs
from duet.decode_node.node import DecodeNode
from duet.prefill_node.process import PrefillProcess
from tests.decode_node.pd_harness import doomed_prefill, run_disaggregated
from tests.reference import compare_to_reference, hf_greedy

# Lengths 5, 33 and 70 end in partial blocks; 48 fills its last block exactly.
PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(3000, 3048))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)


def _engine_kwargs(model_dir, **overrides) -> dict:
    return dict(model=str(model_dir), num_kv_blocks=128, max_model_len=512) | overrides


@pytest.fixture(scope="module")
def references(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, 10)


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir):
    process = PrefillProcess(_engine_kwargs(tiny_llama_dir))
    yield process
    process.stop()


def test_disaggregated_greedy_matches_transformers_and_colocated(prefill, tiny_llama_dir, references):
    decode = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir)), "decode-0")
    tokens = run_disaggregated(prefill, decode, PROMPTS, GREEDY).tokens
    for index, (got, reference) in enumerate(zip(tokens, references)):
        assert compare_to_reference(got, reference, f"PD prompt {index}") is None
    colocated = LLM(model=str(tiny_llama_dir), max_model_len=512).generate(PROMPTS, GREEDY)
    assert tokens == [output.outputs[0].token_ids for output in colocated]
    decode.check_integrity()
    decode.close()
    assert decode.receiver.stats.transfers == len(PROMPTS)


def test_streamed_kv_while_prefill_computes_matches_transformers(prefill, tiny_llama_dir, references):
    """Decode chosen first: KV streams in layer runs during the prefill's last chunk."""
    decode = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir)), "decode-6")
    tokens = run_disaggregated(prefill, decode, PROMPTS, GREEDY, stream=True).tokens
    for index, (got, reference) in enumerate(zip(tokens, references)):
        assert compare_to_reference(got, reference, f"streamed PD prompt {index}") is None
    assert decode.receiver.stats.transfers == len(PROMPTS)
    decode.check_integrity()
    decode.close()


def test_prefix_hit_on_prefill_still_sends_every_block(prefill, tiny_llama_dir):
    """The second run hits the prefill prefix cache; decode must still get the whole prompt."""
    decode = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir)), "decode-1")
    prompt = list(range(5000, 5070))  # not seen by the prefill node before
    reference = hf_greedy(tiny_llama_dir, [prompt], 10)[0]
    first = run_disaggregated(prefill, decode, [prompt], GREEDY)
    again = run_disaggregated(prefill, decode, [prompt], GREEDY)
    assert (first.num_cached_tokens, again.num_cached_tokens) == ([0], [64])  # 70 tokens: 4 full blocks hit
    assert compare_to_reference(again.tokens[0], reference, "PD prefix hit") is None
    assert first.tokens == again.tokens
    assert decode.receiver.stats.bytes == 2 * _prompt_kv_bytes(decode, len(prompt))
    decode.check_integrity()
    decode.close()


def test_mismatched_block_size_fails_clearly_or_recomputes(prefill, tiny_llama_dir, references):
    """Guards the handshake: a decode pool with another block size never scatters foreign KV."""
    failing = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir, block_size=32)), "decode-2", on_transfer_failure="fail")
    assert run_disaggregated(prefill, failing, PROMPTS[:1], GREEDY).tokens == [None]
    assert "block_size: here 32, peer 16" in failing.failures[0].error
    failing.check_integrity()
    failing.close()
    recomputing = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir, block_size=32)), "decode-3")
    tokens = run_disaggregated(prefill, recomputing, PROMPTS[:1], GREEDY).tokens
    assert compare_to_reference(tokens[0], references[0], "recomputed after refused handshake") is None
    recomputing.check_integrity()
    recomputing.close()


def test_prefill_killed_mid_transfer_times_out_and_recomputes(tiny_llama_dir, references):
    """Guards against a decode replica waiting forever, or leaking blocks, when prefill dies."""
    doomed = doomed_prefill(_engine_kwargs(tiny_llama_dir))
    decode = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir)), "decode-4", transfer_timeout_s=3)
    tokens = run_disaggregated(doomed, decode, PROMPTS[1:2], GREEDY, timeout_s=120).tokens
    doomed.process.join(10)
    assert compare_to_reference(tokens[0], references[1], "recomputed after prefill died") is None
    assert decode.receiver.stats.failures == 1
    decode.check_integrity()
    decode.close()


def test_short_prompts_prefill_locally_on_the_decode_node(tiny_llama_dir, references):
    """The local-prefill path skips the prefill pool and still matches the oracle."""
    decode = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir)), "decode-5", local_prefill_threshold=16)
    assert decode.wants_local_prefill(len(PROMPTS[0])) and not decode.wants_local_prefill(len(PROMPTS[1]))
    decode.submit_local("local", PROMPTS[0], GREEDY)
    outputs = []
    for _ in range(100):
        outputs += [o for o in decode.step() if o.finished]
        if outputs:
            break
    assert compare_to_reference(outputs[0].outputs[0].token_ids, references[0], "local prefill") is None
    assert decode.receiver.stats.transfers == 0
    decode.check_integrity()
    decode.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_draft_model_on_the_decode_node_computes_its_own_prompt_kv(stream, prefill, tiny_llama_dir, references):
    """The prefill replica knows nothing of speculation; the decode node computes the draft's KV
    for the transferred prompt itself. With the target as its own draft every draft token must
    then be accepted, which it would not be over wrong draft KV. (n-gram speculation over PD is
    exercised with SmolLM2 by the cluster tests: a random model gives it nothing to match.)"""
    config = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False, "model": str(tiny_llama_dir)}
    decode = DecodeNode(EngineArgs(**_engine_kwargs(tiny_llama_dir, speculative_config=config)), f"decode-draft-{stream}")
    tokens = run_disaggregated(prefill, decode, PROMPTS, GREEDY, stream=stream).tokens
    for index, (got, reference) in enumerate(zip(tokens, references)):
        assert compare_to_reference(got, reference, f"PD draft_model prompt {index}") is None
    spec = decode.engine.scheduler.spec_stats
    assert spec.num_drafts >= len(PROMPTS)
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert decode.receiver.stats.transfers == len(PROMPTS)
    decode.check_integrity()
    decode.close()


def _prompt_kv_bytes(node, num_tokens: int) -> int:
    """Bytes on the wire for a prompt: whole blocks, K and V, every layer."""
    cache = node.engine.runner.kv_cache
    num_layers, _, num_kv_heads, _, block_size, head_dim = cache.shape
    num_blocks = -(-num_tokens // block_size)
    return num_layers * 2 * num_kv_heads * num_blocks * block_size * head_dim * cache.element_size()
