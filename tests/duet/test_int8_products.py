"""W8A8's products in integers (``kernels.w8a8``): exact int32 sums scaled by the row's and the
channel's scales, taken only where this CPU's oneDNN int8 product is exact; a W8A8 checkpoint
computed that way matches transformers as the blocks' float products do, and keeps a request's
bits whatever shares its batch (``batch_invariant``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from duet import LLM, SamplingParams
from duet.dtypes import cpu_has_fast_bf16
from duet.kernels import cpu_ops
from duet.kernels.cpu_rules import RULES_ENV
from duet.kernels.gguf import Q4_1, Q8_0, GGUFWeight
from duet.kernels.w8a8 import INT8_PER_TOKEN, RULE, Int8Weight, exact_int8_sums, int8_min_rows, int8_product, int8_sums, per_token_codes, sums_are_exact
from duet.models.linear import Linear
from tests.compressed_writer import make_compressed_checkpoint
from tests.conftest import make_tiny_model
from tests.duet.test_batch_invariant import GREEDY, HEADS_OF_64, TARGET, _prompts, _signature
from tests.duet.test_decoder_stack import _check_every_short_step, _generate
from tests.duet.test_packed_checkpoints import NEW_TOKENS, PROMPTS, _greedy, checkpoints  # noqa: F401 (a fixture)
from tests.reference import check_outputs, hf_greedy

needs_exact = pytest.mark.skipif(not exact_int8_sums(), reason="oneDNN's int8 product is not exact on this CPU: W8A8 keeps the blocks' products")


@pytest.fixture
def integers_from_one_row(monkeypatch):
    """W8A8's products in integers from one row, as a CPU that measured them faster would have them."""
    monkeypatch.setenv(RULES_ENV, json.dumps(json.loads(os.environ.get(RULES_ENV) or "{}") | {RULE: 1}))
    int8_min_rows.cache_clear()
    yield
    int8_min_rows.cache_clear()


def _w8a8_linears(llm: LLM) -> list[Linear]:
    model = llm.engine.executor.worker.runner.model
    return [module for module in model.modules() if isinstance(module, Linear) and module.input_quantization is not None]


@needs_exact
def test_the_sums_are_exact_and_scaled_by_the_rows_and_the_channels_scales():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (33, 4096), dtype=torch.int8, generator=generator)
    weight_codes = torch.randint(-128, 128, (96, 4096), dtype=torch.int8, generator=generator)
    codes[0], codes[1], weight_codes[0], weight_codes[1] = -128, 127, -128, 127  # sums of +-2^26
    weight = Int8Weight.from_codes(weight_codes, torch.rand(96, generator=generator))
    row_scales = torch.rand(33, 1, generator=generator)
    expected = (codes.long() @ weight_codes.long().t()).float() * row_scales * weight.scales
    for rows in (1, 7, 33):
        assert torch.equal(int8_product(codes[:rows].contiguous(), row_scales[:rows], weight), expected[:rows]), rows
    assert expected[0, 0] == 2**26 * row_scales[0, 0] * weight.scales[0]


@needs_exact
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_call_product_is_the_torch_compositions_bit_for_bit(dtype):
    """``int8_linear`` (C++: quantize, oneDNN's int8 product, scale) gives what ``per_token_codes`` then
    ``int8_product`` give in torch, in fp32 and in bf16 (where every step rounds to bf16), on rows
    with codes at half-way points, a zero row and outliers."""
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(40, 576, generator=generator) * torch.rand(40, 1, generator=generator) * 4).to(dtype)
    x[3] = 0
    x[5, :8] = torch.tensor([127.5, -127.5, 0.5, 1.5, 2.5, -0.5, 63.75, -1.0]).to(dtype)  # its scale is 1: ties at .5
    x[7, 100] = 1e4
    weight = Int8Weight.from_codes(torch.randint(-128, 128, (96, 576), dtype=torch.int8, generator=generator), torch.rand(96, generator=generator))
    codes, scales = per_token_codes(x, INT8_PER_TOKEN)
    assert scales[5].item() == 1.0 and codes[5, :5].tolist() == [127, -128, 0, 2, 2]
    expected = int8_product(codes.to(torch.int8), scales, weight).to(dtype)
    for rows in (1, 8, 40):
        got = cpu_ops.load_gguf().int8_linear(x[:rows], weight.packed, weight.scales, weight.unit_scales, weight.zero_points)
        assert got.dtype == dtype and torch.equal(got, expected[:rows]), rows


def test_a_kernel_whose_sums_saturate_is_not_taken():
    """oneDNN without VNNI may add code products in int16 pairs, which saturate at the codes'
    extremes: such a kernel is found out, and an exact one is taken."""

    def pairwise(a: torch.Tensor, b: torch.Tensor, saturate: bool) -> torch.Tensor:
        products = a.long().unsqueeze(1) * b.long().unsqueeze(0)  # [rows, out, in]
        pairs = products.view(*products.shape[:2], -1, 2).sum(-1)
        return (pairs.clamp(-(2**15), 2**15 - 1) if saturate else pairs).sum(-1).float()

    assert not sums_are_exact(lambda a, b: pairwise(a, b, saturate=True))
    assert sums_are_exact(lambda a, b: pairwise(a, b, saturate=False))


@needs_exact
def test_only_q8_0_blocks_with_a_scale_per_channel_are_taken():
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=generator)
    per_channel = torch.rand(64, 1, generator=generator).expand(-1, 4).contiguous()
    ops = cpu_ops.load_gguf()
    weight = Int8Weight.from_blocks(GGUFWeight(codes, per_channel, Q8_0, 128, ops))
    x = torch.randint(-128, 128, (3, 128), dtype=torch.int8, generator=generator)
    assert torch.equal(int8_sums(x, weight), (x.long() @ codes.view(torch.int8).long().t()).float())
    assert torch.equal(weight.scales, per_channel[:, 0])
    grouped = per_channel.clone()
    grouped[5, 2] *= 2
    assert Int8Weight.from_blocks(GGUFWeight(codes, grouped, Q8_0, 128, ops)) is None
    assert Int8Weight.from_blocks(GGUFWeight(codes[:, :64], torch.rand(64, 8), Q4_1, 128, ops)) is None


@needs_exact
def test_a_w8a8_checkpoint_in_integers_matches_transformers(checkpoints, integers_from_one_row, monkeypatch):  # noqa: F811
    """Every per-channel product of the checkpoint runs in integers, and its greedy tokens are
    transformers' on the same checkpoint; the grouped scheme keeps the blocks'."""
    path, references = checkpoints("qwen3-w8a8-channel")
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    linears = _w8a8_linears(llm)
    assert linears and all(linear.int8 is not None for linear in linears)
    calls = []
    ops = cpu_ops.load_gguf()
    int8_linear = ops.int8_linear
    monkeypatch.setattr(ops, "int8_linear", lambda x, *weight: calls.append(x.shape[0]) or int8_linear(x, *weight))
    check_outputs(llm.generate(PROMPTS, _greedy()), references, "W8A8 in integers")
    assert 1 in calls and len(calls) >= len(linears) * 10  # a prompt's chunks and every decode step
    llm.engine.check_integrity()
    grouped, _ = checkpoints("phi3-w8a8-g32")
    llm = LLM(model=str(grouped), num_kv_blocks=64, max_model_len=256)
    assert all(linear.int8 is None for linear in _w8a8_linears(llm))


@needs_exact
def test_w8a8_in_integers_gives_a_request_the_same_bits_in_any_batch_and_chunks(tmp_path, tiny_tokenizer_dir, integers_from_one_row):
    """The integer sums are exact, so under ``batch_invariant`` every row count takes them, and a
    request's tokens and logprobs are its own alone amid other requests and in other chunks."""
    source = make_tiny_model(tmp_path / "float", tiny_tokenizer_dir, "llama3-rope", **HEADS_OF_64)
    path = make_compressed_checkpoint(source, tmp_path / "w8a8", 8, None, w8a8="int")
    llm = LLM(model=str(path), batch_invariant=True, max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=48)
    assert all(linear.int8 is not None for linear in _w8a8_linears(llm))
    alone = _signature(llm.generate([TARGET], GREEDY)[0])
    for size, place in ((5, 2), (24, 0), (24, 23)):
        background = _prompts(size - 1, seed=size + place)
        prompts = background[:place] + [TARGET] + background[place:]
        params = [SamplingParams(temperature=0.0, max_tokens=1 + index % 9) for index in range(size - 1)]
        params.insert(place, GREEDY)
        assert _signature(llm.generate(prompts, params)[place]) == alone, (size, place)
    llm.engine.check_integrity()


def test_w8a8_at_load_is_llm_compressors_w8a8_of_the_same_weights(tmp_path, tiny_tokenizer_dir):
    """``quantization="w8a8"`` gives a float checkpoint's products the codes and scales that
    compressed-tensors writes for W8A8 from the same weights, bit for bit, the LM head left in
    floats as llm-compressor leaves it: so the tokens and logprobs of that checkpoint, and
    transformers' greedy tokens on it."""
    source = make_tiny_model(tmp_path / "float", tiny_tokenizer_dir, "qwen3")
    shipped_path = make_compressed_checkpoint(source, tmp_path / "w8a8", 8, None, w8a8="int")
    references = hf_greedy(shipped_path, PROMPTS, NEW_TOKENS)
    engines = {}
    for name, model, quantization in (("at load", source, "w8a8"), ("shipped", shipped_path, None)):
        engines[name] = LLM(model=str(model), quantization=quantization, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    linears = {name: dict(llm.engine.executor.worker.runner.model.named_modules()) for name, llm in engines.items()}
    quantized = [name for name, module in linears["shipped"].items() if isinstance(module, Linear) and module.input_quantization is not None]
    assert len(quantized) == sum(isinstance(module, Linear) for module in linears["at load"].values()) - 1  # all but the LM head
    for name in quantized:
        at_load, shipped = linears["at load"][name], linears["shipped"][name]
        assert at_load.input_quantization == shipped.input_quantization, name
        assert torch.equal(at_load.gguf.codes, shipped.gguf.codes) and torch.equal(at_load.gguf.scales, shipped.gguf.scales), name
        assert (at_load.int8 is None) == (shipped.int8 is None), name
    assert linears["at load"]["lm_head"].weight is not None and linears["at load"]["lm_head"].gguf is None
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    outputs = {name: llm.generate(PROMPTS, params) for name, llm in engines.items()}
    assert [_signature(output) for output in outputs["at load"]] == [_signature(output) for output in outputs["shipped"]]
    check_outputs(outputs["at load"], references, "w8a8 at load")


@needs_exact
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w8a8_in_integers_runs_in_the_decoder_stack_to_the_loops_bits(tiny_llama_dir, integers_from_one_row, dtype):
    """Where every row count goes in integers, W8A8's layers leave Python for the C++ decoder
    stack, which computes each short step to the very bits of the layer loop."""
    if dtype == "bfloat16" and not cpu_has_fast_bf16():
        pytest.skip("bf16 models take the dequantized float path on CPUs without native bf16")
    llm = LLM(model=str(tiny_llama_dir), quantization="w8a8", dtype=dtype, num_kv_blocks=1024, max_num_seqs=136, max_num_batched_tokens=2048)
    model = llm.engine.executor.worker.runner.model
    assert model.decoder_stack() is not None and all(linear.int8_at_every_row for linear in _w8a8_linears(llm))
    rows = _check_every_short_step(model)
    _generate(llm, [1, 5, 60, 136])
    assert {1, 5, 60, 136} <= set(rows["stack"]) and rows["python"]
    llm.engine.check_integrity()
