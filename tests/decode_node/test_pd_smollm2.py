"""SmolLM2 split across two processes (prefill, decode over gloo) gives transformers' tokens."""

from __future__ import annotations

import pytest

from duet import SamplingParams
from duet.config import EngineArgs
from duet.decode_node.node import DecodeNode
from duet.prefill_node.process import PrefillProcess
from tests.decode_node.pd_harness import run_disaggregated
from tests.prompts import PARITY_NEW_TOKENS
from tests.reference import compare_to_reference

pytestmark = pytest.mark.slow


def test_disaggregated_smollm2_matches_transformers(parity_prompts, parity_references):
    engine_kwargs = dict(model="smollm2", max_model_len=1024)
    prefill = PrefillProcess(engine_kwargs)
    decode = DecodeNode(EngineArgs(**engine_kwargs), "decode-0")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS, min_tokens=PARITY_NEW_TOKENS)
        tokens = run_disaggregated(prefill, decode, parity_prompts, params).tokens
    finally:
        prefill.stop()
    notes = [compare_to_reference(got, ref, f"PD prompt {i}") for i, (got, ref) in enumerate(zip(tokens, parity_references))]
    for note in filter(None, notes):
        print(note)
    assert decode.receiver.stats.transfers == len(parity_prompts)
    decode.check_integrity()
    decode.close()
