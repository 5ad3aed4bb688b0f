"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability after
the ones before it, as transformers computes it, whatever the chunking; the prompt is computed
whole (never read from the prefix cache), and only once whatever preempts it."""

from __future__ import annotations

import pytest
import torch

from duet import LLM, SamplingParams
from duet.errors import InvalidRequestError

PROMPTS = [list(range(100, 170)), list(range(300, 305)), list(range(100, 140))]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """transformers' log-softmax over each prompt's positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([prompt])).logits[0].log_softmax(-1) for prompt in PROMPTS]


def _check(prompt_logprobs, prompt, reference, top):
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry, expected = prompt_logprobs[position], reference[position - 1]
        assert entry[prompt[position]] == pytest.approx(expected[prompt[position]].item(), abs=1e-4)
        assert set(expected.topk(top).indices.tolist()) <= set(entry) and len(entry) <= top + 1


@pytest.mark.slow  # an engine per chunking, and transformers: tens of seconds
@pytest.mark.parametrize("chunk", [16, 512], ids=["chunked-by-16", "whole"])
def test_prompt_logprobs_are_transformers_whatever_the_chunking(tiny_llama_dir, reference, chunk):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=512, max_num_batched_tokens=chunk)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    for prompt, output, expected in zip(PROMPTS, outputs, reference):
        _check(output.prompt_logprobs, prompt, expected, 2)
    # The third prompt is the first's prefix: it was computed, not read from the cache.
    assert outputs[2].num_cached_tokens == 0
    again = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


@pytest.mark.slow
def test_only_the_first_of_n_scores_the_prompt_and_a_preempted_prompt_is_scored_once(tiny_llama_dir, reference):
    """Eight blocks of 16 tokens hold one 70-token prompt and little else: sequences preempt each
    other mid-prompt, and a prompt computed again must not repeat or lose a position."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=8)
    outputs = llm.generate([PROMPTS[0], PROMPTS[0][:60]], SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2, prompt_logprobs=0))
    _check(outputs[0].prompt_logprobs, PROMPTS[0], reference[0], 0)
    _check(outputs[1].prompt_logprobs, PROMPTS[0][:60], reference[0], 0)
    assert SamplingParams(n=2, prompt_logprobs=1).choice(1).prompt_logprobs is None


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(prompt_logprobs=21)
    assert refused.value.param == "prompt_logprobs"
