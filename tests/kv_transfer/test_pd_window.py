"""A model whose every layer has a sliding window, through prefill and decode engines over gloo:
the transfer ships only the blocks the decode side's next step reads (those of the window before
it), by a prompt's streamed KV and by a live migration, with transformers' tokens."""

from __future__ import annotations

import pytest

from duet import LLM, SamplingParams
from duet.engine_process import EngineProcess
from duet.messages import EngineRequest
from tests.conftest import make_tiny_model
from tests.kv_transfer.pd_harness import migrate_live, run_disaggregated
from tests.kv_transfer.test_pd_tiny import _decode, _engine_kwargs
from tests.reference import compare_to_reference, hf_greedy

# Window 20, blocks of 16. The first context is 70 tokens (the decode side's first step at
# position 70 reads keys 51 on: blocks 3 and 4 of 5), the second 5 (one block, all read), the
# third 48 (keys 29 on: blocks 1 and 2 of 3).
PROMPTS = [list(range(100, 170)), [1, 5, 9, 200, 31], list(range(300, 348))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30)

pytestmark = pytest.mark.slow  # two engines in processes of their own


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_model(tmp_path_factory.mktemp("mistral"), tiny_tokenizer_dir, "mistral-windowed")


def _block_bytes(engine) -> int:
    arch = engine.model_config
    return arch.num_layers * 2 * arch.num_kv_heads * engine.block_size * arch.head_dim * 4


def _read_blocks(num_tokens: int, window: int = 20, block_size: int = 16) -> int:
    """Blocks of a ``num_tokens`` context that a step at position ``num_tokens`` reads."""
    return -(-num_tokens // block_size) - max(0, num_tokens - window + 1) // block_size


def test_a_prompt_past_the_window_ships_only_the_blocks_decode_reads(mistral):
    """Guards the skipped blocks on both sides: the tokens are transformers' and the colocated
    engine's, and the decode side received 2 + 1 + 2 blocks' KV, not 5 + 1 + 3."""
    references = hf_greedy(mistral, PROMPTS, 30)
    prefill = EngineProcess(_engine_kwargs(mistral, "prefill-window", max_num_batched_tokens=32))
    try:
        decode = _decode(mistral, "decode-window")
        run = run_disaggregated(prefill, decode, PROMPTS, GREEDY)
        assert run.lost == []
        for tokens, reference, prompt in zip(run.tokens, references, PROMPTS):
            assert compare_to_reference(tokens, reference, f"PD, {len(prompt)}-token prompt") is None
        colocated = LLM(model=str(mistral), max_model_len=512).generate(PROMPTS, GREEDY)
        assert run.tokens == [output.outputs[0].token_ids for output in colocated]
        assert [_read_blocks(len(prompt)) for prompt in PROMPTS] == [2, 1, 2]
        assert decode.stats().transfer.bytes == 5 * _block_bytes(decode)
        decode.check_integrity()
        decode.close()
    finally:
        prefill.stop()  # checks the prefill engine's blocks too


def test_a_windowed_sequence_migrates_with_only_its_window(mistral):
    """A decoding sequence of 70 + 6 or more tokens moves by KV: the target gets the blocks of its
    window and goes on as if it had not moved."""
    source = EngineProcess(_engine_kwargs(mistral, "decode-window-src"))
    target = _decode(mistral, "decode-window-dst")
    prompt = PROMPTS[0]
    undisturbed = LLM(model=str(mistral), max_model_len=512).generate([prompt], GREEDY)[0].outputs[0].token_ids
    try:
        held, rest = migrate_live(source, target, EngineRequest("m", prompt, GREEDY))
        assert held + rest == undisturbed
        context = len(prompt) + len(held) - 1  # the target's first step computes the last token
        assert target.stats().transfer.bytes == _read_blocks(context) * _block_bytes(target)
        target.check_integrity()
    finally:
        source.stop()
        target.close()
