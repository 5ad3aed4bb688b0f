"""Drafts are what the draft model would say: each proposer's tokens equal transformers' greedy
continuation of the same context (for layer_skip: the target's first layers, its final norm
and LM head), through the paged cache, after prefill, partial acceptance and rejection."""

from __future__ import annotations

import pytest
import torch

from duet import LLM, SamplingParams
from tests.conftest import make_tiny_llama

NUM_DRAFT_LAYERS = 2
PROMPTS = [[5, 17, 300, 41, 5, 17, 300], list(range(200, 237)), [9] * 20]


@pytest.fixture(scope="module")
def four_layer_llama(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-4-layers"), tiny_tokenizer_dir, seed=3, num_hidden_layers=4)


def _recorded_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Wrap the proposer to record (context, drafts) of every proposal."""
    proposer = llm.engine.executor.worker.runner.spec.proposer
    recorded = []
    original = proposer.propose

    def propose(states, num_drafts):
        drafts, probs = original(states, num_drafts)
        recorded.extend((state.token_ids, tokens) for state, tokens in zip(states, drafts))
        return drafts, probs

    proposer.propose = propose
    return recorded


def _hf_greedy_drafts(model, context: list[int], num_tokens: int, num_layers: int | None) -> list[int]:
    tokens = list(context)
    for _ in range(num_tokens):
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_hidden_states=True)
        if num_layers is None:
            logits = out.logits[0, -1]
        else:
            logits = model.lm_head(model.model.norm(out.hidden_states[num_layers][0, -1]))
        tokens.append(int(logits.argmax()))
    return tokens[len(context) :]


@pytest.mark.parametrize("method", ["layer_skip", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_drafts_equal_transformers_greedy_continuation(method, four_layer_llama, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    if method == "layer_skip":
        config = {"method": method, "num_speculative_tokens": 3, "num_draft_layers": NUM_DRAFT_LAYERS, "adaptive": False}
        hf_draft, num_layers = four_layer_llama, NUM_DRAFT_LAYERS
    else:
        config = {"method": method, "num_speculative_tokens": 3, "model": str(tiny_llama_dir), "adaptive": False}
        hf_draft, num_layers = tiny_llama_dir, None
    llm = LLM(model=str(four_layer_llama), speculative_config=config, block_size=4)
    recorded = _recorded_proposals(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    llm.engine.check_integrity()
    assert all(len(output.outputs[0].token_ids) == 16 for output in outputs)
    reference = AutoModelForCausalLM.from_pretrained(str(hf_draft), dtype=torch.float32).eval()
    assert len(recorded) >= len(PROMPTS) * 4
    for context, drafts in recorded:
        assert drafts == _hf_greedy_drafts(reference, context, len(drafts), num_layers), context
