"""Shared fixtures: the real SmolLM2 (converted once per machine) and tiny random Llamas."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The integration tests run a local cluster, which listens on 127.0.0.1 only; every process that
# connects to it must say so before it first imports ray (see duet.cluster.deploy).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # duet.cluster.loopback.LOOPBACK_RAY_ENV

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from duet.models.gguf_convert import ensure_smollm2

    return ensure_smollm2()


def make_tiny_llama(target: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Llama with SmolLM2's tokenizer, saved as a Hugging Face directory.

    ``overrides`` change the config; a smaller ``vocab_size`` keeps the first ids of the tokenizer.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float()
    # Spread the logits so that greedy choices are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(target))
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == settings["num_hidden_layers"]
    return target


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def parity_prompts(smollm2_tokenizer) -> list[list[int]]:
    from tests.prompts import encode_conversations, parity_conversations

    return encode_conversations(smollm2_tokenizer, parity_conversations())


@pytest.fixture(scope="session")
def parity_references(smollm2_dir, parity_prompts):
    """transformers' greedy tokens for the 16 parity prompts, computed once per test session."""
    from tests.prompts import PARITY_NEW_TOKENS
    from tests.reference import hf_greedy

    return hf_greedy(smollm2_dir, parity_prompts, PARITY_NEW_TOKENS)
