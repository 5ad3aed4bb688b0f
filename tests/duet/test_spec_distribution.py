"""Sampling at temperature 1 under speculation follows the target's distribution, end to end.

A tiny random Llama with an 8-token vocabulary is the target; thousands of requests sample
4 tokens from one prompt with n-gram drafts or with a second random Llama as the draft. The
joint distribution of the 2nd and 3rd tokens (the first ones speculation produces) is
compared with the exact one computed by transformers, by a chi-square test. Breaking the
rejection rule (keeping every draft token) makes the same test fail.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import duet.spec_decode.decoder as decoder
from duet import LLM, SamplingParams
from duet.spec_decode.rejection import rejection_sample
from tests.conftest import make_tiny_llama
from tests.duet.test_spec_rejection import ALPHA, _chi_square_p_value

VOCAB = 8
PROMPT = [3, 5, 1, 6]
NUM_SAMPLES = 4000


@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory, tiny_tokenizer_dir):
    target = make_tiny_llama(tmp_path_factory.mktemp("target-v8"), tiny_tokenizer_dir, seed=1, vocab_size=VOCAB)
    draft = make_tiny_llama(tmp_path_factory.mktemp("draft-v8"), tiny_tokenizer_dir, seed=2, vocab_size=VOCAB)
    return target, draft


@pytest.fixture(scope="module")
def exact_second_and_third(tiny_vocab_models) -> torch.Tensor:
    """[VOCAB, VOCAB] P(2nd token, 3rd token) under the target, summed over the 1st token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_vocab_models[0]), dtype=torch.float64).eval()
    ids = torch.arange(VOCAB)
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
        one = torch.tensor([PROMPT]).repeat(VOCAB, 1)
        second = model(torch.cat([one, ids[:, None]], 1)).logits[:, -1].softmax(-1)  # [t1, t2]
        pairs = torch.cartesian_prod(ids, ids)
        two = torch.cat([torch.tensor([PROMPT]).repeat(VOCAB * VOCAB, 1), pairs], 1)
        third = model(two).logits[:, -1].softmax(-1).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return (first[:, None, None] * second[:, :, None] * third).sum(0)


def _sample_second_and_third(target, speculative_config, seeded=False) -> tuple[torch.Tensor, dict]:
    llm = LLM(
        model=str(target), speculative_config=speculative_config, max_num_seqs=512, max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    if seeded:
        params = [dataclasses.replace(params, seed=seed) for seed in range(NUM_SAMPLES)]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    stats = llm.engine.stats()
    llm.engine.check_integrity()
    del llm
    gc.collect()
    tokens = torch.tensor([output.outputs[0].token_ids for output in outputs])
    return tokens[:, 1] * VOCAB + tokens[:, 2], stats


def _p_value(cells: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value, with cells expected fewer than 5 times pooled into one."""
    probs = probs.flatten()
    small = probs * cells.numel() < 5
    keep = (~small).nonzero().squeeze(1)
    remap = torch.full((probs.numel(),), keep.numel(), dtype=torch.long)
    remap[keep] = torch.arange(keep.numel())
    pooled = torch.cat([probs[keep], probs[small].sum().reshape(1)])
    return _chi_square_p_value(remap[cells], pooled)


def _configs(draft_dir):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2, "adaptive": False},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft_dir), "adaptive": False},
    }


@pytest.mark.slow
@pytest.mark.parametrize("method, seeded", [("ngram", False), ("draft_model", False), ("draft_model", True)])
def test_speculative_sampling_follows_the_target_distribution(method, seeded, tiny_vocab_models, exact_second_and_third):
    """Seeded: each request its own seed, its drafts drawn with its own next races (a draft that
    peeked the wrong way, or verification that kept a draft it did not sample, would show)."""
    target, draft = tiny_vocab_models
    cells, stats = _sample_second_and_third(target, _configs(draft)[method], seeded)
    assert stats.spec.num_drafts > NUM_SAMPLES // 2
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens
    p_value = _p_value(cells, exact_second_and_third)
    print(method, stats.spec.num_drafts, stats.spec.num_accepted_tokens, stats.spec.num_draft_tokens, p_value)
    assert p_value > ALPHA


def _keep_every_draft(drafts, draft_probs, target_probs, greedy, generators):
    """The broken rule: as if the target were certain of each draft token (p(x) = 1 on its row)."""
    fake_target = target_probs.clone()
    target_row = 0
    for request_drafts in drafts:
        for offset, token_id in enumerate(request_drafts):
            fake_target[target_row + offset] = torch.nn.functional.one_hot(torch.tensor(token_id), VOCAB)
        target_row += len(request_drafts) + 1
    return rejection_sample(drafts, draft_probs, fake_target, greedy, generators)


@pytest.mark.slow
def test_the_check_fails_when_every_draft_is_kept(monkeypatch, tiny_vocab_models, exact_second_and_third):
    target, draft = tiny_vocab_models
    monkeypatch.setattr(decoder, "rejection_sample", _keep_every_draft)
    cells, _ = _sample_second_and_third(target, _configs(draft)["draft_model"])
    p_value = _p_value(cells, exact_second_and_third)
    print("broken", p_value)
    assert p_value < ALPHA
