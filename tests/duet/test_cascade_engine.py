"""Cascade attention in an engine: decode steps whose sequences share a cached prefix attend to it
once for the group (``duet.kernels.cascade``), and greedy tokens stay transformers'."""

from __future__ import annotations

import random

import pytest

from duet import LLM, SamplingParams
from duet.config import ConfigError, EngineArgs
from duet.kernels import cpu_ops
from tests.conftest import TINY_VOCAB, make_tiny_llama
from tests.reference import compare_to_reference, hf_greedy

NEW_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def wide_heads_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama with heads of 64 (the C++ decode kernel's, which cascades), two query heads a KV head."""
    return make_tiny_llama(tmp_path_factory.mktemp("cascade-llama"), tiny_tokenizer_dir, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2)


@pytest.fixture(scope="module")
def shared_prefix_prompts() -> list[list[int]]:
    """Eight prompts of one 150-token prefix (9 whole blocks) and a question of their own."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(150)]
    return [prefix + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(8)]


def _generate(model_dir, prompts, **engine_kwargs):
    """The first prompt alone (its prefix cached), then all of them batched: their decode steps share its blocks."""
    llm = LLM(model=str(model_dir), max_model_len=512, **engine_kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm.generate(prompts[:1], greedy)
    outputs = llm.generate(prompts, greedy)
    llm.engine.check_integrity()
    return [output.outputs[0].token_ids for output in outputs], llm.engine.executor.worker.runner.cascade


@pytest.mark.slow
@pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU kernels do not build here")
@pytest.mark.parametrize("speculation", [None, NGRAM], ids=["plain", "ngram"])
def test_forced_cascade_gives_transformers_greedy_tokens(wide_heads_llama_dir, shared_prefix_prompts, speculation):
    settings = {} if speculation is None else {"speculative_config": speculation}
    tokens, planner = _generate(wide_heads_llama_dir, shared_prefix_prompts, cascade_attention="on", **settings)
    assert planner.num_groups >= NEW_TOKENS // 4, "the batched decode steps should cascade over the shared prefix"
    references = hf_greedy(wide_heads_llama_dir, shared_prefix_prompts, NEW_TOKENS)
    for index, (got, reference) in enumerate(zip(tokens, references)):
        compare_to_reference(got, reference, f"cascade {index}")
    plain, no_planner = _generate(wide_heads_llama_dir, shared_prefix_prompts, cascade_attention="off", **settings)
    assert no_planner is None and plain == tokens


def test_cascade_attention_is_checked_against_batch_invariance():
    with pytest.raises(ConfigError, match="cascade_attention must be auto, on or off"):
        EngineArgs(cascade_attention="yes")
    with pytest.raises(ConfigError, match="batch_invariant forbids"):
        EngineArgs(cascade_attention="on", batch_invariant=True)
    EngineArgs(cascade_attention="auto", batch_invariant=True)  # auto is off under batch invariance
