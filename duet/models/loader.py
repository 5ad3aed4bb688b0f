"""Find a model by alias, path or Hugging Face hub id and load its safetensors weights into duet's
own modules."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch

from duet.errors import CheckpointError, DamagedCheckpointError, UnsupportedCheckpointError
from duet.kernels.w8a8 import StaticInput
from duet.models.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, model_class
from duet.models.bf16_weights import bf16_linears, keep_bf16
from duet.models.gguf_convert import GGUF_BLOCKS_FILE
from duet.models.linear import Linear
from duet.models.llama import LlamaArch, LlamaForCausalLM
from duet.models.mixtral import MixtralArch
from duet.models.input_schemes import input_schemes
from duet.models.packed import is_packed, packed_weight, read_scheme
from duet.models.quantize import LOAD_TIME_QUANTIZATIONS, QuantizationError, quantize_linears

ROTARIES = ("rotary", "local_rotary", "no_rotary")  # a model's RoPE tables (``RotaryEmbedding``), or None
MODEL_ALIASES = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m-instruct": "SmolLM2-135M-Instruct"}
# A hub repository's files that serving reads: config and generation config, weights and their
# index, tokenizer and its chat template.
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model")
# What some repositories ship beside that and duet does not read: Mistral's own format (the same
# weights again, in one file), Meta's originals.
HUB_SKIPPED = ("consolidated*", "original/*")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")  # org/name[@revision]
# A Phi-3 checkpoint whose gate and up projections are two tensors (as GPTQModel writes it), its
# q/k/v still one: ``arch.checkpoint_names`` once the file is read.
PHI3_SPLIT_MLP = "phi3-split-mlp"

logger = logging.getLogger(__name__)


class ModelNotFoundError(CheckpointError):
    """The model name is neither a known alias, a Hugging Face model directory, a GGUF file nor a
    hub repository with a snapshot here or on the hub."""


def resolve_model_path(model: str) -> Path:
    """An alias (``smollm2``), a directory holding ``config.json`` and ``*.safetensors``, a
    GGUF file (converted once into the cache: ``gguf_convert.ensure_converted``), or a Hugging
    Face hub repository id (``org/name``, ``org/name@revision``) that names no local path: its
    snapshot in huggingface_hub's cache (``HF_HUB_CACHE``), fetched there first where the hub
    can be reached (``HF_HUB_OFFLINE=1``: the cache alone)."""
    if model.lower() in MODEL_ALIASES:
        from duet.models.gguf_convert import ensure_smollm2

        return ensure_smollm2()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.suffix == ".gguf" and path.is_file():
        from duet.models.gguf_convert import ensure_converted

        return ensure_converted(path)
    if HUB_ID.fullmatch(model) and not path.exists():
        return _hub_snapshot(model)
    raise ModelNotFoundError(
        f"model {model!r} is not a known alias ({', '.join(sorted(MODEL_ALIASES))}), "
        "a directory with a Hugging Face config.json, a .gguf file, nor a hub id (org/name)"
    )


def _hub_snapshot(model: str) -> Path:
    """The folder of a hub repository's snapshot (``HUB_FILES``), cached or fetched."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = model.partition("@")
    try:
        folder = Path(snapshot_download(
            repo_id, revision=revision or None, allow_patterns=list(HUB_FILES), ignore_patterns=list(HUB_SKIPPED),
        ))
    except Exception as error:  # noqa: BLE001 - unknown, gated, or neither reachable nor cached: said in the message
        raise ModelNotFoundError(
            f"model {model!r} names no local directory, and the Hugging Face hub gave no snapshot of it: {error}"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model {model!r}: its hub snapshot ({folder}) has no config.json, which duet reads a checkpoint by")
    return folder


def max_positions(path: Path) -> int:
    """The longest sequence the model's position table holds (``LlamaArch.max_sequence_len``)."""
    return read_arch(path).max_sequence_len


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """The EOS ids of the checkpoint's ``generation_config.json`` (none without one)."""
    config_path = path / "generation_config.json"
    if not config_path.is_file():
        return ()
    eos = json.loads(config_path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():  # the shards it names (a repository may ship other files too: Mistral's consolidated one)
        files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _fusion_plan(arch: LlamaArch) -> dict[str, list[str]]:
    """Each of duet's parameters and the Hugging Face tensors it is made of (rows concatenated:
    q/k/v and gate/up projections are fused; Phi-3 ships them fused, or its gate/up apart), by
    the family's names (``arch.checkpoint_names``)."""
    plan = {
        "embed_tokens.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
        "lm_head.weight": ["model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"],
    }
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        out = f"layers.{layer}."
        norms = ["input_layernorm", "post_attention_layernorm"] + (["pre_feedforward_layernorm", "post_feedforward_layernorm"] if arch.sandwich_norms else [])
        for norm in norms if arch.pre_norms else ["post_attention_layernorm", "post_feedforward_layernorm"]:
            plan[out + f"{norm}.weight"] = [prefix + f"{norm}.weight"]
        qkv_fused = arch.checkpoint_names in ("phi3", PHI3_SPLIT_MLP)
        plan[out + "self_attn.qkv_proj.weight"] = (
            [attn + "qkv_proj.weight"] if qkv_fused else [attn + f"{name}_proj.weight" for name in "qkv"]
        )
        plan[out + "self_attn.o_proj.weight"] = [attn + "o_proj.weight"]
        if arch.qkv_bias:
            plan[out + "self_attn.qkv_bias"] = [attn + f"{name}_proj.bias" for name in "qkv"]
        if arch.o_bias:
            plan[out + "self_attn.o_bias"] = [attn + "o_proj.bias"]
        if arch.qk_norm:
            plan[out + "self_attn.q_norm.weight"] = [attn + "q_norm.weight"]
            plan[out + "self_attn.k_norm.weight"] = [attn + "k_norm.weight"]
        if isinstance(arch, MixtralArch) and arch.checkpoint_names == "granitemoe":  # experts stacked, as the parameters are
            moe = prefix + "block_sparse_moe."
            plan[out + "mlp.gate.weight"] = [moe + "router.layer.weight"]
            plan[out + "mlp.w13"] = [moe + "input_linear.weight"]
            plan[out + "mlp.w2"] = [moe + "output_linear.weight"]
            if arch.shared_expert_intermediate_size:  # gate rows then up rows, as the experts'
                plan[out + "mlp.shared_expert.gate_up_proj.weight"] = [prefix + "shared_mlp.input_linear.weight"]
                plan[out + "mlp.shared_expert.down_proj.weight"] = [prefix + "shared_mlp.output_linear.weight"]
            continue
        if isinstance(arch, MixtralArch) and arch.is_sparse(layer):
            mixtral = arch.checkpoint_names == "mixtral"
            moe = prefix + ("block_sparse_moe." if mixtral else "mlp.")
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            experts = [f"{moe}experts.{expert}." for expert in range(arch.num_experts)]
            plan[out + "mlp.gate.weight"] = [moe + "gate.weight"]
            plan[out + "mlp.w13"] = [expert + f"{name}.weight" for expert in experts for name in (gate, up)]
            plan[out + "mlp.w2"] = [expert + f"{down}.weight" for expert in experts]
            if arch.shared_expert_intermediate_size:
                plan[out + "mlp.shared_expert.gate_up_proj.weight"] = [moe + f"shared_expert.{name}_proj.weight" for name in ("gate", "up")]
                plan[out + "mlp.shared_expert.down_proj.weight"] = [moe + "shared_expert.down_proj.weight"]
                plan[out + "mlp.shared_expert_gate.weight"] = [moe + "shared_expert_gate.weight"]
            continue
        plan[out + "mlp.gate_up_proj.weight"] = (
            [mlp + "gate_up_proj.weight"] if arch.checkpoint_names == "phi3" else [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        )
        plan[out + "mlp.down_proj.weight"] = [mlp + "down_proj.weight"]
        if arch.mlp_bias:
            plan[out + "mlp.gate_up_bias"] = [mlp + "gate_proj.bias", mlp + "up_proj.bias"]
            plan[out + "mlp.down_bias"] = [mlp + "down_proj.bias"]
    return plan


def _fused_state_dict(
    state: dict[str, torch.Tensor], arch: LlamaArch, path: Path, skip: set[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to duet's modules, fusing q/k/v and gate/up projections (all
    but ``skip``); a tensor the plan needs and the checkpoint lacks is named."""
    fused = {}
    for name, parts in _fusion_plan(arch).items():
        if name in skip:
            continue
        missing = [part for part in parts if part not in state]
        if missing:
            raise DamagedCheckpointError(f"{path}: tensor {missing[0]} is missing ({len(missing)} of the {len(parts)} that make {name})")
        try:
            fused[name] = torch.cat([state[part] for part in parts])
            if fused[name].dim() == 3:  # experts stacked in one tensor (Granite MoE's): their rows one after another
                fused[name] = fused[name].flatten(0, 1)
        except RuntimeError:
            shapes = ", ".join(f"{part} {tuple(state[part].shape)}" for part in parts)
            raise DamagedCheckpointError(f"{path}: the tensors that make {name} disagree in shape: {shapes}") from None
    return fused


def _packed_linears(
    model: LlamaForCausalLM, state: dict[str, torch.Tensor], path: Path, device: str, quantization: str | None, scheme
) -> dict[str, object]:
    """The Linears whose weights the checkpoint ships packed (``duet.models.packed``), by module
    name, as blocks on ``device`` with the order they take their input in (None: as given):
    none for a float checkpoint."""
    if scheme is None:
        return {}
    if quantization is not None:
        raise QuantizationError(f"{path} ships quantized ({scheme.num_bits}-bit weights): quantization={quantization!r} does not apply; leave it unset")
    plan = _fusion_plan(model.arch)
    ops = _block_kernels(device, f"the checkpoint's {scheme.num_bits}-bit weights")
    packed = {}
    for name, linear in model.named_modules():
        if isinstance(linear, Linear) and is_packed(state, plan[f"{name}.weight"], scheme):
            weight, order = packed_weight(state, plan[f"{name}.weight"], scheme, path, ops)
            weight = dataclasses.replace(weight, codes=weight.codes.to(device), scales=weight.scales.to(device))
            packed[name] = (weight, None if order is None else order.to(device))
    covered = {part for name in packed for part in plan[f"{name}.weight"]}
    shipped = {name for name in state if name == scheme.packed_name(base := name.rsplit(".", 1)[0] + ".weight") and scheme.ships_codes(state, base)}
    stray = sorted(shipped - {scheme.packed_name(part) for part in covered})
    if stray:
        raise UnsupportedCheckpointError(f"{path}: {stray[0]} ships packed, and duet computes it from floats only (quantized experts are not built)")
    logger.info("%s: %d linear weights kept as their packed %d-bit codes", path, len(packed), scheme.num_bits)
    return packed


def _gguf_backend(path: Path, dtype: torch.dtype, device: str, quantization: str | None):
    """How this load computes from the checkpoint's GGUF blocks: the C++ kernels' module on CPU,
    ``kernels.triton_gguf`` on a GPU, None when it does not. ``quantization=None`` takes them wherever they
    apply (float32, or bfloat16 on a CPU with AVX512_BF16; a checkpoint with blocks, CPU kernels
    that build); ``"gguf"`` insists;
    ``"dequantized"`` keeps the float weights alone."""
    if quantization == "dequantized":
        return None
    from duet.kernels import cpu_ops

    backend = None
    if (path / GGUF_BLOCKS_FILE).is_file() and dtype in (torch.float32, torch.bfloat16):
        if device == "cpu":
            backend = cpu_ops.load_gguf()
            if backend is not None and dtype == torch.bfloat16 and not backend.has_bf16():
                backend = None
        elif dtype == torch.float32:
            from duet.kernels import triton_gguf as backend
    if quantization == "gguf" and backend is None:
        raise ModelNotFoundError(
            f"quantization='gguf' needs a checkpoint converted from GGUF ({path / GGUF_BLOCKS_FILE}: "
            f"{'present' if (path / GGUF_BLOCKS_FILE).is_file() else 'missing'}), dtype float32 (not {dtype}; "
            "bfloat16 on a CPU with AVX512_BF16) and, on CPU, the C++ kernels (DUET_CPU_OPS=0 or no compiler turns them off)"
        )
    return backend


def _attach_gguf(model: LlamaForCausalLM, path: Path, backend) -> None:
    """Give each Linear whose every part has GGUF blocks of one type (``gguf/blocks.safetensors``,
    written by ``gguf_convert``) those blocks, fused as its float weight is, once their exact
    dequantization (rounded to bf16 for a bf16 model) is checked against that float weight (a
    mismatch keeps the module on its float weight, and says so)."""
    from safetensors import safe_open

    from duet.kernels.gguf import GGUFWeight

    with safe_open(str(path / GGUF_BLOCKS_FILE), "pt") as blocks_file:
        types = {name: int(qtype) for name, qtype in json.loads(blocks_file.metadata()["types"]).items()}
        blocks = {name: blocks_file.get_tensor(name) for name in blocks_file.keys()}
    plan = _fusion_plan(model.arch)
    for name, linear in model.named_modules():
        if not isinstance(linear, Linear):
            continue
        parts = plan[f"{name}.weight"]
        if not all(part in blocks for part in parts) or len({types[part] for part in parts}) != 1:
            continue
        rows = torch.cat([blocks[part] for part in parts]).to(linear.weight.device)
        weight = GGUFWeight.from_blocks(rows, types[parts[0]], linear.in_features, backend)
        if torch.equal(weight.dequantize().to(linear.weight.dtype), linear.weight):
            linear.attach_gguf(weight)
        else:
            logger.warning("%s: its GGUF blocks do not dequantize to its float weight; it computes from the float weight", name)


def read_arch(path: Path) -> LlamaArch:
    """The model's shape from its config alone (no weights): what sizes the KV cache. An
    architecture or a config part duet does not run is refused, named."""
    from transformers import AutoConfig

    raw_config = json.loads((path / "config.json").read_text())
    architectures = [a for a in raw_config.get("architectures") or [] if a in ARCHITECTURES]
    if not architectures:
        raise UnsupportedCheckpointError(
            f"{path}: architecture {raw_config.get('architectures')} is not supported; duet runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    read, _ = ARCHITECTURES[architectures[0]]
    try:
        return read(AutoConfig.from_pretrained(str(path)))
    except UnsupportedCheckpointError as error:
        raise UnsupportedCheckpointError(f"{path} ({architectures[0]}): {error}") from None


def load_model(
    path: Path, dtype: torch.dtype, device: str, max_positions: int, quantization: str | None = None
) -> LlamaForCausalLM:
    """Build duet's Llama from a Hugging Face directory, weights cast to ``dtype`` on ``device``
    (``bf16``: a bf16 checkpoint's linear weights kept in bf16, ``duet.models.bf16_weights``);
    with the checkpoint's GGUF blocks beside them where ``quantization`` allows (``_gguf_backend``),
    or with its linear weights quantized to blocks (``int8``, ``int4``, ``w8a8``: ``duet.models.quantize``)."""
    arch = read_arch(path)
    with torch.device("meta"):
        model = model_class(arch)(arch, max_positions)
    raw_state = _read_state_dict(path)
    if arch.checkpoint_names == "phi3" and not any(".mlp.gate_up_proj." in name for name in raw_state):
        model.arch = arch = dataclasses.replace(arch, checkpoint_names=PHI3_SPLIT_MLP)
    scheme = read_scheme(path)
    packed = _packed_linears(model, raw_state, path, device, quantization, scheme)
    plan = _fusion_plan(arch)
    linears = {name: plan[f"{name}.weight"] for name, module in model.named_modules() if isinstance(module, Linear)}
    inputs = input_schemes(linears, raw_state, path, scheme, packed)
    inputs = {name: how.to(device) if isinstance(how, StaticInput) else how for name, how in inputs.items()}
    kept = bf16_linears(model, raw_state, linears, dtype, device, quantization, skip=packed)
    for name in [*packed, *kept]:  # their blocks are their weights: no float copy is ever allocated
        model.get_submodule(name).weight = None
    # The RoPE tables are real even under the meta device (``RotaryEmbedding``): kept apart
    # from ``to_empty``, which would leave them uninitialised.
    rotaries = {name: getattr(model, name) for name in ROTARIES}
    for name in ROTARIES:
        setattr(model, name, None)
    model = model.to_empty(device=device)
    for name, rotary in rotaries.items():
        setattr(model, name, None if rotary is None else rotary.to(device))
    state = _fused_state_dict(raw_state, arch, path, skip={f"{name}.weight" for name in packed})
    del raw_state
    for name, (weight, order) in packed.items():
        linear = model.get_submodule(name)
        linear.attach_gguf(weight)
        linear.keep_blocks_only(dtype)
        linear.input_order = order
        linear.input_quantization = inputs.get(name)
        linear.use_int8_products()
    def checked(name: str, shape) -> torch.Tensor:
        tensor = state.pop(name)
        if tensor.shape != shape:
            raise DamagedCheckpointError(f"{path}: {', '.join(plan[name])} has shape {tuple(tensor.shape)} where config.json gives {tuple(shape)}")
        return tensor

    for name, param in model.named_parameters():
        tensor = checked(name, param.shape)
        if arch.norm_offset and name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w, added in fp32 as transformers does
            tensor = 1.0 + tensor.float()
        param.data = tensor.to(device=device, dtype=dtype).contiguous()
    for name in kept:
        linear = model.get_submodule(name)
        keep_bf16(linear, checked(f"{name}.weight", (linear.out_features, linear.in_features)))
    if quantization in LOAD_TIME_QUANTIZATIONS:
        quantize_linears(model, quantization, _block_kernels(device, f"quantization={quantization!r}"))
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.pack_for_cpu()
    if quantization in LOAD_TIME_QUANTIZATIONS:
        return model.eval()
    backend = _gguf_backend(path, dtype, device, quantization)
    if backend is not None:
        _attach_gguf(model, path, backend)
    return model.eval()


def _block_kernels(device: str, quantization: str):
    """The kernels that multiply by GGUF blocks on ``device``: C++ on CPU, Triton on a GPU
    (``quantization`` says what needs them, for the error)."""
    if device != "cpu":
        from duet.kernels import triton_gguf

        return triton_gguf
    from duet.kernels import cpu_ops

    backend = cpu_ops.load_gguf()
    if backend is None:
        raise QuantizationError(
            f"{quantization} computes on duet's C++ kernels, which are off (DUET_CPU_OPS=0) or did not build here"
        )
    return backend


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
