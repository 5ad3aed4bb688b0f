"""Computing from a GGUF checkpoint's own blocks: on by default where it is exact (CPU,
float32), the same greedy tokens as transformers over the dequantized weights, and the blocks
dequantize to the float weights bit for bit (checked as each module takes its blocks)."""

from __future__ import annotations

import random

import pytest
import torch

from duet import LLM, SamplingParams
from duet.kernels import cpu_ops
from duet.models.linear import Linear
from duet.models.linear_rules import GGUF_FLOAT_ROWS
from duet.models.loader import ModelNotFoundError
from tests.conftest import TINY_VOCAB
from tests.reference import compare_to_reference, hf_greedy

pytestmark = pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="no C++ toolchain")


def _linears(llm: LLM) -> dict[str, Linear]:
    model = llm.engine.executor.worker.runner.model
    return {name: module for name, module in model.named_modules() if isinstance(module, Linear)}


def test_every_projection_and_the_lm_head_compute_from_their_blocks_by_default(tiny_gguf_llama_dir):
    linears = _linears(LLM(model=str(tiny_gguf_llama_dir), num_kv_blocks=64))
    assert linears and all(linear.gguf is not None for linear in linears.values()), sorted(linears)
    assert {linear.gguf.qtype for name, linear in linears.items() if name != "lm_head"} == {3} and linears["lm_head"].gguf.qtype == 8
    floats = _linears(LLM(model=str(tiny_gguf_llama_dir), num_kv_blocks=64, quantization="dequantized"))
    assert all(linear.gguf is None for linear in floats.values())


@pytest.mark.slow
def test_greedy_from_the_blocks_equals_transformers_alone_and_in_batches(tiny_gguf_llama_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 60))] for _ in range(GGUF_FLOAT_ROWS[-1] + 4)]
    references = hf_greedy(tiny_gguf_llama_dir, prompts, 24)
    llm = LLM(model=str(tiny_gguf_llama_dir), num_kv_blocks=512, max_num_seqs=len(prompts))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    # Decode products of one row (alone), of 4 more than any CPU measures for the blocks (together:
    # the float weights) and of 4 (fours); prompts of up to 60 rows take the float weights too.
    alone = [llm.generate([prompt], greedy)[0] for prompt in prompts]
    together = llm.generate(prompts, greedy)
    fours = [output for start in range(0, len(prompts), 4) for output in llm.generate(prompts[start : start + 4], greedy)]
    for label, outputs in (("alone", alone), ("together", together), ("fours", fours)):
        for index, (output, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"{label} {index}") is None
    llm.engine.check_integrity()


def test_greedy_rows_take_their_tokens_from_the_lm_heads_argmax_without_logits(tiny_gguf_llama_dir):
    """A step whose rows are all greedy (min_tokens' EOS exclusion included) never builds its
    logits: the sampler is not called, and the tokens equal those of steps that do build them
    (a request asking for logprobs in the batch)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(24)]
    llm = LLM(model=str(tiny_gguf_llama_dir), num_kv_blocks=512, max_num_seqs=32)
    runner = llm.engine.executor.worker.runner
    calls = []
    sampler = runner.sampler
    runner.sampler = lambda logits, metadata: calls.append(logits.shape[0]) or sampler(logits, metadata)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8)
    fused = [output.outputs[0].token_ids for output in llm.generate(prompts, greedy)]
    assert calls == []
    with_logits = llm.generate(prompts + [prompts[0]], [greedy] * len(prompts) + [SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)])
    assert [output.outputs[0].token_ids for output in with_logits[:-1]] == fused
    assert calls and max(calls) == len(prompts) + 1
    llm.engine.check_integrity()


@pytest.mark.parametrize("k_quant", ["Q4_K", "Q5_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ2_S"])
def test_a_k_quant_model_computes_from_its_blocks_and_equals_transformers(tmp_path, tiny_tokenizer_dir, k_quant):
    """Q4_K (or Q5_K, Q2_K, IQ4_XS, IQ4_NL, IQ3_S or IQ2_S) and Q6_K weights (a Q4_K_M, Q5_K_M, Q2_K or i-quant file's) are kept as
    blocks, rewritten for the kernels, dequantize to the float weights bit for bit (the loader
    checks), and give transformers' greedy tokens over those weights, alone and in a batch."""
    from tests.gguf_writer import make_tiny_gguf_llama

    model_dir = make_tiny_gguf_llama(
        tmp_path, tiny_tokenizer_dir, k_quants=True, k_quant=k_quant, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2,
    )
    llm = LLM(model=str(model_dir), num_kv_blocks=256)
    kinds = {name.rsplit(".", 1)[-1]: linear.gguf.qtype for name, linear in _linears(llm).items()}
    # Q4_K is computed as Q4_1 blocks, IQ4 and IQ3_S as Q8_0, IQ2_S (a scale per 16) as Q6_K's
    low = {"Q4_K": 3, "Q5_K": 13, "Q2_K": 10, "IQ4_XS": 8, "IQ4_NL": 8, "IQ3_S": 8, "IQ2_S": 14}[k_quant]
    assert kinds == {"qkv_proj": low, "o_proj": 14, "gate_up_proj": low, "down_proj": 14, "lm_head": 14}
    rng = random.Random(7)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    references = hf_greedy(model_dir, prompts, 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    for label, outputs in (("alone", [llm.generate([p], greedy)[0] for p in prompts]), ("together", llm.generate(prompts, greedy))):
        for index, (output, reference) in enumerate(zip(outputs, references)):
            assert compare_to_reference(output.outputs[0].token_ids, reference, f"{label} {index}") is None
    llm.engine.check_integrity()


@pytest.mark.skipif(cpu_ops.load_gguf() is None or not cpu_ops.load_gguf().has_bf16(), reason="no AVX512_BF16")
def test_a_bf16_model_decodes_few_rows_from_its_blocks_rounded_to_bf16(tiny_gguf_llama_dir):
    """In bf16 the blocks serve products of up to the rows this CPU measured, their weights rounded
    to bf16 as the model's are (the loader checks it), and greedy output follows transformers
    in bf16 under the bf16 rule (``test_bf16``), a sequence alone (the blocks) or in a batch."""
    from tests.duet.test_bf16 import PROMPTS, _check_bf16

    llm = LLM(model=str(tiny_gguf_llama_dir), dtype="bfloat16", num_kv_blocks=128, max_model_len=512)
    assert all(linear.gguf is not None for linear in _linears(llm).values())
    references = hf_greedy(tiny_gguf_llama_dir, PROMPTS, 16, dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    alone = [llm.generate([prompt], greedy)[0] for prompt in PROMPTS]
    together = llm.generate(PROMPTS, greedy)
    for outputs in (alone, together):
        identical = [_check_bf16(output.outputs[0].token_ids, reference) for output, reference in zip(outputs, references)]
        assert sum(identical) >= len(PROMPTS) // 2
    llm.engine.check_integrity()


def test_insisting_on_gguf_without_blocks_names_what_is_missing(tiny_llama_dir):
    with pytest.raises(ModelNotFoundError, match="blocks.safetensors: missing"):
        LLM(model=str(tiny_llama_dir), num_kv_blocks=64, quantization="gguf")


@pytest.mark.slow
def test_smollm2s_blocks_dequantize_to_its_fp32_weights_bit_for_bit(smollm2_dir):
    """The converted fp32 safetensors are gguf's dequantization; the kernels must agree with it
    exactly, for every one of the 121 fused projections and the LM head. Slow: it is about the
    real SmolLM2 file's blocks (and downloads them)."""
    linears = _linears(LLM(model="smollm2", num_kv_blocks=16, max_model_len=256))
    assert len(linears) == 30 * 4 + 1 and all(linear.gguf is not None for linear in linears.values())
    for name, linear in linears.items():
        assert torch.equal(linear.gguf.dequantize(), linear.weight), name
