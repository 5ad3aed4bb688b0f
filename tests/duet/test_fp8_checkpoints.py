"""Hugging Face FP8 checkpoints (``quant_method: fp8``: Qwen 3's and DeepSeek's FP8 releases),
written by transformers' own FP8 quantizer (``tests/fp8_writer.py``): their float8 weights are
kept as float8 blocks (``duet.models.float8``) that dequantize to transformers' own dequantization
bit for bit, greedy output equals transformers running the same checkpoint (on a CPU it
dequantizes the weights and keeps the inputs in floats, as duet does), and what duet does not
compute that way is refused, naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from duet import LLM
from duet.errors import DamagedCheckpointError
from duet.kernels.gguf import F8
from duet.models.linear import Linear
from tests.conftest import make_tiny_model, refusals
from tests.duet.test_packed_checkpoints import NEW_TOKENS, PROMPTS, _greedy
from tests.fp8_writer import make_hf_fp8_checkpoint
from tests.reference import check_outputs, hf_greedy

# (family, shape overrides, weight block): 128 x 128 blocks as Qwen ships them need whole blocks
# (transformers leaves a weight that is not in floats); intermediate 320 is 2.5 blocks: the MLP
# stays in floats beside float8 attention. None: one scale a tensor.
SCHEMES = {
    "qwen3-block128": ("qwen3", dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64), (128, 128)),
    "llama-tensor": ("llama3-rope", {}, None),
    "qwen3-block128-float-mlp": ("qwen3", dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=64), (128, 128)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir):
    made = {}

    def get(name: str):
        if name not in made:
            family, shape, block = SCHEMES[name]
            root = tmp_path_factory.mktemp(name)
            source = make_tiny_model(root / "float", tiny_tokenizer_dir, family, **shape)
            path = make_hf_fp8_checkpoint(source, root / "fp8", block)
            made[name] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS))
        return made[name]

    return get


@pytest.mark.parametrize("name", list(SCHEMES))
def test_an_fp8_checkpoint_computes_from_its_float8_weights_and_matches_transformers(checkpoints, name):
    path, references = checkpoints(name)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, name)
    llm.engine.check_integrity()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_float8_blocks_are_transformers_dequantization_bit_for_bit_and_no_float_copy_is_kept(checkpoints, name):
    """Each float8 weight (fused q/k/v and gate/up: their parts' rows) dequantizes to what
    transformers' own ``Fp8Dequantize`` gives in fp32, at a byte a weight and no float copy; a
    weight transformers left in floats stays a float weight."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from duet.models.loader import _fusion_plan, load_model

    path, _ = checkpoints(name)
    state = load_file(str(path / "model.safetensors"))
    model = load_model(path, torch.float32, "cpu", 256)
    plan = _fusion_plan(model.arch)
    dequantize = Fp8Dequantize(None)._dequantize_one
    kept = 0
    for module_name, linear in model.named_modules():
        if not isinstance(linear, Linear) or module_name == "lm_head":
            continue
        parts = plan[f"{module_name}.weight"]
        if state[parts[0]].dtype != torch.float8_e4m3fn:
            assert linear.gguf is None and linear.weight is not None, module_name
            continue
        expected = torch.cat([dequantize(state[part], state[part + "_scale_inv"], torch.float32) for part in parts])
        assert linear.weight is None and linear.packed_weight is None, f"{module_name} keeps a float weight"
        assert linear.gguf.qtype == F8 and linear.gguf.codes.numel() == expected.numel()
        assert torch.equal(linear.gguf.dequantize(), expected), module_name
        kept += 1
    assert kept == (2 if name.endswith("float-mlp") else 4) * model.arch.num_layers


def test_block_scales_cover_partial_blocks_as_other_writers_ship_them():
    """DeepSeek's writer ships a scale grid of ceil(out / 128) x ceil(in / 128) where a weight is
    no whole number of blocks: each weight takes its block's scale, the last blocks partial."""
    from duet.kernels import cpu_ops
    from duet.models.float8 import float8_weight
    from duet.models.packed import PackedScheme

    ops = cpu_ops.load_gguf()
    if ops is None:
        pytest.skip("no C++ toolchain")
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(200, 320, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=generator) + 0.5
    state = {"x.weight": weight, "x.weight_scale_inv": scale_inv}
    scheme = PackedScheme(8, None, format="fp8", float8_block=(128, 128))
    blocks = float8_weight(state, ["x.weight"], scheme, "ckpt", ops)
    rows, columns = torch.arange(200) // 128, torch.arange(320) // 128
    assert torch.equal(blocks.dequantize(), weight.float() * scale_inv[rows][:, columns])
    state["x.weight_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(DamagedCheckpointError, match=r"x.weight_scale_inv has shape \(2, 2\) where blocks of 128 x 128 give \(2, 3\)"):
        float8_weight(state, ["x.weight"], scheme, "ckpt", ops)
    state["x.weight_scale_inv"], state["x.weight"] = scale_inv, weight.clone()
    state["x.weight"].view(torch.uint8)[3, 7] = 0x7F
    with pytest.raises(DamagedCheckpointError, match="x.weight holds NaN codes"):
        float8_weight(state, ["x.weight"], scheme, "ckpt", ops)


def test_fp8_configs_duet_does_not_compute_as_transformers_does_are_refused_naming_the_field(checkpoints, tmp_path):
    path, _ = checkpoints("qwen3-block128")
    refusals(path, tmp_path, {
        "activation_scheme='static' is not supported": lambda q: q.update(activation_scheme="static"),
        "fmt='e5m2' is not supported": lambda q: q.update(fmt="e5m2"),
        "weight_block_size=[128, 48] is not supported": lambda q: q.update(weight_block_size=[128, 48]),
        "scale_fmt='e4m3' is not supported": lambda q: q.update(scale_fmt="e4m3"),
    })
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    config = json.loads((damaged / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 128]  # the grid no longer fits the scales
    (damaged / "config.json").write_text(json.dumps(config))
    with pytest.raises(DamagedCheckpointError, match="weight_scale_inv has shape"):
        LLM(model=str(damaged), num_kv_blocks=16)
