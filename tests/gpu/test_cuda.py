"""The GPU paths on a CUDA device: the Triton kernels (paged attention over float and quantized
caches, the KV write, GGUF products) against the CPU implementations, and the engine's greedy
output on the GPU against transformers, from float weights and from GGUF blocks.

CI has no GPU: these are skipped there (the same kernels run under ``TRITON_INTERPRET`` in
``tests/kernels``). On a machine with one: ``python -m pytest tests/gpu`` (the tiny random models
take the tokenizer in ``tests/fixtures``: nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import random

import gguf
import numpy as np
import pytest
import torch

from duet.kernels.gguf import GGUFWeight
from tests.kernels.attention_cases import build_batch, reference_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
SPANS = [(0, 1), (20, 1), (0, 23), (17, 9), (40, 4), (300, 1), (0, 130)]  # (context, query) per sequence


def _on(device, query, key_cache, value_cache, metadata):
    moved = {field.name: getattr(metadata, field.name) for field in dataclasses.fields(metadata)}
    moved = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in moved.items()}
    return query.to(device), key_cache.to(device), value_cache.to(device), type(metadata)(**moved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, head_dim, block_size", [((9, 3), 64, 16), ((8, 8), 128, 32), ((12, 4), 80, 16)])
def test_triton_attention_on_the_gpu_equals_the_float64_reference(dtype, heads, head_dim, block_size):
    from duet.kernels.triton_attention import paged_attention_triton

    batch = build_batch(SPANS, *heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_attention_triton(*_on(CUDA, *batch), scale)
    assert out.device.type == CUDA.type and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), reference_attention(*batch, scale), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_triton_reads_quantized_caches_on_the_gpu_as_the_torch_path_does(cache_dtype):
    from duet.kernels.kv_quant import quantize_rows, rotate
    from duet.kernels.torch_attention import paged_attention_torch
    from duet.kernels.triton_attention import paged_attention_triton

    query, key_cache, value_cache, metadata = build_batch(SPANS, 9, 3, 64, 16, torch.float32)
    key_cache = quantize_rows(rotate(torch.nan_to_num(key_cache, nan=0.5) * torch.logspace(-3, 1, 64)), cache_dtype)
    value_cache = quantize_rows(rotate(torch.nan_to_num(value_cache, nan=-0.5)), cache_dtype)
    gpu = paged_attention_triton(*_on(CUDA, query, key_cache, value_cache, metadata), 0.01)
    cpu = paged_attention_torch(query, key_cache, value_cache, metadata, 0.01)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-5)


def test_the_kv_write_on_the_gpu_stores_each_token_and_skips_padding():
    from duet.kernels.triton_attention import write_kv_cache_triton

    key_cache = torch.zeros(3, 4, 16, 64, device=CUDA)
    value_cache = torch.zeros_like(key_cache)
    fused = torch.randn(4, 9, 64, device=CUDA)  # K and V as views of a fused projection
    key, value = fused[:, 3:6], fused[:, 6:9]
    write_kv_cache_triton(key, value, key_cache, value_cache, torch.tensor([37, 5, -1, 63], device=CUDA))
    expected_key, expected_value = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    for token, (block, offset) in {0: (2, 5), 1: (0, 5), 3: (3, 15)}.items():
        expected_key[:, block, offset], expected_value[:, block, offset] = key[token], value[token]
    assert torch.equal(key_cache, expected_key) and torch.equal(value_cache, expected_value)


@pytest.mark.parametrize(
    "qtype",
    [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
     gguf.GGMLQuantizationType.Q6_K],
)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_triton_gguf_products_on_the_gpu_use_ggufs_weights_bit_for_bit(qtype, rows):
    from duet.kernels import triton_gguf
    from tests.gguf_writer import k_quant_blocks

    k_quant = qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K)
    out_features, in_features = 96, 512
    if k_quant:
        blocks = k_quant_blocks(out_features, in_features, int(qtype), magnitude=0.001)
    else:
        values = np.random.default_rng(0).standard_normal((out_features, in_features)).astype(np.float32) * 0.1
        blocks = np.ascontiguousarray(gguf.quants.quantize(values, qtype)).reshape(out_features, -1)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(out_features, in_features))
    weight = GGUFWeight.from_blocks(torch.from_numpy(blocks).to(CUDA), int(qtype), in_features, triton_gguf)
    assert torch.equal(weight.dequantize().cpu(), reference)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    products = weight.matmul(x.to(CUDA))
    torch.testing.assert_close(products.cpu(), (x.double() @ reference.double().T).float(), rtol=1e-5, atol=1e-5)
    excluded = products.argmax(dim=-1, keepdim=True)  # each row's best excluded: its runner-up wins
    assert torch.equal(weight.matmul_argmax(x.to(CUDA), excluded), products.scatter(1, excluded, float("-inf")).argmax(dim=-1))


@pytest.mark.parametrize("weights", ["float", "gguf", "gguf-k-quants"])
def test_greedy_on_the_gpu_equals_transformers(tmp_path, tiny_tokenizer_dir, weights):
    """Batched, chunked and alone, from the float weights (fp32) and from the GGUF blocks
    (Q4_1/Q8_0, and Q4_K/Q6_K as a Q4_K_M file has them) through the Triton kernels:
    transformers' greedy tokens for the same weights. (Loading Q6_K blocks on a GPU failed
    here once: their rewrite made its shifts on the CPU.)"""
    from duet import LLM, SamplingParams
    from duet.models.linear import GGUF_MAX_ROWS, Linear
    from tests.conftest import TINY_VOCAB, make_tiny_llama
    from tests.gguf_writer import make_tiny_gguf_llama
    from tests.reference import compare_to_reference, hf_greedy

    sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    if weights == "float":
        model_dir = make_tiny_llama(tmp_path / weights, tiny_tokenizer_dir, **sizes)
    else:
        model_dir = make_tiny_gguf_llama(tmp_path / weights, tiny_tokenizer_dir, k_quants=weights == "gguf-k-quants", **sizes)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 90))] for _ in range(12)]
    references = hf_greedy(model_dir, prompts, 24)
    # The GGUF cases set every product to the blocks after the load: eagerly, since the decode
    # graphs captured at load hold the path each product took then.
    llm = LLM(
        model=str(model_dir), device="cuda", num_kv_blocks=256, max_num_seqs=len(prompts), max_num_batched_tokens=64,
        enforce_eager=weights != "float",
    )
    linears = [module for _, module in llm.engine.executor.worker.runner.model.named_modules() if isinstance(module, Linear)]
    if weights != "float":  # every product reads the blocks, whatever this GPU measured them worth
        assert all(linear.gguf is not None for linear in linears)
        for linear in linears:
            linear._block_rows = GGUF_MAX_ROWS
    greedy = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    together = llm.generate(prompts, greedy)
    alone = [llm.generate([prompt], greedy)[0] for prompt in prompts[:4]]
    for label, outputs in (("together", together), ("alone", alone)):
        for index, (output, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"{weights} {label} {index}") is None
    llm.engine.check_integrity()


def test_decode_steps_replayed_from_cuda_graphs_give_transformers_greedy_tokens(tmp_path, tiny_tokenizer_dir):
    """Forty requests of different prompt and output lengths at once: the decode batch shrinks
    through every bucket, padded rows beside real ones, and prompt chunks run eagerly between
    the replays. Each request's tokens are transformers' greedy ones, and no block stays held."""
    from duet import LLM, SamplingParams
    from tests.conftest import TINY_VOCAB, make_tiny_llama
    from tests.reference import Reference, compare_to_reference, hf_greedy

    sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    model_dir = make_tiny_llama(tmp_path, tiny_tokenizer_dir, **sizes)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, 70))] for _ in range(40)]
    lengths = [rng.randrange(1, 40) for _ in prompts]
    references = hf_greedy(model_dir, prompts, max(lengths))
    llm = LLM(model=str(model_dir), device="cuda", num_kv_blocks=512, max_num_seqs=40, max_num_batched_tokens=128)
    graphs = llm.engine.executor.worker.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths])
    for index, (output, reference, length) in enumerate(zip(outputs, references, lengths)):
        expected = Reference(reference.token_ids[:length], reference.top2_gaps[:length])
        assert compare_to_reference(output.outputs[0].token_ids, expected, f"prompt {index}") is None
    assert len(graphs.replays) >= 4  # batches of many sizes, most of them padded, replayed
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_updates_on_the_gpu_are_the_cpu_kernels(dtype):
    """``LoRAStep`` on a CUDA device adds each row's adapter update in one Triton launch
    (``kernels/triton_lora.py``); on the CPU the C++ kernel does: both sum in fp32 and round once."""
    from duet.lora import LoRAAdapter, LoRAStep, LoRAWeights

    generator = torch.Generator().manual_seed(5)
    adapters = [
        LoRAAdapter(f"a{rank}", {"m": LoRAWeights(torch.randn(rank, 576, generator=generator).to(dtype), torch.randn(rank, 192, generator=generator).to(dtype))})
        for rank in (8, 16, 64)
    ]
    rng = random.Random(6)
    slots = [rng.randrange(-1, 3) for _ in range(37)]
    x = torch.randn(len(slots), 576, generator=generator).to(dtype)
    y = torch.randn(len(slots), 192, generator=generator).to(dtype)
    on_cpu = LoRAStep(adapters, slots, "cpu").apply("m", x, y.clone())
    on_gpu = LoRAStep([adapter.to("cuda") for adapter in adapters], slots, CUDA).apply("m", x.to(CUDA), y.to(CUDA))
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(on_gpu.cpu().double(), on_cpu.double(), **tolerance)
