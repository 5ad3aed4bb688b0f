"""``batch_invariant: true`` across duet's own paths: a prefill engine (in a process of its own)
computing the prompt and first token amid other prompts, the decode engine (here) the rest amid
other streams, and a sequence moved between decode engines by its KV, give a request the tokens
and logprobs, bit for bit, of a colocated engine serving it alone."""

from __future__ import annotations

import time

import pytest

from duet import LLM, SamplingParams
from duet.engine_process import EngineProcess
from duet.kernels import cpu_ops
from duet.messages import EngineRequest
from tests.conftest import make_tiny_llama
from tests.duet.test_batch_invariant import HEADS_OF_64, TARGET, _prompts
from tests.kv_transfer.pd_harness import finish_moved, run_disaggregated
from tests.kv_transfer.test_pd_tiny import _decode, _engine_kwargs

# Two engines in processes of their own, KV between them over gloo: seconds a test.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_ops.load_gguf() is None or cpu_ops.load() is None, reason="needs duet's C++ CPU kernels"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=77, max_tokens=20, min_tokens=20, logprobs=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), tiny_tokenizer_dir, **HEADS_OF_64)


def _alone(model_dir, params) -> tuple[list[int], list]:
    completion = LLM(model=str(model_dir), max_model_len=512, batch_invariant=True).generate([TARGET], params)[0].outputs[0]
    return completion.token_ids, completion.logprobs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_and_decode_engines_give_the_colocated_bits_of_a_request_alone(model_dir, params):
    prefill = EngineProcess(_engine_kwargs(model_dir, "prefill-bi", batch_invariant=True, max_num_batched_tokens=64))
    decode = _decode(model_dir, "decode-bi", batch_invariant=True)
    try:
        prompts = _prompts(12, seed=31) + [TARGET] + _prompts(12, seed=32)
        run = run_disaggregated(prefill, decode, prompts, params)
        assert run.lost == []
        assert (run.tokens[12], run.logprobs[12]) == _alone(model_dir, params)
        decode.check_integrity()
    finally:
        prefill.stop()
        decode.close()


def test_a_sequence_moved_by_its_kv_goes_on_with_the_bits_it_had_alone(model_dir):
    """The source decodes the request amid other streams; after some tokens it is held still and
    its KV shipped to a second engine, which goes on amid streams of its own."""
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, logprobs=3)
    tokens_alone, logprobs_alone = _alone(model_dir, params)
    source = EngineProcess(_engine_kwargs(model_dir, "decode-bi-src", batch_invariant=True))
    target = _decode(model_dir, "decode-bi-dst", batch_invariant=True)
    try:
        background = SamplingParams(temperature=0.0, max_tokens=60)
        for index, prompt in enumerate(_prompts(5, seed=41)):
            source.add_request(EngineRequest(f"s{index}", prompt, background))
            target.add_request(EngineRequest(f"t{index}", prompt[::-1], background))
        source.add_request(EngineRequest("m", TARGET, params))
        streamed, logprobs = [], []

        def receive_until(done) -> None:  # the source's deltas of "m", for at most 60 s
            deadline = time.monotonic() + 60
            while not done():
                assert time.monotonic() < deadline, "the source stopped streaming"
                delta = source.receive()
                if delta is None:
                    time.sleep(0.002)
                elif delta.request_id == "m":
                    streamed.extend(delta.token_ids)
                    logprobs.extend(delta.logprobs or [])

        receive_until(lambda: len(streamed) >= 6)
        held = source.call("freeze", "m")
        receive_until(lambda: len(logprobs) >= len(held))  # tokens sampled before the hold, still on their way
        destination = target.add_request(EngineRequest("m", TARGET, params, output_token_ids=held, kv_receive=True))
        assert source.call("migrate", "m", destination) is True
        rest, rest_logprobs = finish_moved(target, "m")
        assert held + rest == tokens_alone
        assert logprobs + rest_logprobs == logprobs_alone
        assert target.stats().transfer.transfers == 1
        target.check_integrity()
    finally:
        source.stop()
        target.close()
