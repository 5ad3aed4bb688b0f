"""The architectures duet runs: each family's Hugging Face config read into the one decoder's parts.

Every family is ``duet.models.llama``'s decoder (``LlamaForCausalLM``), or with experts
``duet.models.mixtral``'s, configured by its ``LlamaArch``: a reader here says which parts a
family has, and refuses a config that asks for a part duet does not have, naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from duet.errors import UnsupportedCheckpointError
from duet.models.llama import LlamaArch, LlamaForCausalLM
from duet.models.rope import rope_scaling
from duet.models.mixtral import MixtralArch, MixtralForCausalLM


def _check(config, field: str, ok: bool, wanted: str) -> None:
    if not ok:
        raise UnsupportedCheckpointError(f"config.json's {field}={getattr(config, field, None)!r} is not supported: duet runs {wanted}")


def _common(config) -> None:
    _check(config, "hidden_act", getattr(config, "hidden_act", "silu") == "silu", "'silu' (SwiGLU) MLPs")


def _layer_windows(config) -> tuple[int | None, ...] | None:
    """Each layer's window, where the config gives one: by ``layer_types`` where it has them
    (Qwen's windowed layers, Gemma's alternation), else on every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * config.num_hidden_layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    return windows if any(windows) else None


def _gemma_parts(config) -> dict:
    """What Gemma 2 and 3 share: scaled embeddings, (1 + w) norms, norms around both blocks,
    GeGLU, their query scale, soft-caps, windowed layers."""
    _check(config, "hidden_activation", config.hidden_activation == "gelu_pytorch_tanh", "'gelu_pytorch_tanh' (GeGLU)")
    _check(config, "attention_bias", not getattr(config, "attention_bias", False), "projections without biases")
    _check(
        config, "use_bidirectional_attention", not getattr(config, "use_bidirectional_attention", False), "causal attention"
    )
    return dict(
        layer_windows=_layer_windows(config), norm_offset=True, embed_scale=config.hidden_size**0.5, sandwich_norms=True,
        activation="gelu_tanh", query_scale=config.query_pre_attn_scalar**-0.5, attn_softcap=config.attn_logit_softcapping,
        final_softcap=config.final_logit_softcapping, checkpoint_names="gemma",
    )


def _gemma2(config) -> LlamaArch:
    return LlamaArch.from_hf_config(config, **_gemma_parts(config))


def _gemma3(config) -> LlamaArch:
    """Two RoPEs: the global layers' (scaled or not), the windowed layers' plain one."""
    full, local = config.rope_parameters["full_attention"], config.rope_parameters["sliding_attention"]
    _check(config, "rope_parameters", local.get("rope_type", "default") == "default", "plain RoPE on the windowed layers")
    return LlamaArch.from_hf_config(
        config, qk_norm=True, rope_theta=float(full["rope_theta"]), **rope_scaling(config, full, "full_attention"),
        local_rope_theta=float(local["rope_theta"]), **_gemma_parts(config),
    )


def _biases(config) -> dict:
    """``attention_bias`` (q, k, v and o: Llama's, SmolLM3's, Granite's, Qwen 3's) and ``mlp_bias``."""
    attention = bool(getattr(config, "attention_bias", False))
    return dict(qkv_bias=attention, o_bias=attention, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def _llama(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, **_biases(config))


def _smollm3(config) -> LlamaArch:
    """A Llama whose layers of ``no_rope_layers`` 0 rotate nothing (NoPE), windowed where
    ``use_sliding_window`` and ``layer_types`` say so."""
    _common(config)
    nope = tuple(layer for layer, rotates in enumerate(config.no_rope_layers) if not rotates)
    windows = _layer_windows(config) if getattr(config, "use_sliding_window", False) else None
    return LlamaArch.from_hf_config(config, nope_layers=nope, layer_windows=windows, **_biases(config))


def _granite_parts(config) -> dict:
    """Granite's multipliers: embeddings, block outputs, attention scores and a divisor of the logits."""
    return dict(
        embed_multiplier=float(config.embedding_multiplier), residual_multiplier=float(config.residual_multiplier),
        query_scale=float(config.attention_multiplier), logits_divisor=float(config.logits_scaling), **_biases(config),
    )


def _granite(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, **_granite_parts(config))


def _granite_moe(config) -> MixtralArch:
    """Granite's multipliers around experts stacked one tensor a projection (``input_linear``:
    each expert's gate rows then its up rows); the top k's softmax over their own logits, which
    is Mixtral's renormalised one. Granite MoE Shared adds an ungated shared MLP."""
    _common(config)
    shared = getattr(config, "shared_intermediate_size", 0) or 0
    arch = MixtralArch.from_hf_config(config, **_granite_parts(config))
    return dataclasses.replace(arch, checkpoint_names="granitemoe", shared_expert_intermediate_size=shared, shared_expert_gated=False)


def _qwen2(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, qkv_bias=True, layer_windows=_layer_windows(config))


def _qwen3(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, qk_norm=True, layer_windows=_layer_windows(config), **_biases(config))


def _olmo2(config) -> LlamaArch:
    """No norms before attention and MLP, one after each (the norm-after sandwich), and q/k
    norms over all heads' features at once."""
    _common(config)
    return LlamaArch.from_hf_config(
        config, qk_norm=True, qk_norm_across_heads=True, sandwich_norms=True, pre_norms=False, **_biases(config)
    )


def _mistral(config) -> LlamaArch:
    _common(config)
    return LlamaArch.from_hf_config(config, layer_windows=_layer_windows(config))


def _phi3(config) -> LlamaArch:
    _common(config)
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    arch = LlamaArch.from_hf_config(config, layer_windows=_layer_windows(config), checkpoint_names="phi3")
    rotary_dim = int(arch.head_dim * factor)  # Phi-4-mini rotates three quarters of a head
    _check(config, "partial_rotary_factor", rotary_dim % 2 == 0 and rotary_dim > 0, "an even, nonzero number of rotated features")
    return dataclasses.replace(
        arch, rope_recompute=arch.rope_long_inv_freq is not None, rotary_dim=None if rotary_dim == arch.head_dim else rotary_dim
    )


def _mixtral(config) -> MixtralArch:
    _common(config)
    return MixtralArch.from_hf_config(config, layer_windows=_layer_windows(config))


def _qwen_moe(config, base: LlamaArch, **parts) -> MixtralArch:
    """Qwen's experts (2 and 3): sparse every ``decoder_sparse_step``-th layer but ``mlp_only_layers``."""
    step = config.decoder_sparse_step
    sparse = tuple(
        layer for layer in range(config.num_hidden_layers)
        if layer not in config.mlp_only_layers and config.num_experts > 0 and (layer + 1) % step == 0
    )
    return MixtralArch(
        **{**vars(base), "intermediate_size": config.moe_intermediate_size},
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=bool(config.norm_topk_prob), sparse_layers=sparse, dense_intermediate_size=config.intermediate_size, **parts,
    )


def _qwen3_moe(config) -> MixtralArch:
    _common(config)
    base = LlamaArch.from_hf_config(
        config, qk_norm=True, layer_windows=_layer_windows(config), checkpoint_names="qwen3_moe", **_biases(config)
    )
    return _qwen_moe(config, base)


def _qwen2_moe(config) -> MixtralArch:
    """Qwen 2's q/k/v biases, and a shared expert beside the routed ones."""
    _common(config)
    windows = _layer_windows(config) if getattr(config, "use_sliding_window", False) else None
    base = LlamaArch.from_hf_config(
        config, qkv_bias=bool(getattr(config, "qkv_bias", True)), layer_windows=windows, checkpoint_names="qwen3_moe",
    )
    return _qwen_moe(config, base, shared_expert_intermediate_size=config.shared_expert_intermediate_size)


# The config's ``architectures`` name: how its config reads, and the model it builds.
ARCHITECTURES: dict[str, tuple[Callable[[object], LlamaArch], type[LlamaForCausalLM]]] = {
    "LlamaForCausalLM": (_llama, LlamaForCausalLM),
    "MistralForCausalLM": (_mistral, LlamaForCausalLM),
    "Qwen2ForCausalLM": (_qwen2, LlamaForCausalLM),
    "Qwen3ForCausalLM": (_qwen3, LlamaForCausalLM),
    "Phi3ForCausalLM": (_phi3, LlamaForCausalLM),
    "SmolLM3ForCausalLM": (_smollm3, LlamaForCausalLM),
    "GraniteForCausalLM": (_granite, LlamaForCausalLM),
    "Olmo2ForCausalLM": (_olmo2, LlamaForCausalLM),
    "MixtralForCausalLM": (_mixtral, MixtralForCausalLM),
    "Qwen3MoeForCausalLM": (_qwen3_moe, MixtralForCausalLM),
    "Qwen2MoeForCausalLM": (_qwen2_moe, MixtralForCausalLM),
    "GraniteMoeForCausalLM": (_granite_moe, MixtralForCausalLM),
    "GraniteMoeSharedForCausalLM": (_granite_moe, MixtralForCausalLM),
    "Gemma2ForCausalLM": (_gemma2, LlamaForCausalLM),
    "Gemma3ForCausalLM": (_gemma3, LlamaForCausalLM),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def model_class(arch: LlamaArch) -> type[LlamaForCausalLM]:
    return MixtralForCausalLM if isinstance(arch, MixtralArch) else LlamaForCausalLM
