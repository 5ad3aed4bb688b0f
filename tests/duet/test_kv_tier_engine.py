"""The second KV tier in an engine: conversations whose earlier turns were evicted from a small
pool come back from the tier, and give bit for bit what a pool large enough to keep them gives."""

from __future__ import annotations

import random

import pytest

from duet import LLM, SamplingParams
from tests.conftest import TINY_VOCAB

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
TURN_TOKENS = 16


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS, min_tokens=TURN_TOKENS, logprobs=2)


def _conversations(llm: LLM, sessions: int = 5, turns: int = 3) -> list[list[tuple[list[int], dict]]]:
    """Each session's turns, one request at a time (so every engine batches them the same): the
    history, then the new user tokens, as a chat client sends them."""
    rng = random.Random(7)
    histories = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(60, 90))] for _ in range(sessions)]
    outputs = [[] for _ in range(sessions)]
    for _ in range(turns):
        for session, history in enumerate(histories):
            output = llm.generate([history], _greedy())[0].outputs[0]
            outputs[session].append((output.token_ids, output.logprobs))
            history += output.token_ids + [rng.randrange(3, TINY_VOCAB) for _ in range(12)]
    return outputs


@pytest.mark.parametrize("tier", ["cpu", "disk", "cpu+ngram"])
def test_evicted_turns_come_back_from_the_tier_bit_for_bit(tiny_llama_dir, tmp_path, tier):
    """Five sessions of about 7 blocks each a turn against a pool of 16 blocks: every later
    turn's history was evicted by the other sessions. The tier restores it, and each turn's
    tokens and logprobs equal those of a pool that kept everything."""
    settings = {"speculative_config": NGRAM} if tier.endswith("ngram") else {}
    offload = {"tier": "disk", "size_gib": 0.05, "path": str(tmp_path)} if tier == "disk" else {"tier": "cpu", "size_gib": 0.05}
    kept = _conversations(LLM(model=str(tiny_llama_dir), num_kv_blocks=512, max_model_len=512, **settings))
    small = LLM(model=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=512, kv_offload=offload, **settings)
    assert _conversations(small) == kept
    stats = small.engine.stats().kv
    assert stats.tier_restored_blocks >= 4 * 2 * 4  # four sessions' later turns, at least 4 blocks each
    assert stats.tier_saved_blocks >= stats.tier_blocks > 0
    small.engine.check_integrity()


def test_without_the_tier_the_small_pool_recomputes_the_same_tokens(tiny_llama_dir):
    """The oracle the tier is measured against: the same conversations on the small pool alone
    (every later turn recomputed) give the same tokens."""
    kept_llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=512, max_model_len=512)
    kept = _conversations(kept_llm)
    small = LLM(model=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=512)
    recomputed = _conversations(small)
    assert [[tokens for tokens, _ in turns] for turns in recomputed] == [[tokens for tokens, _ in turns] for turns in kept]
    assert small.engine.stats().kv.prefix_cache_hits < kept_llm.engine.stats().kv.prefix_cache_hits / 2  # recomputed


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_each_rank_keeps_its_own_share_of_the_tier(ray_cluster, tiny_llama_dir, layout):
    """Ranks as Ray actors, each with its heads (TP) or its layers (PP) in its own store: the
    scheduler's copies name the same slots on every rank, and the restored turns give the same
    tokens. Logprobs are compared to 1e-4, not bit for bit: each engine's ranks are new processes,
    and each process picks its product kernels by timing them (``duet.models.linear``), so two
    engines' ranks may add in another order (#45); in one process the choice is shared."""
    kept_llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=512, max_model_len=512, **layout)
    try:
        kept = _conversations(kept_llm, sessions=4, turns=2)
    finally:
        kept_llm.engine.close()
    small = LLM(model=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=512, kv_offload={"tier": "cpu", "size_gib": 0.05}, **layout)
    try:
        restored = _conversations(small, sessions=4, turns=2)
        assert [[tokens for tokens, _ in turns] for turns in restored] == [[tokens for tokens, _ in turns] for turns in kept]
        for turns, kept_turns in zip(restored, kept):
            for (_, logprobs), (_, kept_logprobs) in zip(turns, kept_turns):
                for position, kept_position in zip(logprobs, kept_logprobs):
                    assert position.keys() == kept_position.keys()
                    assert all(abs(position[token] - kept_position[token]) < 1e-4 for token in position)
        assert small.engine.stats().kv.tier_restored_blocks >= 4  # at least the first session came back
        small.engine.check_integrity()
    finally:
        small.engine.close()


def test_an_int8_tier_holds_about_4x_the_blocks_and_restores_turns_within_the_int8_caches_rounding(tiny_llama_dir):
    """``kv_offload.dtype: int8`` keeps an fp32 pool's evicted rows as the int8 KV cache does
    (``head_dim + 1`` bytes a row of ``head_dim`` floats): the same ``size_gib`` holds 3.76x the
    blocks at the tiny model's 16-wide heads. Not exact: restored turns' tokens and logprobs come
    within that cache's rounding of a pool that kept everything (measured on this model: first
    logprobs within 3e-3, every token the same; asserted with room)."""
    kept = _conversations(LLM(model=str(tiny_llama_dir), num_kv_blocks=512, max_model_len=512))
    offload = {"tier": "cpu", "size_gib": 0.05}
    small = LLM(model=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=512, kv_offload=offload | {"dtype": "int8"})
    restored = _conversations(small)
    head_dim, fp32_block = small.engine.model_config.head_dim, small.engine.kv_bytes_per_block
    assert small.engine.stats().kv.tier_capacity_blocks == int(0.05 * 2**30) // (fp32_block // (4 * head_dim) * (head_dim + 1))
    assert small.engine.stats().kv.tier_capacity_blocks > 3.7 * int(0.05 * 2**30) // fp32_block
    assert small.engine.stats().kv.tier_restored_blocks >= 4 * 2 * 4
    same = total = 0
    for turns, kept_turns in zip(restored, kept):
        for (tokens, logprobs), (kept_tokens, kept_logprobs) in zip(turns, kept_turns):
            same += sum(a == b for a, b in zip(tokens, kept_tokens))
            total += len(kept_tokens)
            first = kept_tokens[0]
            assert abs(logprobs[0][first] - kept_logprobs[0][first]) < 0.02
    assert same >= 0.9 * total
    small.engine.check_integrity()
