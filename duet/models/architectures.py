"""The architectures duet runs: each family's Hugging Face config read into the one decoder's parts.

Every family is ``duet.models.llama``'s decoder (``LlamaForCausalLM``), or with experts
``duet.models.mixtral``'s, configured by its ``LlamaArch``: a reader here says which parts a
family has, and refuses a config that asks for a part duet does not have, naming the field.
"""

from __future__ import annotations

from collections.abc import Callable

from duet.errors import UnsupportedCheckpointError
from duet.models.llama import LlamaArch, LlamaForCausalLM
from duet.models.mixtral import MixtralArch, MixtralForCausalLM


def _check(config, field: str, ok: bool, wanted: str) -> None:
    if not ok:
        raise UnsupportedCheckpointError(f"config.json's {field}={getattr(config, field, None)!r} is not supported: duet runs {wanted}")


def _common(config) -> None:
    _check(config, "hidden_act", getattr(config, "hidden_act", "silu") == "silu", "'silu' (SwiGLU) MLPs")


def _window(config) -> int | None:
    """Qwen's window applies only with ``use_sliding_window``."""
    return config.sliding_window if getattr(config, "use_sliding_window", False) else None


def _llama(config) -> LlamaArch:
    _common(config)
    _check(config, "attention_bias", not getattr(config, "attention_bias", False), "Llama projections without biases")
    _check(config, "mlp_bias", not getattr(config, "mlp_bias", False), "Llama MLPs without biases")
    return LlamaArch.from_hf_config(config)


def _qwen2(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, qkv_bias=True, sliding_window=_window(config))


def _qwen3(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(
        config, qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True, sliding_window=_window(config)
    )


def _mistral(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, sliding_window=getattr(config, "sliding_window", None))


def _phi3(config) -> LlamaArch:
    _common(config)
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    _check(config, "partial_rotary_factor", factor in (None, 1.0), "RoPE over whole heads (1.0)")
    return LlamaArch.from_hf_config(config, sliding_window=getattr(config, "sliding_window", None), checkpoint_names="phi3")


def _mixtral(config) -> MixtralArch:
    _common(config)
    return MixtralArch.from_hf_config(config, sliding_window=getattr(config, "sliding_window", None))


def _qwen3_moe(config) -> MixtralArch:
    _common(config)
    step = config.decoder_sparse_step
    sparse = tuple(
        layer for layer in range(config.num_hidden_layers)
        if layer not in config.mlp_only_layers and config.num_experts > 0 and (layer + 1) % step == 0
    )
    base = LlamaArch.from_hf_config(
        config, qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True,
        sliding_window=_window(config), checkpoint_names="qwen3_moe",
    )
    return MixtralArch(
        **{**vars(base), "intermediate_size": config.moe_intermediate_size},
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=bool(config.norm_topk_prob), sparse_layers=sparse, dense_intermediate_size=config.intermediate_size,
    )


# The config's ``architectures`` name: how its config reads, and the model it builds.
ARCHITECTURES: dict[str, tuple[Callable[[object], LlamaArch], type[LlamaForCausalLM]]] = {
    "LlamaForCausalLM": (_llama, LlamaForCausalLM),
    "MistralForCausalLM": (_mistral, LlamaForCausalLM),
    "Qwen2ForCausalLM": (_qwen2, LlamaForCausalLM),
    "Qwen3ForCausalLM": (_qwen3, LlamaForCausalLM),
    "Phi3ForCausalLM": (_phi3, LlamaForCausalLM),
    "MixtralForCausalLM": (_mixtral, MixtralForCausalLM),
    "Qwen3MoeForCausalLM": (_qwen3_moe, MixtralForCausalLM),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def model_class(arch: LlamaArch) -> type[LlamaForCausalLM]:
    return MixtralForCausalLM if isinstance(arch, MixtralArch) else LlamaForCausalLM
