"""SmolLM2 split across two processes (prefill, decode over gloo) gives transformers' tokens."""

from __future__ import annotations

import pytest

from duet import SamplingParams
from duet.config import EngineArgs
from duet.engine import LLMEngine
from duet.engine_process import EngineProcess
from tests.kv_transfer.pd_harness import run_disaggregated
from duet.benchmarks.prompts import PARITY_NEW_TOKENS
from tests.reference import compare_to_reference

pytestmark = pytest.mark.slow


def test_disaggregated_smollm2_matches_transformers(parity_prompts, parity_references):
    engine_kwargs = dict(model="smollm2", max_model_len=1024)
    prefill = EngineProcess(engine_kwargs | {"kv_transfer_config": {"name": "prefill-0"}})
    decode = LLMEngine(EngineArgs(**engine_kwargs, kv_transfer_config={"name": "decode-0"}))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS, min_tokens=PARITY_NEW_TOKENS)
        run = run_disaggregated(prefill, decode, parity_prompts, params)
    finally:
        prefill.stop()
    notes = [compare_to_reference(got, ref, f"PD prompt {i}") for i, (got, ref) in enumerate(zip(run.tokens, parity_references))]
    for note in filter(None, notes):
        print(note)
    assert (run.lost, decode.stats().transfer.transfers) == ([], len(parity_prompts))
    decode.check_integrity()
    decode.close()
