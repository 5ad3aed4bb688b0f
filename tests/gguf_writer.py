"""GGUF files as llama.cpp's converter writes them, written with gguf's own writer from tiny
random models: a tiny Llama as duet's conversion leaves it, any of ``TINY_FAMILIES`` as a file,
and random K-quant super-blocks (gguf's quantizer makes none)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from tests.conftest import make_tiny_llama, make_tiny_model


# The largest d that gives an i-quant's weights about a tiny model's size: a sub-block scale up
# to 3.9 d (IQ2), 7.75 d (IQ3_XXS), 31 d (IQ3_S) or 15 d (IQ1_S) times grid values up to 43, 62,
# 15 or 1.125.
IQ_MAGNITUDES = {"IQ4_XS": 0.00001, "IQ4_NL": 0.0003, "IQ2_XXS": 0.0003, "IQ2_XS": 0.0003, "IQ2_S": 0.0003, "IQ3_XXS": 0.0001,
                 "IQ3_S": 0.0001, "IQ1_S": 0.003}


def k_quant_blocks(rows: int, cols: int, qtype: int, magnitude: float, seed: int = 0):
    """Random Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or i-quant super-blocks (IQ1_S to IQ4_XS), or IQ4_NL
    blocks (gguf's quantizer makes none): random codes and integer scales under fp16
    (super-)block scales up to ``magnitude`` (``IQ_MAGNITUDES``: a tiny model's weights' size);
    ``[rows, cols / block * bytes]`` uint8."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    with_min = qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // block, 2)) * magnitude).astype(np.float16).view(np.uint8)
    if gguf.GGMLQuantizationType(qtype).name.startswith("IQ"):
        blocks[..., 0:2] = scales[..., :2]  # d
    elif with_min:
        blocks[..., 0:4] = scales  # d, dmin
    elif qtype == gguf.GGMLQuantizationType.Q2_K:
        blocks[..., 80:84] = scales  # d, dmin
    elif qtype == gguf.GGMLQuantizationType.Q3_K:
        blocks[..., 108:110] = scales[..., :2]  # d
    else:
        blocks[..., 208:210] = scales[..., :2]  # d
    return blocks.reshape(rows, -1)


def make_tiny_gguf_llama(
    target: Path, tokenizer_dir: Path, seed: int = 0, k_quants: bool = False, k_quant: str = "Q4_K", **overrides
) -> Path:
    """A tiny random Llama as a GGUF conversion leaves it (see ``duet.models.gguf_convert``): its
    projections quantized to Q4_1 and its embedding and LM head to Q8_0 by gguf's own quantizer,
    the float weights replaced by their dequantization, and the blocks kept beside them. With
    ``k_quants`` (sizes multiples of 256), as a Q4_K_M file has them instead: q, k, v, gate and
    up Q4_K (``k_quant``: Q5_K for a Q5_K_M file's, Q2_K or an i-quant), o, down and the LM
    head Q6_K (random super-blocks: gguf quantizes to none of them)."""
    import gguf
    from safetensors.torch import load_file, save_file

    from duet.models.gguf_convert import save_gguf_blocks

    make_tiny_llama(target, tokenizer_dir, seed, **overrides)
    state = load_file(str(target / "model.safetensors"))
    blocks, types = {}, {}
    for name, weight in state.items():
        if weight.dim() != 2:  # norms stay F32, as in a GGUF file
            continue
        if k_quants and "embed" not in name:
            q4_k = any(part in name for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
            qtype = gguf.GGMLQuantizationType[k_quant] if q4_k else gguf.GGMLQuantizationType.Q6_K
            # Q5_K's codes reach 31; Q2_K's 3 (its scales 15); IQ4's table 127 (IQ4_XS's scales 32)
            magnitude = ({"Q4_K": 0.0004, "Q2_K": 0.004} | IQ_MAGNITUDES).get(k_quant, 0.0001) if q4_k else 0.00005
            quantized = k_quant_blocks(*weight.shape, int(qtype), magnitude=magnitude, seed=len(blocks))
        else:
            qtype = gguf.GGMLQuantizationType.Q4_1 if "proj" in name else gguf.GGMLQuantizationType.Q8_0
            quantized = gguf.quants.quantize(weight.numpy(), qtype)
        state[name] = torch.from_numpy(gguf.quants.dequantize(quantized, qtype).astype("float32").reshape(weight.shape))
        blocks[name] = torch.from_numpy(quantized.reshape(weight.shape[0], -1).copy())
        types[name] = int(qtype)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    save_gguf_blocks(target, blocks, types)
    return target


# GGUF's own names for a Hugging Face layer's tensors (llama.cpp's ``gguf.TensorNameMap``).
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused projections
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",  # Qwen 3 MoE's
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",  # Qwen 2 MoE's
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma's: norms after attention, and before and after the MLP (its ``ffn_norm`` is the one before).
_GGUF_GEMMA_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# OLMo 2's: norms after attention and after the MLP only.
_GGUF_OLMO2_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def write_tiny_gguf(
    path: Path, tokenizer_dir: Path, family: str, seed: int = 0, projections: str = "Q8_0", eot_token_id: int | None = None,
    **overrides,
) -> Path:
    """One of ``TINY_FAMILIES`` (Llama, Qwen 2, Qwen 3, Qwen 2 and 3 MoE, Phi-3, Gemma 2 and 3, OLMo 2)
    written as llama.cpp's converter writes a GGUF file, with gguf's own writer: its
    architecture's metadata keys, projections in ``projections`` (Q8_0, Q4_0, Q5_1: gguf's quantizer;
    Q5_K: random super-blocks, its sizes multiples of 256), a MoE layer's experts stacked in one
    tensor per projection (quantized so too) and its router in F32, the embedding in F16, norms
    and biases in F32 (Gemma's norms as 1 + w), a Llama's Q/K rows interleaved for its RoPE, and
    the tokenizer (byte-level BPE: its tokens, types, merges, special ids and chat template)
    from ``tokenizer_dir``; ``eot_token_id``, where given, as the file's end-of-turn token.

    Beside it (but for a Llama's), ``<stem>-reference`` holds the source model with the weights
    the file holds, dequantized: transformers on it is the oracle of a conversion where
    transformers' own GGUF reader falls short (it reads no Gemma soft-cap or query scale)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    arch = {"qwen3-moe": "qwen3moe", "qwen2-moe": "qwen2moe", "phi3-longrope": "phi3", "phi3-partial": "phi3"}.get(family, family)
    source_dir = path.parent / f"{path.stem}-source"
    if family == "llama":
        source = make_tiny_llama(source_dir, tokenizer_dir, seed, **overrides)
    else:
        source = make_tiny_model(source_dir, tokenizer_dir, family, seed, **overrides)
    config = json.loads((source / "config.json").read_text())
    state = {name: tensor.float().numpy() for name, tensor in load_file(str(source / "model.safetensors")).items()}
    num_experts = config.get("num_local_experts", config.get("num_experts"))
    for name in [name for name in state if ".mlp.experts.0." in name]:  # stacked: [experts, out, in]
        per_expert = [state.pop(name.replace(".experts.0.", f".experts.{e}.")) for e in range(num_experts)]
        state[name.replace(".experts.0.", ".experts.")] = np.stack(per_expert)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    def interleave(weight: np.ndarray, num_heads: int) -> np.ndarray:  # llama.cpp's ``permute``
        return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    gemma = arch in ("gemma2", "gemma3")
    if arch == "gemma3":  # the global layers' RoPE (llama.cpp fixes the windowed layers' base)
        rope = rope["full_attention"]
    if arch != "gemma2":  # llama.cpp writes no RoPE key for Gemma 2 (its base is 10000)
        writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if gemma:
        writer.add_sliding_window(config["sliding_window"])
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping") is not None:
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":  # the features RoPE rotates (Phi-4-mini's: part of each head)
        writer.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)))
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi-3 long context: two keys, two factor tensors
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(config["max_position_embeddings"] / original) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {added["id"] for added in tokenizer["added_tokens"] if added.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL for index in range(len(tokens))])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())
    reference = {}  # what the file holds, by Hugging Face name, dequantized
    for name, value in state.items():
        if gemma and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's 1 + w
            value = value + np.float32(1.0)
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            names = _GGUF_GEMMA_LAYER_NAMES if gemma else _GGUF_OLMO2_LAYER_NAMES if arch == "olmo2" else _GGUF_LAYER_NAMES
            gguf_name = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = interleave(value, heads if "q_proj" in name else kv_heads)
        if name.endswith("shared_expert_gate.weight"):  # a vector in the file, as llama.cpp's converter writes it
            writer.add_tensor(gguf_name, value.reshape(-1).astype(np.float32))
            reference[name] = value.astype(np.float32)
            continue
        if value.ndim >= 2 and "embed" not in name and not name.endswith("mlp.gate.weight"):
            qtype = getattr(gguf.GGMLQuantizationType, projections)
            if projections.endswith("_K") or projections.startswith("IQ"):  # gguf quantizes to none of these
                magnitude = IQ_MAGNITUDES.get(projections, 0.0001)
                blocks = k_quant_blocks(*value.shape, int(qtype), magnitude=magnitude, seed=len(gguf_name) + value.shape[0])
            else:
                blocks = gguf.quants.quantize(value, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            reference[name] = gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(value.shape)
        elif "embed" in name:
            writer.add_tensor(gguf_name, value.astype(np.float16))
            reference[name] = value.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name, value.astype(np.float32))
            reference[name] = value.astype(np.float32) - (np.float32(1.0) if gemma and name.endswith("norm.weight") else 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if arch != "llama":  # (a Llama's Q/K rows are interleaved in the file)
        reference_dir = path.parent / f"{path.stem}-reference"
        shutil.copytree(source, reference_dir)
        tensors = {}
        for name, value in reference.items():
            if value.ndim == 3:  # a MoE layer's stacked experts, per expert again
                tensors |= {name.replace(".experts.", f".experts.{e}."): torch.from_numpy(value[e].copy()) for e in range(len(value))}
            else:
                tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
        save_file(tensors, str(reference_dir / "model.safetensors"), metadata={"format": "pt"})
        if eot_token_id is not None:  # transformers ends at both, and holds both back under min_new_tokens
            generation = reference_dir / "generation_config.json"
            settings = json.loads(generation.read_text()) if generation.exists() else {}
            generation.write_text(json.dumps(settings | {"eos_token_id": [config["eos_token_id"], eot_token_id]}))
    return path
