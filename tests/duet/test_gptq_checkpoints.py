"""GPTQ and AWQ checkpoints written by GPTQModel (``tests/gptq_writer.py``): GPTQ at 4 and 8
bits, groups of 32 and 128 and a scale per channel, symmetric and not, the ``gptq`` format it is
published in; AWQ's ``gemm``, ``gemv`` and ``gemv_fast`` formats and llm-awq's, with zero points
and without.
Each packed weight computes from blocks that equal the checkpoint's exact weights ``s * (q -
z)`` (gemv_fast's and llm-awq's ``s * q + m``, their zeros stored scaled) bit for bit (and
those, computed in bf16, equal GPTQModel's own dequantization: its
packing, zeros and groups read right), no float copy is kept, and greedy output equals
transformers on those exact weights; an activation-ordered GPTQ checkpoint takes its input in
its groups' order. What duet does not read (other bit widths and formats) is refused at load
naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from duet import LLM, SamplingParams
from duet.kernels.gguf import Q8Z
from duet.models.linear import Linear
from tests.conftest import make_tiny_model, refusals
from tests.gptq_writer import Quantization, gptq_checkpoints
from tests.reference import check_outputs, hf_greedy

pytestmark = pytest.mark.slow  # GPTQModel quantizes the checkpoints in a child process (~40 s)

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917))]
NEW_TOKENS = 10
WIDE = dict(hidden_size=128, intermediate_size=256)  # groups of 128 need 128-wide inputs
# (family, bits, group size (-1: a scale per channel), symmetric, shape overrides, method[, activation order])
SCHEMES = {
    "qwen3-w4-g32-sym": ("qwen3", 4, 32, True, {}, "gptq"),
    "llama-w4-g128-asym": ("llama3-rope", 4, 128, False, WIDE, "gptq"),
    "qwen2-w4-g128-asym": ("qwen2", 4, 128, False, {}, "gptq"),  # q/k/v biases; 64 input features: one short group
    "qwen3-w8-channel-sym": ("qwen3", 8, -1, True, {}, "gptq"),
    "llama-w8-g32-asym": ("llama3-rope", 8, 32, False, {}, "gptq"),  # zeros off the middle: q beside z (Q8Z)
    "llama-w4-g32-asym-act-order": ("llama3-rope", 4, 32, False, {}, "gptq", True),
    "phi3-w4-g32-sym": ("phi3", 4, 32, True, {}, "gptq"),  # GPTQModel writes its gate/up as two projections
    # AWQ's clip search takes output features 64 at a time: k/v projections of 64
    "llama-awq-g128-zero": ("llama3-rope", 4, 128, False, WIDE | dict(num_key_value_heads=2), "awq"),
    "qwen3-awq-g32-sym": ("qwen3", 4, 32, True, dict(intermediate_size=128), "awq"),
    "llama-awq-gemv-g128-zero": ("llama3-rope", 4, 128, False, WIDE | dict(num_key_value_heads=2), "awq-gemv"),
    "qwen3-awq-gemv-g64-sym": ("qwen3", 4, 64, True, dict(intermediate_size=128), "awq-gemv"),  # gemv: groups of 64 or 128
    "llama-awq-gemv_fast-g128-zero": ("llama3-rope", 4, 128, False, WIDE | dict(num_key_value_heads=2), "awq-gemv_fast"),
    "qwen3-awq-llm-awq-g32-zero": ("qwen3", 4, 32, False, dict(intermediate_size=128), "awq-llm-awq"),
}
FAST = ("gemv_fast", "llm-awq")  # AWQ versions whose zeros are stored scaled: the weight is s * q + m
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's: code i of a word is feature AWQ_ORDER[i] of its 8


def _unpack(words: torch.Tensor, bits: int, along_rows: bool, order=None) -> torch.Tensor:
    """The packing, read code by code: a word holds ``32 / bits`` codes of its column
    (``along_rows``) or of its row, the first in the lowest bits, code ``i`` the ``order[i]``-th."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    codes = [(words >> (bits * i)) & mask for i in range(per_word)]
    if order is not None:
        codes = [codes[order.index(position)] for position in range(per_word)]
    stacked = torch.stack(codes, dim=1 if along_rows else 2)
    return stacked.reshape(words.shape[0] * per_word, -1) if along_rows else stacked.reshape(words.shape[0], -1)


def _gemm_codes(state, base: str, bits: int, awq: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's or AWQ gemm's codes ``[in, out]`` and stored zeros ``[groups, out]`` of ``base``."""
    order = AWQ_ORDER if awq else None
    q = _unpack(state[base + ".qweight"], bits, along_rows=not awq, order=order)  # [in, out]
    return q, _unpack(state[base + ".qzeros"], bits, along_rows=False, order=order)[:, : q.shape[1]]


def _exact_weights(path, scale_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Each linear's weight ``[out, in]`` in fp32, exact: ``s[g] * (q - z)`` for the group ``g``
    of each input feature (GPTQ: ``g_idx``'s, its ``z`` the stored zero + 1; AWQ: in order),
    its scale first rounded to ``scale_dtype``; gemv_fast's and llm-awq's ``s[g] * q + m[g]``,
    ``q`` read from the checkpoint's gemm twin, which GPTQModel packed from the same codes
    (``test_a_fast_checkpoint_holds_its_gemm_twins_scales_and_zeros``)."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    bits, awq = config["bits"], config["quant_method"] == "awq"
    state = load_file(str(path / "model.safetensors"))
    twin = load_file(str(path.with_name(path.name + "-gemm-twin") / "model.safetensors")) if config.get("version") in FAST else None
    weights = {}
    for name in state:
        if not name.endswith(".qweight"):
            continue
        base = name[: -len(".qweight")]
        if twin is not None:
            q = _gemm_codes(twin, base, bits, awq=True)[0].T  # [out, in]
            groups = torch.arange(q.shape[1]) // config["group_size"]
            zeros = ".qzeros" if config["version"] == "gemv_fast" else ".scaled_zeros"
            scales, mins = (state[base + suffix][: int(groups[-1]) + 1].T.to(scale_dtype).float()[:, groups] for suffix in (".scales", zeros))
            weights[base + ".weight"] = scales * q.float() + mins
        elif config.get("version") == "gemv":  # [out, in], each word's codes in order
            q = _unpack(state[name], bits, along_rows=False)
            groups = torch.arange(q.shape[1]) // config["group_size"]
            zeros = _unpack(state[base + ".qzeros"], bits, along_rows=False)[:, groups]
            weights[base + ".weight"] = state[base + ".scales"].to(scale_dtype).float()[:, groups] * (q - zeros).float()
        else:
            q, zeros = _gemm_codes(state, base, bits, awq)
            zeros = zeros + (0 if awq else 1)
            group = config["group_size"] if config["group_size"] > 0 else q.shape[0]
            groups = torch.arange(q.shape[0]) // group if awq else state[base + ".g_idx"].long()
            weight = state[base + ".scales"].to(scale_dtype).float()[groups] * (q - zeros[groups]).float()
            weights[base + ".weight"] = weight.T.contiguous()
    return weights


def _exact_twin(path, target):
    """The checkpoint as a float one: its exact weights in place of the packed tensors."""
    from safetensors.torch import load_file, save_file

    weights = _exact_weights(path)
    packed = (".qweight", ".scales", ".qzeros", ".scaled_zeros", ".g_idx")  # a linear's packed tensors (its bias stays)
    state = {name: tensor for name, tensor in load_file(str(path / "model.safetensors")).items() if not name.endswith(packed)}
    target.mkdir()
    for file in path.iterdir():
        if file.name not in ("model.safetensors", "config.json") and file.is_file():
            shutil.copy(file, target / file.name)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    state |= weights
    if config["architectures"] == ["Phi3ForCausalLM"]:  # transformers' Phi-3 reads gate and up as one
        for gate in [name for name in state if name.endswith(".mlp.gate_proj.weight")]:
            state[gate.replace("gate_proj", "gate_up_proj")] = torch.cat([state.pop(gate), state.pop(gate.replace("gate_proj", "up_proj"))])
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir):
    """Every scheme's checkpoint, written on first use (all in one GPTQModel process), with its
    reference folder and transformers' tokens on its exact weights."""
    made = {}

    def get(name: str):
        if not made:
            roots, jobs = {}, []
            for scheme, (family, bits, group_size, sym, shape, method, *act_order) in SCHEMES.items():
                root = roots[scheme] = tmp_path_factory.mktemp(scheme)
                source = make_tiny_model(root / "float", tiny_tokenizer_dir, family, **shape)
                method, _, layout = method.partition("-")  # awq-gemv: AWQ in its gemv layout, awq-llm-awq llm-awq's
                settings = (bits, group_size, sym, any(act_order), method, layout or "gemm")
                jobs.append(Quantization(source, root / "packed", root / "reference", *settings))
            gptq_checkpoints(jobs, tmp_path_factory.mktemp("gptqmodel"))
            for scheme, root in roots.items():
                twin = _exact_twin(root / "packed", root / "twin")
                made[scheme] = (root / "packed", root / "reference", hf_greedy(twin, PROMPTS, NEW_TOKENS))
        return made[name]

    return get


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_gptq_checkpoint_computes_from_its_codes_and_matches_transformers(checkpoints, name):
    path, _, references = checkpoints(name)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    if name.startswith("llama"):  # the C++ decoder stack computes its steps (Qwen's parts are Python's)
        assert llm.engine.executor.worker.runner.model.decoder_stack() is not None
    check_outputs(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)), references, name)
    llm.engine.check_integrity()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_blocks_are_the_exact_weights_and_gptqmodel_reads_them_so(checkpoints, name):
    """Fused products hold their parts' rows; symmetric 4-bit weights are Q4_1 blocks, 4-bit
    ones with zero points off the middle and symmetric 8-bit ones int8 codes (Q8_0), 8-bit ones
    with zero points off the middle their codes beside each block's zero (Q8Z). GPTQModel dequantizes in the
    model's dtype (bf16; fp16 for a gemv checkpoint's twin): its scales rounded to it, then their products."""
    from safetensors.torch import load_file

    from duet.models.loader import _fusion_plan, load_model

    path, reference, _ = checkpoints(name)
    theirs = load_file(str(reference / "dequantized.safetensors"))
    dtype = next(iter(theirs.values())).dtype
    fast = SCHEMES[name][5].partition("-")[2] in FAST  # GPTQModel dequantizes its gemm twin
    ours = _exact_weights(path.with_name(path.name + "-gemm-twin") if fast else path, scale_dtype=dtype)
    assert sorted(theirs) == sorted(ours)
    for part, weight in ours.items():
        assert torch.equal(weight.to(dtype), theirs[part]), part
    exact = _exact_weights(path)
    model = load_model(path, torch.float32, "cpu", 256)
    plan = _fusion_plan(model.arch)
    _, bits, _, sym, _, _, *act_order = SCHEMES[name]
    state = load_file(str(path / "model.safetensors"))
    checked = 0
    for module_name, linear in model.named_modules():
        if not isinstance(linear, Linear) or module_name == "lm_head":
            continue
        assert linear.weight is None and linear.packed_weight is None, f"{module_name} keeps a float weight"
        parts = plan[f"{module_name}.weight"]
        weight = torch.cat([exact[part] for part in parts])
        if any(act_order):  # its columns: the input features sorted by group (their g_idx)
            g_idx = state[parts[0].removesuffix("weight") + "g_idx"]
            assert not torch.equal(g_idx, g_idx.sort().values), module_name  # GPTQModel did reorder them
            order = torch.argsort(g_idx, stable=True)
            assert torch.equal(linear.input_order, order), module_name
            weight = weight[:, order]
        else:
            assert linear.input_order is None, module_name
        assert torch.equal(linear.gguf.dequantize(), weight), module_name
        assert linear.gguf.qtype == (3 if bits == 4 and (sym or fast) else Q8Z if bits == 8 and not sym else 8), module_name
        checked += 1
    assert checked == 4 * model.arch.num_layers  # q/k/v, o, gate/up, down


@pytest.mark.parametrize("name", [name for name, scheme in SCHEMES.items() if scheme[5].partition("-")[2] in FAST])
def test_a_fast_checkpoint_holds_its_gemm_twins_scales_and_zeros(checkpoints, name):
    """GPTQModel packs a gemv_fast (or llm-awq) checkpoint and its gemm twin from the same codes,
    scales and zeros: its scales are the twin's, padded with zero rows past the last group, and
    its mins the twin's ``-(s * z)`` rounded to fp16. So ``_exact_weights`` may read a fast
    checkpoint's codes from its twin, and duet's blocks equal to those weights read its packing right."""
    from safetensors.torch import load_file

    path, _, _ = checkpoints(name)
    state = load_file(str(path / "model.safetensors"))
    twin = load_file(str(path.with_name(path.name + "-gemm-twin") / "model.safetensors"))
    zeros_name = ".qzeros" if "gemv_fast" in name else ".scaled_zeros"
    bases = [name[: -len(".qweight")] for name in twin if name.endswith(".qweight")]
    assert len(bases) == 14
    for base in bases:
        _, zeros = _gemm_codes(twin, base, 4, awq=True)
        scales = twin[base + ".scales"]
        groups = scales.shape[0]
        assert torch.equal(state[base + ".scales"][:groups], scales), base
        assert not state[base + ".scales"][groups:].any(), base
        assert torch.equal(state[base + zeros_name][:groups], -(scales.float() * zeros.float()).half()), base


def test_what_duet_does_not_read_is_refused_naming_the_field(checkpoints, tmp_path):
    path, _, _ = checkpoints("qwen3-w4-g32-sym")
    refusals(path, tmp_path, {
        "bits=3 is not supported": lambda q: q.update(bits=3),
        "group_size=16 is not supported": lambda q: q.update(group_size=16),
        "checkpoint_format='marlin' is not supported": lambda q: q.update(checkpoint_format="marlin"),
    })
    awq, _, _ = checkpoints("qwen3-awq-g32-sym")
    refusals(awq, tmp_path / "awq", {
        "version='gemv_slow' is not supported": lambda q: q.update(version="gemv_slow"),
        "bits=8 is not supported: duet reads 4": lambda q: q.update(bits=8),
    })


def test_an_activation_ordered_mlp_splits_by_whole_groups_of_its_order(checkpoints):
    """Tensor parallelism splits gate/up by rows and down by input features; down's groups are
    spread over its input features (GPTQ's activation order), so each rank takes whole groups of
    down's own order, gate/up compute those features in it, and down's shard takes its input as
    it comes: its blocks are the whole weight's, the ranks' parts add up to the whole product.
    (Before, a split of down was refused and such a checkpoint ran at TP=1 only.)"""
    from duet.models.loader import load_model
    from duet.models.tensor_parallel import _shard_dense_mlp, split_range

    path, _, _ = checkpoints("llama-w4-g32-asym-act-order")
    mlp = load_model(path, torch.float32, "cpu", 256).layers[0].mlp
    down = mlp.down_proj
    assert down.input_order is not None
    x = torch.randn(5, mlp.gate_up_proj.in_features)
    parts = []
    for rank in range(2):
        shard = load_model(path, torch.float32, "cpu", 256).layers[0].mlp
        dense = split_range(down.in_features, 2, rank, 32)
        _shard_dense_mlp(shard, dense)
        assert shard.down_proj.input_order is None
        assert torch.equal(shard.down_proj.part_of.columns, down.input_order[dense])
        assert torch.equal(shard.down_proj.gguf.dequantize(), down.gguf.dequantize()[:, dense])
        parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1], mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-w4-g32-asym-act-order", "llama-awq-gemv_fast-g128-zero"])
def test_an_activation_ordered_or_gemv_fast_checkpoint_at_tp2_matches_transformers(ray_cluster, checkpoints, name):
    """An activation-ordered one's o_proj's groups span both ranks' heads: each rank gathers the
    heads' outputs and computes it whole (``WholeInput``); its down projection splits as above.
    A gemv_fast one's Q4_1 blocks split with their mins."""
    path, _, references = checkpoints(name)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        check_outputs(llm.generate(PROMPTS, params), references, f"{name} at TP=2")
    finally:
        llm.engine.close()


def test_a_gemv_checkpoint_short_of_its_groups_is_refused_naming_the_tensor(checkpoints, tmp_path):
    """AWQ gemv pads its zeros and scales past the last group; fewer than the groups is damage."""
    from safetensors.torch import load_file, save_file

    from duet.errors import DamagedCheckpointError

    path, _, _ = checkpoints("llama-awq-gemv-g128-zero")
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    state = load_file(str(damaged / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.scales"  # 256 input features: 2 groups of 128
    state[name] = state[name][:, :1].contiguous()
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DamagedCheckpointError, match=r"down_proj\.scales is torch\.float16 \(128, 1\), where 4-bit AWQ gemv .* 2 groups"):
        LLM(model=str(damaged), num_kv_blocks=64, max_model_len=256)


def test_a_gemv_fast_checkpoint_with_int32_words_is_refused_naming_the_tensor(checkpoints, tmp_path):
    """gemv_fast packs four codes in each int16; int32 words there are another layout's."""
    from safetensors.torch import load_file, save_file

    from duet.errors import DamagedCheckpointError

    path, _, _ = checkpoints("llama-awq-gemv_fast-g128-zero")
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    state = load_file(str(damaged / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.qweight"
    state[name] = state[name].to(torch.int32)
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DamagedCheckpointError, match=r"o_proj\.qweight is torch\.int32 \(32, 128\), where 4-bit AWQ gemv_fast codes give int16"):
        LLM(model=str(damaged), num_kv_blocks=64, max_model_len=256)
