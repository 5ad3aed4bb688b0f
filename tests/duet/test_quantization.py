"""Weights quantized at load time (int8, int4) and quantized KV caches (int8, fp8) in the engine.

The oracle for a lossy weight format is the one for every format: greedy tokens equal
transformers' for the same weights, here the quantized weights dequantized into a checkpoint.
A quantized KV cache has no transformers twin; what must hold is that its rows do not depend on
how a token was batched, chunked or cached, so outputs are the same under every schedule.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from duet import LLM, SamplingParams
from duet.config import ConfigError
from duet.kernels import cpu_ops
from duet.kernels.cpu_rules import RULES_ENV
from duet.kernels.gguf import Q4_1, Q8_0, GGUFWeight
from duet.models.linear import GGUF_MAX_ROWS, Linear
from duet.models.linear_rules import BLOCKS_ONLY_RULE, blocks_only_max_rows
from duet.models.quantize import quantize_blocks
from tests.conftest import TINY_VOCAB
from tests.reference import compare_to_reference, hf_greedy

pytestmark = pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="no C++ toolchain")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 90))] for _ in range(count)]


def _linears(llm: LLM) -> dict[str, Linear]:
    model = llm.engine.executor.worker.runner.model
    return {name: module for name, module in model.named_modules() if isinstance(module, Linear)}


def _dequantized_checkpoint(source, target, qtype: int):
    """``source`` with every projection and the LM head replaced by its blocks' dequantization."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                weight = GGUFWeight.from_blocks(quantize_blocks(module.weight, qtype), qtype, module.in_features, cpu_ops.load_gguf())
                module.weight = torch.nn.Parameter(weight.dequantize())
    model.save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(target))
    return target


@pytest.fixture
def blocks_only_rows(request, monkeypatch):
    """``blocks_only_max_rows`` pinned to ``request.param`` for the engines this test builds."""
    monkeypatch.setenv(RULES_ENV, json.dumps(json.loads(os.environ.get(RULES_ENV) or "{}") | {BLOCKS_ONLY_RULE: request.param}))
    blocks_only_max_rows.cache_clear()
    yield request.param
    blocks_only_max_rows.cache_clear()


@pytest.mark.parametrize("blocks_only_rows", [GGUF_MAX_ROWS, cpu_ops.NEVER], indirect=True, ids=["dequantized-past-64", "blocks-always"])
@pytest.mark.parametrize("quantization, qtype", [("int8", Q8_0), ("int4", Q4_1)])
def test_quantized_weights_give_transformers_greedy_over_the_same_weights(quantization, qtype, blocks_only_rows, tiny_llama_dir, tmp_path):
    """Decode steps of one row and of more than GGUF_MAX_ROWS, prompt chunks past it too, with
    the blocks dequantized for products past GGUF_MAX_ROWS and with the blocks serving every
    product (``blocks_only_max_rows``, as this CPU measures it for an fp32 model): every product
    reads the blocks the checkpoint was made from."""
    prompts = _prompts(GGUF_MAX_ROWS + 4, seed=5)
    references = hf_greedy(_dequantized_checkpoint(tiny_llama_dir, tmp_path / quantization, qtype), prompts, 16)
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=1024, max_num_seqs=GGUF_MAX_ROWS + 4, quantization=quantization)
    linears = _linears(llm)
    assert all(linear.weight is None and linear.gguf.qtype == qtype for linear in linears.values()), sorted(linears)
    assert {linear._block_rows for linear in linears.values()} == {blocks_only_rows}
    alone = [llm.generate([prompt], GREEDY)[0] for prompt in prompts[:6]]
    together = llm.generate(prompts, GREEDY)
    for label, outputs in (("alone", alone), ("together", together)):
        for index, (output, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"{label} {index}") is None
    llm.engine.check_integrity()


@pytest.mark.parametrize("blocks_only_rows", [cpu_ops.NEVER], indirect=True)
def test_bf16_models_quantize_their_linears_too(blocks_only_rows, tiny_llama_dir):
    """Their products past GGUF_MAX_ROWS dequantize the blocks for the call whatever
    ``blocks_only_max_rows`` says (a rule of fp32 models' products)."""
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, dtype="bfloat16", quantization="int8")
    output = llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0]
    assert len(output.token_ids) == 16
    linears = _linears(llm).values()
    assert all(linear.weight is None and linear.blocks_dtype == torch.bfloat16 for linear in linears)
    assert {linear._block_rows for linear in linears} == {GGUF_MAX_ROWS}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_outputs_do_not_depend_on_batching_chunking_or_prefix_hits(kv_cache_dtype, tiny_llama_dir):
    """A token's cached row is quantized from its own K/V alone: alone or batched, in one prompt
    chunk or many, recomputed or found in the prefix cache, the tokens are the same."""
    prompts = _prompts(8, seed=6)
    shared = prompts[0][:40]
    prompts += [shared + prompt[:20] for prompt in prompts[1:4]]  # prefix hits on the first's blocks
    settings = dict(model=str(tiny_llama_dir), num_kv_blocks=512, kv_cache_dtype=kv_cache_dtype)
    plain = LLM(**settings, enable_prefix_caching=False)
    expected = [plain.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in prompts]
    chunked = LLM(**settings, max_num_batched_tokens=24, max_num_seqs=5)
    got = [output.outputs[0].token_ids for output in chunked.generate(prompts, GREEDY)]
    assert got == expected
    assert chunked.engine.kv_cache_manager.prefix_cache_hits > 0
    assert chunked.engine.executor.worker.runner.kv_cache.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]
    chunked.engine.check_integrity()


def test_quantized_kv_fits_four_times_the_blocks_of_fp32(tiny_llama_dir):
    """Rows of head_dim codes and one scale byte: (4 * 16) / (16 + 1) the blocks of fp32 for
    this model's 16-wide heads (3.94x for SmolLM2's 64)."""
    blocks = {
        kv: LLM(model=str(tiny_llama_dir), kv_cache_dtype=kv, kv_cache_memory_gib=0.01).engine.num_blocks
        for kv in ("auto", "int8", "fp8")
    }
    assert blocks["int8"] == blocks["fp8"] and blocks["int8"] / blocks["auto"] == pytest.approx(64 / 17, rel=1e-3)


def test_draft_model_quantized_differently_keeps_the_targets_tokens(tiny_llama_dir, tmp_path):
    """Speculation is lossless whatever the draft's weights: an int4 draft for an int8 target."""
    prompts = _prompts(4, seed=7)
    speculative = LLM(
        model=str(tiny_llama_dir), num_kv_blocks=512, quantization="int8", kv_cache_dtype="int8",
        speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "quantization": "int4"},
    )
    draft = speculative.engine.executor.worker.runner.spec.proposer.model
    assert {m.gguf.qtype for m in draft.modules() if isinstance(m, Linear)} == {Q4_1}
    int8_kv = LLM(model=str(tiny_llama_dir), num_kv_blocks=512, quantization="int8", kv_cache_dtype="int8")
    assert [o.outputs[0].token_ids for o in speculative.generate(prompts, GREEDY)] == [
        o.outputs[0].token_ids for o in int8_kv.generate(prompts, GREEDY)
    ]
    assert speculative.engine.scheduler.spec_stats.num_drafts > 0


def test_unknown_settings_name_the_choices():
    with pytest.raises(ConfigError, match="kv_cache_dtype='int3' is not supported; use one of auto, int8, fp8, fp8_e4m3"):
        LLM(model="unused", kv_cache_dtype="int3")
    with pytest.raises(ConfigError, match="quantization='int2' is not supported"):
        LLM(model="unused", quantization="int2")
    with pytest.raises(ConfigError, match="a draft_model's weights"):
        LLM(model="unused", speculative_config={"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"})


@pytest.mark.parametrize("blocks_only_rows", [cpu_ops.NEVER], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_parallel_shard_of_blocks_alone_keeps_its_models_rule(dtype, blocks_only_rows):
    """A shard of a weight kept as blocks alone (built on the meta device, whose default dtype
    is fp32) takes the rows the whole weight's blocks served: its model's dtype decides."""
    from duet.models.tensor_parallel import shard_linear

    linear = Linear(64, 32)
    linear.weight = torch.nn.Parameter(torch.randn(32, 64).to(dtype), requires_grad=False)
    linear.attach_gguf(GGUFWeight.from_blocks(quantize_blocks(linear.weight.float(), Q8_0), Q8_0, 64, cpu_ops.load_gguf()))
    linear.keep_blocks_only()
    rows = blocks_only_rows if dtype == torch.float32 else GGUF_MAX_ROWS
    assert linear.blocks_dtype == dtype and linear._block_rows == rows
    shard = shard_linear(linear, [slice(0, 16)])
    assert shard.weight is None and shard.blocks_dtype == dtype and shard._block_rows == rows
    x = torch.randn(GGUF_MAX_ROWS + 8, 64)
    torch.testing.assert_close(shard(x), linear(x)[:, :16], rtol=1e-5, atol=1e-5)
