"""The C++ decoder stack (``duet.models.decoder_stack``) computes a step's layers to the very
bits of the Python layer loop, on every product path (GGUF blocks, oneDNN's packed weight,
``F.linear``, blocks alone), with float and quantized KV caches, and the loop keeps what the
stack does not take (prompt chunks, models that are not plain Llama layers)."""

from __future__ import annotations

import random

import pytest
import torch

from duet import LLM, SamplingParams
from duet.dtypes import cpu_has_fast_bf16
from duet.kernels import cpu_ops
from tests.conftest import TINY_VOCAB, make_tiny_mixtral

pytestmark = pytest.mark.skipif(cpu_ops.load() is None or cpu_ops.load_gguf() is None, reason="the C++ kernels did not build here")


def _check_every_short_step(model) -> dict[str, list[int]]:
    """Make each of ``model``'s steps run its layers twice, by the Python loop and by the stack,
    assert that the two agree exactly (output, residual stream, KV written), and record each
    step's rows by the path that served it."""
    run_layers = model.run_layers
    rows = {"stack": [], "python": []}

    def both(x, residual, positions, kv_caches, metadata, on_layer_done=None):
        stack = model.decoder_stack()
        if on_layer_done is not None or stack is None or not stack.takes(x, metadata):
            rows["python"].append(x.shape[0])
            return run_layers(x, residual, positions, kv_caches, metadata, on_layer_done)
        loop_residual = residual.clone()
        model.use_decoder_stack = False
        try:
            expected = run_layers(x.clone(), loop_residual, positions, kv_caches, metadata)
            written = [(key.clone(), value.clone()) for key, value in kv_caches]
        finally:
            model.use_decoder_stack = True
        got = run_layers(x, residual, positions, kv_caches, metadata)
        assert torch.equal(got, expected)
        assert torch.equal(residual, loop_residual)
        assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv_caches, written))
        rows["stack"].append(x.shape[0])
        return got

    model.run_layers = both
    return rows


def _generate(llm, batches: list[int]) -> list[list[int]]:
    rng = random.Random(0)
    tokens = []
    for batch in batches:
        prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(batch)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        tokens += [output.outputs[0].token_ids for output in outputs]
    return tokens


CASES = {
    # rows 2-128: oneDNN packed; 1 and past 128: F.linear or oneDNN, as this CPU measured (linear_rules.packed_wins)
    "float32": ("tiny_llama_dir", {}),
    # rows up to what this CPU measured (linear_rules.gguf_float_max_rows): GGUF blocks, by tiles of
    # rows and from cpu_ops.panel_min_rows by panels; then packed
    "gguf": ("tiny_gguf_llama_dir", {}),
    "gguf, int8 KV": ("tiny_gguf_llama_dir", {"kv_cache_dtype": "int8"}),
    # blocks alone; past 64 rows dequantized for the call
    "int8 weights": ("tiny_llama_dir", {"quantization": "int8"}),
    "bfloat16": ("tiny_gguf_llama_dir", {"dtype": "bfloat16"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_stack_computes_each_short_step_to_the_loops_bits(case, request):
    fixture, engine_kwargs = CASES[case]
    if engine_kwargs.get("dtype") == "bfloat16" and not cpu_has_fast_bf16():
        pytest.skip("bf16 models take the dequantized float path on CPUs without native bf16")
    llm = LLM(model=str(request.getfixturevalue(fixture)), num_kv_blocks=1024, max_num_seqs=136,
              max_num_batched_tokens=2048, **engine_kwargs)
    model = llm.engine.executor.worker.runner.model
    assert model.decoder_stack() is not None
    rows = _check_every_short_step(model)
    _generate(llm, [1, 5, 60, 136])
    assert {1, 5, 60, 136} <= set(rows["stack"])  # every product path, decode steps all
    assert rows["python"]  # the prompts: chunks longer than the stack's attention takes
    llm.engine.check_integrity()


def test_models_whose_layers_are_not_plain_llama_keep_the_loop(tmp_path, tiny_tokenizer_dir):
    llm = LLM(model=str(make_tiny_mixtral(tmp_path / "tiny-mixtral", tiny_tokenizer_dir)), num_kv_blocks=256)
    assert llm.engine.executor.worker.runner.model.decoder_stack() is None
    assert len(_generate(llm, [2])) == 2


def test_greedy_tokens_are_the_same_with_the_stack_and_without(tiny_gguf_llama_dir):
    llm = LLM(model=str(tiny_gguf_llama_dir), num_kv_blocks=512, max_num_seqs=16, enable_prefix_caching=False)
    model = llm.engine.executor.worker.runner.model
    with_stack = _generate(llm, [1, 9])
    model.use_decoder_stack = False
    without = _generate(llm, [1, 9])
    assert with_stack == without
    llm.engine.check_integrity()
