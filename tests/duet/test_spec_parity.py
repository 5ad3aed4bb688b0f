"""Greedy output with speculation on equals the engine with it off, and transformers, token for token.

The same 16 SmolLM2 chat prompts as the parity tests (64 new tokens each; every other one for
the methods that draft with a model), under each method and under the scheduling regimes
speculation must live with: chunked prefill with a budget smaller than the drafts, preemption,
prefix-cache hits. The draft model is a second checkpoint sharing SmolLM2's tokenizer:
SmolLM2's first 8 layers saved on their own, so that drafts are right often enough for partial
acceptance to be exercised.
"""

from __future__ import annotations

import gc

import pytest

from duet import LLM
from tests.duet.test_parity_smollm2 import GREEDY, _check

pytestmark = pytest.mark.slow

# Without the adaptive rule every eligible request drafts fully, whatever its acceptance.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive": False}


@pytest.fixture(scope="module")
def smollm2_first_layers_dir(tmp_path_factory, smollm2_dir):
    from duet.models.loader import save_first_layers

    return save_first_layers(smollm2_dir, tmp_path_factory.mktemp("smollm2-8-layers"), num_layers=8)


@pytest.fixture(scope="module")
def unspeculated(parity_prompts):
    outputs, _ = _run(None, parity_prompts, enable_prefix_caching=False)
    return [output.outputs[0].token_ids for output in outputs]


def _run(speculative_config, prompts, one_at_a_time=False, **engine_kwargs):
    llm = LLM(model="smollm2", max_model_len=1024, speculative_config=speculative_config, **engine_kwargs)
    if one_at_a_time:
        outputs = [llm.generate([prompt], GREEDY)[0] for prompt in prompts]
    else:
        outputs = llm.generate(prompts, GREEDY)
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    del llm
    gc.collect()
    return outputs, stats


def _check_speculated(outputs, stats, references, unspeculated, label):
    _check(outputs, references, label)
    assert [output.outputs[0].token_ids for output in outputs] == unspeculated
    # Speculation happened, and drafts were both kept and rejected.
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens, stats
    print(label, stats.spec)


@pytest.mark.parametrize(
    "label, config",
    [
        ("ngram", NGRAM),
        ("layer_skip", {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 24, "adaptive": False}),
        ("draft_model", {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}),
    ],
)
def test_each_method_matches_unspeculated_and_transformers(
    label, config, parity_prompts, parity_references, unspeculated, smollm2_first_layers_dir
):
    if label == "draft_model":
        config = config | {"model": str(smollm2_first_layers_dir)}
    # The model-drafting methods on every other prompt: each step of theirs costs several of
    # the target's, and 8 prompts keep both accepted and rejected drafts (22 s each method on
    # a 2-core AVX2-only EPYC).
    chosen = slice(None) if label == "ngram" else slice(None, None, 2)
    outputs, stats = _run(config, parity_prompts[chosen], enable_prefix_caching=False)
    _check_speculated(outputs, stats, parity_references[chosen], unspeculated[chosen], label)


def test_budget_smaller_than_the_drafts_matches(parity_prompts, parity_references, unspeculated):
    # 16 requests at 1 + 4 tokens each exceed 24: later requests get fewer drafts, or none.
    outputs, stats = _run(NGRAM, parity_prompts, max_num_batched_tokens=24, enable_prefix_caching=False)
    _check_speculated(outputs, stats, parity_references, unspeculated, "ngram chunked")


def test_preemption_with_drafts_in_flight_matches(parity_prompts, parity_references, unspeculated):
    outputs, stats = _run(NGRAM, parity_prompts, num_kv_blocks=60, enable_prefix_caching=False)
    assert stats.scheduler.num_preemptions > 0
    _check_speculated(outputs, stats, parity_references, unspeculated, "ngram preempted")


def test_prefix_cache_hits_with_a_draft_model_match(parity_prompts, parity_references, unspeculated, smollm2_first_layers_dir):
    """The draft computes its own KV for the prompt even where the target's came from the prefix cache."""
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(smollm2_first_layers_dir), "adaptive": False}
    order = [0, 1, 2, 0, 1]
    outputs, stats = _run(config, [parity_prompts[i] for i in order], one_at_a_time=True)
    assert stats.kv.prefix_cache_hits > 0
    references = [parity_references[i] for i in order]
    _check_speculated(outputs, stats, references, [unspeculated[i] for i in order], "draft prefix-hit")


def test_stop_string_inside_an_accepted_run_ends_the_output_there():
    """Drafts copy the quoted sentence, so a stop string lands mid-run: text, tokens and
    finish reason must be those of the engine without speculation."""
    from duet import SamplingParams

    sentence = "The quick brown fox jumps over the lazy dog near the old mill by the river."
    messages = [{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["lazy dog"])
    results = []
    for config in (None, NGRAM):
        llm = LLM(model="smollm2", max_model_len=1024, speculative_config=config)
        output = llm.chat(messages, params)[0].outputs[0]
        results.append((output.text, output.token_ids, output.finish_reason, output.stop_reason))
        stats = llm.engine.stats()
        llm.engine.check_integrity()
        del llm
        gc.collect()
    assert results[0] == results[1]
    assert results[1][2] == "stop" and results[1][3] == "lazy dog"
    assert stats.spec.num_accepted_tokens > 0
