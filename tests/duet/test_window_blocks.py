"""A model whose every layer has a sliding window (Mistral's) gives back the KV blocks its
sequences have left behind: a sequence far longer than its window runs in a cache too small for
all of it, holding a bounded number of blocks, with transformers' tokens; a draft model without
a window drafts from the window the target keeps; a prefix whose first blocks were evicted is
still a hit where its window's blocks are cached. Models with a global layer (Gemma's) keep all."""

from __future__ import annotations

import pytest

from duet import LLM, SamplingParams
from duet.block_pool import hash_block_tokens
from duet.errors import InvalidRequestError
from duet.messages import EngineRequest
from duet.models.loader import read_arch
from tests.conftest import make_tiny_model
from tests.reference import compare_to_reference, hf_greedy

PROMPT = list(range(100, 170))  # 70 tokens past a window of 20
NEW_TOKENS = 100  # 170 tokens: 11 blocks of 16
CHUNK = 32


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tiny_tokenizer_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("mistral"), tiny_tokenizer_dir, "mistral-windowed")
    return path, hf_greedy(path, [PROMPT], NEW_TOKENS)[0]


def _run(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """The request's tokens, and the most pool blocks it held after any step; after each, the
    runner's block table is the scheduler's (the null block where blocks went back)."""
    engine = llm.engine
    runner = engine.executor.worker.runner
    engine.add_request(EngineRequest("w", prompt, params))
    tokens, most = [], 0
    for _ in range(4 * NEW_TOKENS):  # bounded: a step gives at least one token or a prompt chunk
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            tokens += delta.token_ids
        manager = engine.kv_cache_manager
        most = max(most, manager.num_held_blocks("w"))
        if "w" in runner.requests and manager.block_ids("w"):
            held = manager.block_ids("w")
            assert runner.requests["w"].block_ids[: len(held)] == held
        engine.check_integrity()
    assert not engine.has_unfinished_requests()
    return tokens, most


def test_a_sequence_past_its_window_holds_a_bounded_number_of_blocks_with_transformers_tokens(mistral):
    """Guards the freeing and the tables' null block against transformers: 170 tokens need 11
    blocks, the cache has 7 (8 less the null one), and the 32-token chunks and the window of 20
    span at most 5 at a time. Without the freeing the request could not run at all."""
    path, reference = mistral
    assert read_arch(path).kv_window == 20
    llm = LLM(model=str(path), num_kv_blocks=8, max_model_len=512, max_num_batched_tokens=CHUNK)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    tokens, most = _run(llm, PROMPT, params)
    assert compare_to_reference(tokens, reference, "windowed Mistral in 7 blocks") is None
    assert most <= -(-(20 - 1 + CHUNK) // 16) + 1 == 5
    assert llm.engine.kv_cache_manager.num_free_blocks == 7


def test_a_draft_without_a_window_drafts_from_what_the_target_keeps(mistral, tmp_path, tiny_tokenizer_dir):
    """Guards ``narrow_windows``: the draft has the target's weights but no window, so narrowed to
    the target's 20 keys it drafts the target's own tokens and nearly every draft is accepted;
    left whole, it would read the null block where the target's first blocks were."""
    path, reference = mistral
    draft = make_tiny_model(tmp_path / "draft", tiny_tokenizer_dir, "mistral-windowed", sliding_window=None)
    assert read_arch(draft).kv_window is None
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft), "adaptive": False}
    llm = LLM(model=str(path), num_kv_blocks=8, max_model_len=512, max_num_batched_tokens=CHUNK, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    tokens, most = _run(llm, PROMPT, params)
    assert compare_to_reference(tokens, reference, "windowed Mistral with a draft") is None
    spec = llm.engine.stats().spec
    assert spec.num_draft_tokens > 60 and spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens
    assert most <= -(-(20 - 1 + CHUNK + 3) // 16) + 1


def test_a_model_with_a_global_layer_keeps_every_block(tmp_path, tiny_tokenizer_dir):
    """Gemma 3's global layer reads every key: nothing is freed, and a request that needs more
    blocks than the cache has is refused up front, as without a window."""
    path = make_tiny_model(tmp_path / "gemma3", tiny_tokenizer_dir, "gemma3")
    assert read_arch(path).kv_window is None
    llm = LLM(model=str(path), num_kv_blocks=8, max_model_len=512, max_num_batched_tokens=CHUNK)
    with pytest.raises(InvalidRequestError, match="needs up to 11 KV blocks but the cache has 8"):
        llm.engine.validate(PROMPT, SamplingParams(max_tokens=NEW_TOKENS))


def test_a_prefix_whose_first_blocks_were_evicted_is_still_a_hit_within_the_window(mistral):
    """Guards the windowed lookup end to end: after the 170-token sequence ran through the 7-block
    cache (its first blocks long evicted), a prompt that repeats its first 160 tokens finds the
    blocks its window reads cached, computes only the rest, and gives transformers' tokens."""
    path, reference = mistral
    llm = LLM(model=str(path), num_kv_blocks=8, max_model_len=512, max_num_batched_tokens=CHUNK)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    tokens, _ = _run(llm, PROMPT, params)
    prompt = PROMPT + tokens[:90] + [5, 6]  # 162 tokens: blocks 0-9 full
    manager = llm.engine.kv_cache_manager
    assert manager.block_pool.get_cached_block(hash_block_tokens(None, prompt[:16]), prompt[:16]) is None  # evicted
    (expected,) = hf_greedy(path, [prompt], 10)
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10))[0]
    assert output.num_cached_tokens == 160
    assert compare_to_reference(list(output.outputs[0].token_ids), expected, "windowed prefix hit") is None
    llm.engine.check_integrity()
