"""Find a model by alias or path and load its safetensors weights into duet's own modules."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from duet.models.linear import Linear
from duet.models.llama import LlamaArch, LlamaForCausalLM, RotaryEmbedding

MODEL_ALIASES = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m-instruct": "SmolLM2-135M-Instruct"}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ModelNotFoundError(ValueError):
    """The model name is neither a known alias nor a Hugging Face model directory."""


def resolve_model_path(model: str) -> Path:
    """An alias (``smollm2``) or a directory holding ``config.json`` and ``*.safetensors``."""
    if model.lower() in MODEL_ALIASES:
        from duet.models.gguf_convert import ensure_smollm2

        return ensure_smollm2()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} is not a known alias ({', '.join(sorted(MODEL_ALIASES))}) "
        "nor a directory with a Hugging Face config.json"
    )


def max_positions(path: Path) -> int:
    """The longest sequence the model's config allows."""
    return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048))


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _fused_state_dict(state: dict[str, torch.Tensor], arch: LlamaArch) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to duet's modules, fusing q/k/v and gate/up projections."""
    fused = {
        "embed_tokens.weight": state["model.embed_tokens.weight"],
        "norm.weight": state["model.norm.weight"],
    }
    fused["lm_head.weight"] = state["model.embed_tokens.weight"] if arch.tie_word_embeddings else state["lm_head.weight"]
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        out = f"layers.{layer}."
        fused[out + "input_layernorm.weight"] = state[prefix + "input_layernorm.weight"]
        fused[out + "post_attention_layernorm.weight"] = state[prefix + "post_attention_layernorm.weight"]
        fused[out + "self_attn.qkv_proj.weight"] = torch.cat(
            [state[attn + "q_proj.weight"], state[attn + "k_proj.weight"], state[attn + "v_proj.weight"]]
        )
        fused[out + "self_attn.o_proj.weight"] = state[attn + "o_proj.weight"]
        fused[out + "mlp.gate_up_proj.weight"] = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
        fused[out + "mlp.down_proj.weight"] = state[mlp + "down_proj.weight"]
    return fused


def read_arch(path: Path) -> LlamaArch:
    """The model's shape from its config alone (no weights): what sizes the KV cache."""
    from transformers import AutoConfig

    raw_config = json.loads((path / "config.json").read_text())
    architectures = raw_config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelNotFoundError(f"{path}: architecture {architectures} is not supported; duet runs {SUPPORTED_ARCHITECTURES}")
    if raw_config.get("attention_bias") or raw_config.get("mlp_bias"):
        raise ModelNotFoundError(f"{path}: Llama variants with projection biases are not supported yet")
    return LlamaArch.from_hf_config(AutoConfig.from_pretrained(str(path)))


def load_model(path: Path, dtype: torch.dtype, device: str, max_positions: int) -> LlamaForCausalLM:
    """Build duet's Llama from a Hugging Face directory, weights cast to ``dtype`` on ``device``."""
    arch = read_arch(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions)
    model = model.to_empty(device=device)
    state = _fused_state_dict(_read_state_dict(path), arch)
    for name, param in model.named_parameters():
        param.data = state.pop(name).to(device=device, dtype=dtype).contiguous()
    # Buffers built under the meta device hold no values: build the RoPE table for real.
    model.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions).to(device)
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()
    return model.eval()


def save_first_layers(source: Path, target: Path, num_layers: int) -> Path:
    """Save a Hugging Face checkpoint of ``source``'s first ``num_layers`` layers (with its
    embeddings, final norm, LM head and tokenizer) to ``target``: a weaker model sharing the
    tokenizer, usable as a speculative draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(target))
    return target
