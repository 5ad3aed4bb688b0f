"""speculative_config is checked when the engine starts, with messages that say what to change."""

from __future__ import annotations

import pytest

from duet import LLM
from duet.config import ConfigError, EngineArgs
from tests.conftest import TINY_VOCAB, make_tiny_llama


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "use one of ngram, draft_model, layer_skip"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "integer in [1, 16]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "layer_skip", "num_speculative_tokens": 2}, "num_draft_layers is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ],
)
def test_bad_settings_fail_at_construction(config, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineArgs(speculative_config=config)


def test_layer_skip_must_leave_layers_to_skip(tiny_llama_dir):
    with pytest.raises(ConfigError, match="num_draft_layers=2 must be below the target's 2 layers"):
        LLM(model=str(tiny_llama_dir), speculative_config={"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 2})


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, tiny_llama_dir, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    draft = make_tiny_llama(tmp_path / "other-tokenizer", tiny_tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(draft))
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(str(draft))
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)}
    with pytest.raises(ConfigError, match="does not share the target's tokenizer"):
        LLM(model=str(tiny_llama_dir), speculative_config=config)


def test_a_draft_with_another_vocabulary_size_is_refused(tmp_path, tiny_llama_dir, tiny_tokenizer_dir):
    draft = make_tiny_llama(tmp_path / "small-vocab", tiny_tokenizer_dir, vocab_size=1000)
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)}
    with pytest.raises(ConfigError, match=f"1000 logits but the target's has {TINY_VOCAB}"):
        LLM(model=str(tiny_llama_dir), speculative_config=config)
