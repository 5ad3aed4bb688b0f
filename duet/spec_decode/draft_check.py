"""The speculative config checked against its target model before any worker starts."""

from __future__ import annotations

import logging

from duet.config import ConfigError

logger = logging.getLogger(__name__)


def check_draft_model(config, arch, tokenizer, eos_token_id: int, model_path) -> str | None:
    """Check ``config`` (a ``SpeculativeConfig`` or None) against the target (its ``arch``,
    ``tokenizer`` and ``eos_token_id``, at ``model_path``); the draft's path for ``draft_model``."""
    from transformers import AutoTokenizer

    from duet.models.loader import read_arch, resolve_model_path

    if config is None or config.method == "ngram":
        return None
    if config.method == "layer_skip":
        if config.num_draft_layers >= arch.num_layers:
            raise ConfigError(
                f"speculative_config.num_draft_layers={config.num_draft_layers} must be below the "
                f"target's {arch.num_layers} layers"
            )
        return None
    draft_path = resolve_model_path(config.model)
    draft_tokenizer = AutoTokenizer.from_pretrained(str(draft_path))
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab() or draft_tokenizer.eos_token_id != eos_token_id:
        raise ConfigError(
            f"the draft model {config.model!r} does not share the target's tokenizer ({model_path.name}); "
            "speculative decoding needs a draft with the same vocabulary"
        )
    draft_arch = read_arch(draft_path)
    if draft_arch.vocab_size != arch.vocab_size:
        raise ConfigError(f"the draft model's output has {draft_arch.vocab_size} logits but the target's has {arch.vocab_size}")
    logger.info("draft model %s: %d layers, hidden size %d", draft_path.name, draft_arch.num_layers, draft_arch.hidden_size)
    return str(draft_path)
