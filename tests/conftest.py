"""Shared fixtures: tiny random Llamas with the small tokenizer committed in
``tests/fixtures/tokenizer`` (the fast tier's: nothing to download), and the real SmolLM2
(downloaded and converted once per machine) for the tests marked ``slow``."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

# The integration tests run a local cluster, which listens on 127.0.0.1 only; every process that
# connects to it must say so before it first imports ray (see duet.cluster.deploy).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # duet.router.serve_internals.LOOPBACK_RAY_ENV

import pytest
import torch


# The session's exit status, kept for ``pytest_unconfigure``.
_exit_status: int | None = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """End the process with the session's status once pytest is done, skipping the interpreter's
    and the native libraries' teardown, which sometimes crashed after every test had passed (a
    segmentation fault with no Python frame). Its cause is not found yet (docs/design.md, "Not
    built yet")."""
    if _exit_status is None:  # pytest stopped before the session ran (a usage error)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(session, config, items) -> None:
    """The integration tests run last, in their order: their cluster, once started, stays up
    to the end of the session, and its idle processes (Serve's controller, proxy, routers and
    replicas) take about a third of a core, which the tests after them would share."""
    items.sort(key=lambda item: item.path.is_relative_to(INTEGRATION))


# The tiny models' tokenizer: byte-level BPE with SmolLM2's special tokens and chat template
# (tests/fixtures/make_tokenizer.py made it). Its size is their vocab_size, and the bound of the
# token ids the tests make up.
TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "fixtures" / "tokenizer"
TINY_VOCAB = 1024


def _ray_is_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


_RAY_BEFORE = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Keeps the fast tier free of the download: a test that asks for the real SmolLM2 (directly
    or through ``smollm2_tokenizer``, ``parity_prompts``, ...) must be marked ``slow``."""
    item.stash[_RAY_BEFORE] = _ray_is_initialized()
    if "smollm2_dir" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} loads the real SmolLM2 but is not marked slow: mark it, or use the tiny fixtures", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item) -> None:
    """Keeps the fast tier free of Ray: a test after which Ray runs where it did not before (it
    started or joined a cluster, and a fixture of its own did not stop it) must be marked
    ``slow``. Ray left running by an earlier slow test's session fixture is not this one's."""
    if not item.stash.get(_RAY_BEFORE, True) and _ray_is_initialized() and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} runs Ray but is not marked slow: mark it", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from duet.models.gguf_convert import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """The small tokenizer's directory (tokenizer.json, tokenizer_config.json, chat template)."""
    return TINY_TOKENIZER_DIR


MISTRAL_CONTROL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


@pytest.fixture(scope="session")
def mistral_tokenizer_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The small tokenizer with Mistral's control tokens added as special tokens (as Mistral
    7B v0.3's has them) and a Mistral-style chat template (``tests/fixtures/mistral/``)."""
    from transformers import AutoTokenizer

    target = tmp_path_factory.mktemp("mistral-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": MISTRAL_CONTROL_TOKENS})
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "mistral" / "chat_template.jinja").read_text()
    tokenizer.save_pretrained(str(target))
    return target


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """transformers' view of the small tokenizer (the tiny models')."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def make_tiny_llama(target: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Llama with the tokenizer of ``tokenizer_dir`` (its vocab_size the
    tokenizer's size), saved as a Hugging Face directory.

    ``overrides`` change the config; a smaller ``vocab_size`` keeps the first ids of the tokenizer.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    settings = dict(
        vocab_size=len(tokenizer),
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
    tokenizer.save_pretrained(str(target))
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == settings["num_hidden_layers"]
    return target


def drain(engine, max_steps: int) -> tuple[dict[str, list[int]], dict[str, str | None]]:
    """Step ``engine`` until it has nothing left (at most ``max_steps`` steps): each request's
    tokens, and each finished request's error (None when it ended well)."""
    tokens, errors = {}, {}
    for _ in range(max_steps):
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finished:
                errors[delta.request_id] = delta.error
        if not engine.has_unfinished_requests():
            break
    return tokens, errors


def make_tiny_mixtral(target: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight Mixtral (4 experts, 2 per token) with the tokenizer of ``tokenizer_dir``."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**settings)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # no near-ties among greedy choices
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


# Each family's tiny shape: (its transformers config and model class names, the config's settings).
# Head dims and GQA ratios differ from SmolLM2's (64, 3:1) and from each other.
TINY_FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    "qwen3-tied": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(hidden_size=48, intermediate_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
    ),
    "mistral": (
        "MistralConfig", "MistralForCausalLM",
        dict(hidden_size=96, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, sliding_window=None),
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, sliding_window=None),
    ),
    "llama3-rope": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )),
    ),
    # Phi-3's long-context RoPE: past 20 tokens the long factors (all of a longer prompt's tokens).
    "phi3-longrope": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, sliding_window=None,
            original_max_position_embeddings=20, rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=20,
                short_factor=[1.0, 1.25, 1.5, 2.0], long_factor=[1.0, 3.0, 9.0, 27.0],
            ),
        ),
    ),
    # Dynamic NTK: past 20 tokens, frequencies recomputed from the sequence's length every token.
    "llama-dynamic": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=20,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=16.0),
        ),
    ),
    "yarn": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
        )),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
        ),
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
            sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=0.02, final_logit_softcapping=3.0,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
            sliding_window=24, query_pre_attn_scalar=32, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
            tie_word_embeddings=False,
        ),
    ),
    "mistral-windowed": (
        "MistralConfig", "MistralForCausalLM",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=20),
    ),
    "qwen3-moe-normed": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, decoder_sparse_step=2,
        ),
    ),
}


# Families whose queries and keys are scaled up (by this) at creation, so that greedy tokens
# depend on RoPE: a random model's scores are near zero, and what a token attends to with them
# hardly depends on how the keys were rotated.
SHARP_ATTENTION = {"phi3-longrope": 4.0, "llama-dynamic": 4.0}


def make_tiny_model(
    target: Path, tokenizer_dir: Path, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """A random-weight checkpoint of one of ``TINY_FAMILIES``, saved by transformers itself with the
    tokenizer of ``tokenizer_dir`` (in shards of ``max_shard_size``, with their index, if given)."""
    import transformers
    from transformers import AutoTokenizer

    config_name, model_name, shape = TINY_FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    settings = dict(
        vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    settings.update(shape)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**settings)).float()
    with torch.no_grad():
        if settings["tie_word_embeddings"]:  # the layers' outputs grow, or the input embedding drowns them
            for name, weight in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    weight.mul_(8.0)
        else:
            model.lm_head.weight.mul_(8.0)  # no near-ties among greedy choices
        if family in SHARP_ATTENTION:  # peaked scores: a token's rotation decides what it attends to
            config = model.config
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            qk_rows = (config.num_attention_heads + config.num_key_value_heads) * head_dim
            for name, weight in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    weight.mul_(SHARP_ATTENTION[family])
                elif name.endswith("qkv_proj.weight"):  # Phi-3's fused q, k, v: q's and k's rows
                    weight[:qk_rows].mul_(SHARP_ATTENTION[family])
    model.save_pretrained(str(target), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(str(target))
    return target


def make_compressed_checkpoint(
    source: Path, target: Path, num_bits: int = 4, group_size: int | None = 32, dtype=torch.float32, symmetric: bool = True
) -> Path:
    """``source`` quantized as llm-compressor leaves a W4A16 / W8A16 checkpoint: compressed-tensors
    itself applies the scheme, computes each group's scale from its min and max (as its min-max
    observer does), packs the codes (``pack-quantized``) and writes ``quantization_config``.
    ``group_size=None`` gives a scale per output channel; the scales take ``dtype``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    args = QuantizationArgs(
        num_bits=num_bits, type="int", symmetric=symmetric, strategy="group" if group_size else "channel", group_size=group_size,
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                weight = module.weight
                groups = weight.view(weight.shape[0], -1, group_size or weight.shape[1])
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
                module.weight_scale.copy_(scale.view_as(module.weight_scale))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero_point.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(target))
    compressor.update_config(str(target))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(target))
    return target


def refusals(path: Path, tmp_path: Path, edits: dict) -> None:
    """For each ``message: edit``, ``path`` linked file by file into a folder of ``tmp_path`` with
    its ``quantization_config`` changed by ``edit``: loading it is refused with ``message``."""
    from duet import LLM
    from duet.errors import UnsupportedCheckpointError

    config = json.loads((path / "config.json").read_text())
    for index, (message, edit) in enumerate(edits.items()):
        edited = tmp_path / f"edited-{index}"
        edited.mkdir(parents=True)
        for file in path.iterdir():
            if file.name != "config.json":
                (edited / file.name).symlink_to(file)
        changed = json.loads(json.dumps(config))
        edit(changed["quantization_config"])
        (edited / "config.json").write_text(json.dumps(changed))
        with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)):
            LLM(model=str(edited), num_kv_blocks=16)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer_dir)


def k_quant_blocks(rows: int, cols: int, qtype: int, magnitude: float, seed: int = 0):
    """Random Q4_K, Q5_K or Q6_K super-blocks (gguf's quantizer makes none): random codes and
    integer scales under fp16 super-block scales up to ``magnitude``; ``[rows, cols / 256 * bytes]``
    uint8."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    with_min = qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K)
    blocks = rng.integers(0, 256, (rows, cols // 256, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)][1]), dtype=np.uint8)
    scales = (rng.random((rows, cols // 256, 2)) * magnitude).astype(np.float16).view(np.uint8)
    if with_min:
        blocks[..., 0:4] = scales  # d, dmin
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
    up Q4_K (``k_quant``: Q5_K for a Q5_K_M file's), o, down and the LM head Q6_K (random
    super-blocks: gguf quantizes to none of them)."""
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
            magnitude = (0.0004 if k_quant == "Q4_K" else 0.0001) if q4_k else 0.00005  # Q5_K's codes reach 31
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
}


def write_tiny_gguf(path: Path, tokenizer_dir: Path, family: str, seed: int = 0, projections: str = "Q8_0", **overrides) -> Path:
    """One of ``TINY_FAMILIES`` (Llama, Qwen 2, Qwen 3, Qwen 3 MoE, Phi-3) written as
    llama.cpp's converter writes a GGUF file, with gguf's own writer: its architecture's
    metadata keys, projections in ``projections`` (Q8_0, Q4_0: gguf's quantizer; Q5_K: random
    super-blocks, its sizes multiples of 256), a MoE layer's experts stacked in one tensor per
    projection (quantized so too) and its router in F32, the embedding in F16, norms and biases
    in F32, a Llama's Q/K rows interleaved for its RoPE, and the tokenizer (byte-level BPE: its
    tokens, types, merges, special ids and chat template) from ``tokenizer_dir``."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    arch = {"qwen3-moe": "qwen3moe"}.get(family, family)
    source_dir = path.parent / f"{path.stem}-source"
    if family == "llama":
        source = make_tiny_llama(source_dir, tokenizer_dir, seed, **overrides)
    else:
        source = make_tiny_model(source_dir, tokenizer_dir, family, seed, **overrides)
    config = json.loads((source / "config.json").read_text())
    state = {name: tensor.float().numpy() for name, tensor in load_file(str(source / "model.safetensors")).items()}
    for name in [name for name in state if ".mlp.experts.0." in name]:  # stacked: [experts, out, in]
        per_expert = [state.pop(name.replace(".experts.0.", f".experts.{e}.")) for e in range(config["num_local_experts"])]
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
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
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
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())
    for name, value in state.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = interleave(value, heads if "q_proj" in name else kv_heads)
        if value.ndim >= 2 and "embed" not in name and not name.endswith("mlp.gate.weight"):
            qtype = getattr(gguf.GGMLQuantizationType, projections)
            if projections.endswith("_K"):  # gguf quantizes to no K-quant
                blocks = k_quant_blocks(*value.shape, int(qtype), magnitude=0.0001, seed=len(gguf_name) + value.shape[0])
                writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        elif "embed" in name:
            writer.add_tensor(gguf_name, value.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_tiny_gguf_llama(tmp_path_factory.mktemp("tiny-gguf-llama"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def parity_prompts(smollm2_tokenizer) -> list[list[int]]:
    from duet.benchmarks.prompts import encode_conversations, parity_conversations

    return encode_conversations(smollm2_tokenizer, parity_conversations())


@pytest.fixture(scope="session")
def parity_references(smollm2_dir, parity_prompts):
    """transformers' greedy tokens for the 16 parity prompts, computed once per test session."""
    from duet.benchmarks.prompts import PARITY_NEW_TOKENS
    from tests.reference import hf_greedy

    return hf_greedy(smollm2_dir, parity_prompts, PARITY_NEW_TOKENS)
