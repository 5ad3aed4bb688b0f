"""Prefill and decode engines in two processes over gloo give the colocated engine's tokens (tiny
Llama): decode chosen first, the prompt's KV streamed in layer runs while the prefill computes
(or sent once it is done), the first token travelling with it."""

from __future__ import annotations

import time

import pytest

from duet import LLM, SamplingParams
from duet.config import EngineArgs
from duet.engine import LLMEngine
from duet.engine_process import EngineProcess
from duet.errors import InvalidRequestError
from duet.messages import EngineRequest
from tests.kv_transfer.pd_harness import doomed_prefill, migrate_live, run_disaggregated
from tests.reference import compare_to_reference, hf_greedy

# Lengths 5, 33 and 70 end in partial blocks; 48 fills its last block exactly.
PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 948))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)


def _engine_kwargs(model_dir, name: str, **overrides) -> dict:
    kv = {"name": name, "timeout_s": overrides.pop("timeout_s", 30.0), "stream_layers": overrides.pop("stream_layers", True)}
    return dict(model=str(model_dir), num_kv_blocks=128, max_model_len=512, kv_transfer_config=kv) | overrides


def _decode(model_dir, name: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineArgs(**_engine_kwargs(model_dir, name, **overrides)))


# Two engines in processes of their own, KV between them over gloo: seconds a test.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, 10)


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir):
    process = EngineProcess(_engine_kwargs(tiny_llama_dir, "prefill-0"))
    yield process
    process.stop()


def test_disaggregated_greedy_matches_transformers_and_colocated(prefill, tiny_llama_dir, references):
    decode = _decode(tiny_llama_dir, "decode-0")
    run = run_disaggregated(prefill, decode, PROMPTS, GREEDY)
    for index, (got, reference) in enumerate(zip(run.tokens, references)):
        assert compare_to_reference(got, reference, f"PD prompt {index}") is None
    colocated = LLM(model=str(tiny_llama_dir), max_model_len=512).generate(PROMPTS, GREEDY)
    assert run.tokens == [output.outputs[0].token_ids for output in colocated]
    assert (run.lost, decode.stats().transfer.transfers) == ([], len(PROMPTS))
    decode.check_integrity()
    decode.close()


def test_kv_sent_once_the_forward_is_done_gives_the_same_tokens(tiny_llama_dir, references):
    """``stream_layers=False`` (a prefill replica on shared cores): every layer goes once the
    forward is done, prompts in several chunks too."""
    process = EngineProcess(_engine_kwargs(tiny_llama_dir, "prefill-whole", stream_layers=False, max_num_batched_tokens=32))
    try:
        decode = _decode(tiny_llama_dir, "decode-whole")
        run = run_disaggregated(process, decode, PROMPTS, GREEDY)
        for index, (got, reference) in enumerate(zip(run.tokens, references)):
            assert compare_to_reference(got, reference, f"PD prompt {index}") is None
        assert (run.lost, decode.stats().transfer.transfers) == ([], len(PROMPTS))
        decode.check_integrity()
        decode.close()
    finally:
        process.stop()


def test_prefix_hit_on_prefill_still_sends_every_block(prefill, tiny_llama_dir):
    """The second run hits the prefill prefix cache; decode must still get the whole prompt."""
    decode = _decode(tiny_llama_dir, "decode-1")
    prompt = list(range(700, 770))  # not seen by the prefill engine before
    reference = hf_greedy(tiny_llama_dir, [prompt], 10)[0]
    first = run_disaggregated(prefill, decode, [prompt], GREEDY)
    again = run_disaggregated(prefill, decode, [prompt], GREEDY)
    assert (first.num_cached_tokens, again.num_cached_tokens) == ([0], [64])  # 70 tokens: 4 full blocks hit
    assert compare_to_reference(again.tokens[0], reference, "PD prefix hit") is None
    assert first.tokens == again.tokens
    assert decode.stats().transfer.bytes == 2 * _prompt_kv_bytes(decode, len(prompt))
    decode.check_integrity()
    decode.close()


def test_mismatched_block_size_is_refused_and_recomputed_or_lost(prefill, tiny_llama_dir, references):
    """Guards the handshake: a decode engine with another block size never scatters foreign KV."""
    refusing = _decode(tiny_llama_dir, "decode-2", block_size=32)
    run = run_disaggregated(prefill, refusing, PROMPTS[:1], GREEDY, recompute=False)
    assert run.tokens == [None] and "block_size: here 32, peer 16" in run.lost[0]
    refusing.check_integrity()
    refusing.close()
    recomputing = _decode(tiny_llama_dir, "decode-3", block_size=32)
    run = run_disaggregated(prefill, recomputing, PROMPTS[:1], GREEDY)
    assert compare_to_reference(run.tokens[0], references[0], "recomputed after refused handshake") is None
    recomputing.check_integrity()
    recomputing.close()


def test_prefill_killed_mid_transfer_is_recomputed_on_decode(tiny_llama_dir, references):
    """Guards against a decode engine waiting forever, or leaking blocks, when prefill dies."""
    doomed = doomed_prefill(_engine_kwargs(tiny_llama_dir, "prefill-doomed"))
    decode = _decode(tiny_llama_dir, "decode-4", timeout_s=3)
    run = run_disaggregated(doomed, decode, PROMPTS[1:2], GREEDY, timeout_s=120)
    doomed.process.join(10)
    assert compare_to_reference(run.tokens[0], references[1], "recomputed after prefill died") is None
    assert len(run.lost) == 1 and "broke" in run.lost[0]
    decode.check_integrity()
    decode.close()


def test_an_aborted_request_frees_its_reserved_blocks_on_both_sides(prefill, tiny_llama_dir):
    """Guards the decode replica's held blocks after aborted transfers: an abort cancels the
    transfer, and the blocks come back once the receiver lets go of them."""
    decode = _decode(tiny_llama_dir, "decode-5")
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    destination = decode.add_request(EngineRequest("gone", PROMPTS[1], params, kv_receive=True))
    assert decode.kv_cache_manager.num_free_blocks < 128
    decode.abort_request("gone")  # before the prefill even starts: the blocks were never written
    prefill.add_request(EngineRequest("gone", PROMPTS[1], params, kv_send=destination))
    for _ in range(200):
        decode.step()
        if not decode.has_unfinished_requests():
            break
    assert decode.kv_cache_manager.num_free_blocks == 128
    decode.check_integrity()
    with pytest.raises(InvalidRequestError, match="no KV connector"):
        LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=16)).add_request(
            EngineRequest("x", PROMPTS[0], params, kv_receive=True)
        )
    decode.close()


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculation_on_the_decode_engine_over_transferred_kv(method, prefill, tiny_llama_dir, references):
    """The prefill engine knows nothing of speculation; the decode engine computes the draft's KV
    for the transferred prompt itself. With the target as its own draft every draft token must
    then be accepted, which it would not be over wrong draft KV."""
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        config["model"] = str(tiny_llama_dir)
    decode = _decode(tiny_llama_dir, f"decode-{method}", speculative_config=config)
    run = run_disaggregated(prefill, decode, PROMPTS, GREEDY)
    for index, (got, reference) in enumerate(zip(run.tokens, references)):
        assert compare_to_reference(got, reference, f"PD {method} prompt {index}") is None
    spec = decode.scheduler.spec_stats
    if method == "draft_model":
        assert spec.num_drafts >= len(PROMPTS) and spec.num_accepted_tokens == spec.num_draft_tokens
    decode.check_integrity()
    decode.close()


def _prompt_kv_bytes(engine, num_tokens: int) -> int:
    """Bytes on the wire for a prompt: whole blocks, K and V, every layer."""
    arch = engine.model_config
    num_blocks = -(-num_tokens // engine.block_size)
    return arch.num_layers * 2 * arch.num_kv_heads * num_blocks * engine.block_size * arch.head_dim * 4


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60), SamplingParams(temperature=0.9, seed=11, max_tokens=60, min_tokens=60)],
    ids=["greedy", "seeded"],
)
def test_a_decoding_sequence_migrates_by_kv_and_goes_on_as_if_it_had_not_moved(tiny_llama_dir, params):
    """Live migration between decode engines: the sequence is held still between two steps, a
    second engine reserves blocks for its prompt and output so far, the first ships that KV
    and lets the sequence go. Greedy and seeded tokens equal an undisturbed run's; the second
    engine computed no prompt (one transfer, no prefill), and neither engine leaks a block."""
    source = EngineProcess(_engine_kwargs(tiny_llama_dir, "decode-src"))
    target = _decode(tiny_llama_dir, "decode-dst")
    prompt = PROMPTS[1]
    undisturbed = LLM(model=str(tiny_llama_dir), max_model_len=512).generate([prompt], params)[0].outputs[0].token_ids
    try:
        held, rest = migrate_live(source, target, EngineRequest("m", prompt, params))
        assert held + rest == undisturbed
        assert target.stats().transfer.transfers == 1 and target.stats().kv.prefix_cache_queries == 0
        target.check_integrity()
    finally:
        source.stop()  # checks the source's integrity too: the sent blocks came back
        target.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_travels_as_it_is_and_decodes_as_colocated(tiny_llama_dir, kv_cache_dtype):
    """Both pools with a one-byte KV cache: the codes and their scales cross unchanged, so the
    PD tokens are the colocated engine's with the same cache dtype, for a quarter of fp32's bytes
    (the tiny model's 16-wide heads: 17 bytes a row against 64)."""
    prefill = EngineProcess(_engine_kwargs(tiny_llama_dir, f"prefill-{kv_cache_dtype}", kv_cache_dtype=kv_cache_dtype))
    try:
        decode = _decode(tiny_llama_dir, f"decode-{kv_cache_dtype}", kv_cache_dtype=kv_cache_dtype)
        run = run_disaggregated(prefill, decode, PROMPTS, GREEDY)
        colocated = LLM(model=str(tiny_llama_dir), max_model_len=512, kv_cache_dtype=kv_cache_dtype).generate(PROMPTS, GREEDY)
        assert run.tokens == [output.outputs[0].token_ids for output in colocated]
        assert run.lost == []
        fp32_bytes = sum(_prompt_kv_bytes(decode, len(prompt)) for prompt in PROMPTS)
        assert decode.stats().transfer.bytes * 64 == fp32_bytes * 17
        decode.check_integrity()
        decode.close()
        refusing = _decode(tiny_llama_dir, f"decode-{kv_cache_dtype}-float")
        refused = run_disaggregated(prefill, refusing, PROMPTS[:1], GREEDY, recompute=False)
        assert refused.tokens == [None] and "kv_dtype: here 'float32'" in refused.lost[0]
        refusing.close()
    finally:
        prefill.stop()


def test_a_prefill_engine_takes_a_prompt_whose_output_would_not_fit_its_own_cache(tiny_llama_dir):
    """Guards a prefill pool sized for prompts: it computes a prompt and one token, but refused a
    request whose prompt plus its whole max_tokens (the decode pool's to hold) exceeded its cache."""
    prompts, params = PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=200, min_tokens=200)
    small = EngineProcess(_engine_kwargs(tiny_llama_dir, "prefill-small", num_kv_blocks=8))  # 128 tokens; 270 asked
    decode = _decode(tiny_llama_dir, "decode-small")
    try:
        run = run_disaggregated(small, decode, prompts, params)
    finally:
        small.stop()
    colocated = LLM(model=str(tiny_llama_dir), max_model_len=512).generate(prompts, params)
    assert (run.tokens, run.lost) == ([output.outputs[0].token_ids for output in colocated], [])
    decode.check_integrity()
    decode.close()


def test_an_engine_whose_requests_all_wait_for_kv_waits_between_steps(tiny_llama_dir):
    """While every request waits for its prompt's KV, a step computes nothing: the engine waits
    ``IDLE_STEP_WAIT_S`` before the next instead of spinning a core away from the prefill (it
    made some 50,000 empty steps a second). The wait is a floor, whatever the machine's speed."""
    from duet.engine import IDLE_STEP_WAIT_S

    decode = _decode(tiny_llama_dir, "decode-idle")
    decode.add_request(EngineRequest("waits", PROMPTS[1], SamplingParams(max_tokens=4), kv_receive=True))
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        decode.step()
        steps += 1
    assert decode.has_unfinished_requests()
    assert steps <= 0.2 / IDLE_STEP_WAIT_S + 1
    decode.abort_request("waits")
    decode.close()
