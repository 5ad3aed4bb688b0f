"""``duet bench step``: a decode step split into parts that never overlap and add up to less
than the step, whether the layers run in Python or in the C++ decoder stack, and the engine
left as it was (every timed function restored)."""

from __future__ import annotations

import random

from duet import LLM, SamplingParams
from duet.benchmarks.step import KERNEL_PARTS, _timed_parts, profile, report
from tests.conftest import TINY_VOCAB


def test_a_steps_parts_add_up_within_the_step_and_the_wrappers_come_off(tiny_gguf_llama_dir):
    originals = [getattr(owner, attribute) for _, owner, attribute in _timed_parts()]
    llm = LLM(model=str(tiny_gguf_llama_dir), num_kv_blocks=256, max_num_seqs=8)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(12)] for _ in range(3)]
    before = [output.outputs[0].token_ids for output in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
    profiles = [profile(llm, prompts, batch, steps=6, layers=layers) for batch in (1, 5) for layers in ("python", "native")]
    native = "native" if llm.engine.executor.worker.runner.model.decoder_stack() is not None else "python"
    assert [step.layers for step in profiles] == ["python", native] * 2  # the C++ stack times its own parts
    for step in profiles:
        assert step.parts_ms["products"] > 0 and step.parts_ms["attention"] > 0 and step.parts_ms["LM head argmax"] > 0
        assert set(step.parts_ms) <= set(KERNEL_PARTS)
        assert 0 < step.overhead_ms < step.step_ms  # the parts, never counted twice, leave time outside them
    assert "outside kernels" in report(profiles)
    assert [getattr(owner, attribute) for _, owner, attribute in _timed_parts()] == originals
    after = [output.outputs[0].token_ids for output in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
    assert after == before
    llm.engine.check_integrity()
