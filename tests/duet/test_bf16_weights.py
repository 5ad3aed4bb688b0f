"""``quantization: bf16``: a bf16 checkpoint computed in fp32 on CPU keeps its linear weights in
bf16 (``duet.models.bf16_weights``): the kernels' BF16 blocks widen each weight exactly, so the
tokens are transformers' on the checkpoint widened to fp32, at half the weight memory."""

from __future__ import annotations

import pytest
import torch

from duet import LLM, SamplingParams
from duet.kernels import cpu_ops
from duet.kernels.gguf import BF16, bf16_blocks
from duet.models.linear import Linear
from duet.models.quantize import QuantizationError
from tests.conftest import make_tiny_model
from tests.reference import check_outputs, hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917))]
NEW_TOKENS = 10

pytestmark = pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="the C++ kernels did not build here")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir):
    """Each family's tiny checkpoint saved in bf16, with transformers' greedy tokens on it in fp32."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(family: str):
        if family not in made:
            tied = family.endswith("-tied")  # hidden sizes of 64: every Linear a whole number of blocks
            floats = make_tiny_model(
                tmp_path_factory.mktemp(f"{family}-fp32"), tiny_tokenizer_dir, family.removesuffix("-tied"), **({"tie_word_embeddings": True} if tied else {})
            )
            path = tmp_path_factory.mktemp(f"{family}-bf16")
            AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).to(torch.bfloat16).save_pretrained(str(path))
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (floats / name).is_file():
                    (path / name).write_bytes((floats / name).read_bytes())
            made[family] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS, dtype=torch.float32))
        return made[family]

    return get


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _linears(path, quantization: str | None = None, dtype=torch.float32) -> dict[str, Linear]:
    from duet.models.loader import load_model

    model = load_model(path, dtype, "cpu", 256, quantization)
    return {name: module for name, module in model.named_modules() if isinstance(module, Linear)}


@pytest.mark.parametrize("family", ["qwen2-tied", "phi3", "qwen3-moe"])
def test_a_bf16_checkpoint_in_fp32_keeps_its_linears_in_bf16_and_matches_transformers(checkpoints, family):
    """Tied embeddings (the LM head's blocks from the embedding's bf16 rows), a file's fused
    q/k/v (Phi-3), experts (left widened): the same tokens as transformers in fp32, with and
    without the prefix cache, and every Linear's blocks the checkpoint's bf16 weights bit for bit."""
    path, references = checkpoints(family)
    llm = LLM(model=str(path), dtype="float32", quantization="bf16", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, family)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, f"{family}, again from the prefix cache")
    llm.engine.check_integrity()
    linears = _linears(path, "bf16")
    assert linears and all(linear.weight is None and linear.gguf.qtype == BF16 for linear in linears.values()), sorted(
        name for name, linear in linears.items() if linear.weight is not None
    )
    assert all(linear.gguf.codes.numel() == 2 * linear.out_features * linear.in_features for linear in linears.values())  # 2 bytes a weight
    widened = _linears(path)  # by default
    assert all(linear.weight is not None and linear.weight.dtype == torch.float32 for linear in widened.values())
    for name, linear in widened.items():
        assert torch.equal(linears[name].gguf.dequantize(), linear.weight), name


def test_where_bf16_weights_cannot_be_kept_the_setting_is_refused_saying_why(checkpoints, tiny_llama_dir):
    with pytest.raises(QuantizationError, match="this checkpoint's linear weights are float32"):
        _linears(tiny_llama_dir, "bf16")
    with pytest.raises(QuantizationError, match="computes in float32 on CPU, not torch.bfloat16"):
        _linears(checkpoints("phi3")[0], "bf16", dtype=torch.bfloat16)


def test_a_float32_draft_beside_a_bf16_target_loads_as_its_own_checkpoint_asks(checkpoints, tiny_llama_dir):
    """The draft follows the target's setting only where that applies to any model: a float32
    draft of a ``bf16`` target is widened as usual, and the tokens are the target's."""
    path, references = checkpoints("phi3")
    draft = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(path), dtype="float32", quantization="bf16", num_kv_blocks=64, max_model_len=256, speculative_config=draft)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, "phi3 with a float32 draft")
    assert llm.engine.stats().spec.num_draft_tokens > 0


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 70])
def test_bf16_blocks_multiply_as_the_widened_weights_do(rows):
    """By tiles of rows and by panels (each forced), and with the LM head's fused argmax: within
    fp32's rounding of the exact products, and the argmax the products'."""
    torch.manual_seed(rows)
    ops = cpu_ops.load_gguf()
    weight = torch.randn(96, 160).bfloat16()
    blocks = bf16_blocks(weight, ops)
    assert torch.equal(blocks.dequantize(), weight.float())
    x = torch.randn(rows, 160)
    exact = x.double() @ weight.double().T
    bound = 1e-6 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    blocks.lay_out_panels()
    for panel_min_rows in (1, 1 << 30):
        products = ops.gguf_matmul(x, blocks.codes, blocks.scales, BF16, panel_min_rows, blocks.panel_codes, blocks.panel_scales)
        assert ((products.double() - exact).abs() <= bound).all(), panel_min_rows
    assert torch.equal(blocks.matmul_argmax(x, torch.empty(rows, 0, dtype=torch.long)).flatten(), exact.argmax(-1))
    with pytest.raises(ValueError, match="bf16 blocks take bf16 weights"):
        bf16_blocks(weight.float(), ops)
