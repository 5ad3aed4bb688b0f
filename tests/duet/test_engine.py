"""Engine behaviour on a tiny random Llama: sampling options, stops, n, aborts, validation."""

from __future__ import annotations

import pytest

from duet import LLM, SamplingParams
from duet.config import ConfigError
from duet.errors import InvalidRequestError, RequestFailedError
from duet.messages import EngineRequest
from duet.sampling_params import SamplingParamsError
from tests.conftest import TINY_VOCAB, drain
from tests.reference import compare_to_reference, hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917)), [42]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64)
    yield engine
    engine.engine.check_integrity()


def _greedy(max_tokens=12, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kwargs)


def test_greedy_matches_transformers_with_chunked_batches(llm, tiny_llama_dir):
    """Guards the model, the paged cache and chunking (64-token budget) against the oracle."""
    references = hf_greedy(tiny_llama_dir, PROMPTS, 12)
    outputs = llm.generate(PROMPTS, _greedy())
    for index, (output, reference) in enumerate(zip(outputs, references)):
        assert compare_to_reference(output.outputs[0].token_ids, reference, f"prompt {index}") is None
    llm.engine.check_integrity()


def test_stop_string_truncates_text_and_reports_it(llm):
    """Guards against text running past a stop string, or the string leaking into the output."""
    full = llm.generate([PROMPTS[0]], _greedy(max_tokens=16))[0].outputs[0]
    stop = full.text[5:9]
    assert stop and stop not in full.text[:5]
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full.text[: full.text.index(stop) + len(stop)]
    llm.engine.check_integrity()


def test_stop_token_ids_end_generation_on_that_token(llm):
    full = llm.generate([PROMPTS[1]], _greedy())[0].outputs[0].token_ids
    stop_token = full[3]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]))[0]
    assert out.outputs[0].token_ids == full[: full.index(stop_token) + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_token)


def test_min_tokens_holds_back_stop_tokens(llm):
    """Guards against a stop token ending a request before min_tokens."""
    first = llm.generate([PROMPTS[2]], _greedy())[0].outputs[0].token_ids[0]
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[first]))[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 4 and first not in tokens[:4]


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    """Guards per-request generators: the same seed gives the same tokens alone or in a crowd."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10)
    crowd = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others])
    assert crowd[1].outputs[0].token_ids == alone
    different = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=99))
    assert different[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(tiny_llama_dir):
    """Guards the resumed random stream: a preempted seeded request must not replay its draws."""
    params = [SamplingParams(temperature=1.0, max_tokens=40, min_tokens=40, seed=s) for s in range(4)]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[1][:40]]
    roomy = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert roomy.engine.scheduler.num_preemptions == 0
    cramped = LLM(model=str(tiny_llama_dir), num_kv_blocks=12, max_model_len=512)
    got = [o.outputs[0].token_ids for o in cramped.generate(prompts, params)]
    assert cramped.engine.scheduler.num_preemptions > 0
    assert got == expected
    cramped.engine.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_with_speculation_samples_as_without(tiny_llama_dir, method):
    """Guards seeded sampling under speculation: the same tokens as unspeculated, also when
    preempted while drafting (resumed by recompute, as after a move between replicas)."""
    params = [SamplingParams(temperature=0.5, max_tokens=40, min_tokens=40, seed=s) for s in range(4)]
    prompts = [PROMPTS[2], PROMPTS[1], [5, 6, 7] * 8, PROMPTS[3]]
    plain = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    config |= {"model": str(tiny_llama_dir)} if method == "draft_model" else {"prompt_lookup_min": 1}
    for num_kv_blocks in (64, 14):
        llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=num_kv_blocks, max_model_len=512, speculative_config=config)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert got == expected, (num_kv_blocks, stats)
        # The random model's near-uniform samples rarely repeat, so n-grams draft but are seldom
        # kept; the draft model is the target itself, drawing with the same races: nearly all kept.
        assert stats.spec.num_draft_tokens > 0, stats
        if method == "draft_model":
            assert stats.spec.num_accepted_tokens > 0.9 * stats.spec.num_draft_tokens, stats
        assert (llm.engine.scheduler.num_preemptions > 0) == (num_kv_blocks == 14)
        llm.engine.check_integrity()


def test_n_completions_share_the_prompt_blocks(llm):
    """Guards n > 1: distinct samples, one RequestOutput, the prompt's full blocks reused."""
    hits_before = llm.engine.kv_cache_manager.prefix_cache_hits
    out = llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.kv_cache_manager.prefix_cache_hits - hits_before >= 2 * (len(PROMPTS[1]) // 16) * 16
    llm.engine.check_integrity()


def test_logprobs_include_the_sampled_token(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and len(entry) >= 3
        assert max(entry.values()) == entry[token_id] and all(v <= 0 for v in entry.values())


def test_abort_mid_generation_frees_every_block(llm):
    engine = llm.engine
    engine.add_request(EngineRequest("abort-me", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=50)))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.usage > 0
    engine.abort_request("abort-me")
    engine.step()
    engine.check_integrity()
    assert engine.executor.worker.runner.requests == {}


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, TINY_VOCAB], SamplingParams(), "integers in"),
        (list(range(512)), SamplingParams(), "maximum context length is 512; shorten it by at least 1 token so"),
        (list(range(600)), SamplingParams(), "maximum context length is 512; shorten it by at least 89 tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=600), "max_tokens=600 is too large: the 3-token prompt leaves 509"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], params)
    llm.engine.check_integrity()


def test_a_prompt_truncated_as_asked_is_its_last_tokens(llm):
    """``truncate_prompt_tokens`` keeps a prompt's last k tokens (-1: the context's worth): the
    output is that of the cut prompt sent alone, its text the cut prompt's; a prompt past the
    context is refused unless so cut, and k past the context is refused naming the field."""
    long_prompt = list(range(100, 700))  # 600 tokens, past the 512-token context
    cut = llm.generate([long_prompt], _greedy(truncate_prompt_tokens=40))[0]
    alone = llm.generate([long_prompt[-40:]], _greedy())[0]
    assert cut.prompt_token_ids == long_prompt[-40:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    text = llm.generate(["one two three four five six seven"], _greedy(truncate_prompt_tokens=3))[0]
    assert len(text.prompt_token_ids) == 3 and text.prompt == llm.get_tokenizer().decode(text.prompt_token_ids)
    assert llm.generate([PROMPTS[0]], _greedy(truncate_prompt_tokens=-1))[0].prompt_token_ids == PROMPTS[0]
    with pytest.raises(InvalidRequestError, match="maximum context length is 512"):
        llm.generate([long_prompt], _greedy(truncate_prompt_tokens=-1))  # the whole context: no room for a token
    with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens=513 is more than") as refused:
        llm.generate([PROMPTS[0]], _greedy(truncate_prompt_tokens=513))
    assert refused.value.param == "truncate_prompt_tokens"
    with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens must be at least 1"):
        SamplingParams(truncate_prompt_tokens=0)
    llm.engine.check_integrity()


def test_bad_sampling_params_are_refused_at_construction():
    with pytest.raises(SamplingParamsError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [2**70], "min_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [-1], "min_tokens": 2}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_values_the_engine_cannot_represent_are_refused_naming_the_field(params, param):
    """Guards the hostile-input failures: these passed validation, then made the engine step
    raise ('Overflow when unpacking long long') and failed every request in that step."""
    with pytest.raises(SamplingParamsError) as refused:
        SamplingParams(**params)
    assert refused.value.param == param


def test_seeds_at_the_edges_of_64_bits_sample_and_fan_out(llm):
    """n completions seed with seed + index, wrapped into 64 bits: no overflow at the edge."""
    for seed in (2**63 - 1, -(2**63)):
        outputs = llm.generate([PROMPTS[0]], SamplingParams(seed=seed, n=3, max_tokens=4))[0].outputs
        assert [len(output.token_ids) for output in outputs] == [4, 4, 4]
    assert SamplingParams(seed=2**63 - 1).choice(2).seed == -(2**63) + 1
    llm.engine.check_integrity()


def test_a_temperature_near_zero_is_greedy(llm):
    """Guards temperature=1e-45, which divided the logits into NaN and sampled token 0 forever."""
    greedy = llm.generate([PROMPTS[1]], _greedy())[0].outputs[0].token_ids
    tiny = llm.generate([PROMPTS[1]], SamplingParams(temperature=1e-45, max_tokens=12, min_tokens=12, seed=3))
    assert tiny[0].outputs[0].token_ids == greedy


def test_a_failing_step_fails_only_the_request_that_causes_it(tiny_llama_dir):
    """Guards the hostile-input report: one request whose step raises failed every request in
    the step, and the engine kept failing later steps (runner and scheduler disagreed). Now
    the step is rolled back, its requests rerun alone, the culprit alone fails, and the others
    give the tokens of an undisturbed run; no block leaks, no stale prefix-cache entry."""
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64)
    undisturbed = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, _greedy())]
    llm.engine.kv_cache_manager.block_pool.reset_prefix_cache()
    runner = llm.engine.executor.worker.runner
    forbidden = runner._forbidden_token_ids  # read for every row sampled, whichever way

    def poisoned(state):
        if state.request_id == "bad":
            raise ValueError("Overflow when unpacking long long")
        return forbidden(state)

    runner._forbidden_token_ids = poisoned
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"good-{index}", prompt, _greedy()))
    engine.add_request(EngineRequest("bad", PROMPTS[3], _greedy()))
    tokens, errors = drain(engine, 200)
    assert errors.pop("bad") == "the engine failed on this request (ValueError: Overflow when unpacking long long)"
    assert [tokens[f"good-{index}"] for index in range(len(PROMPTS))] == undisturbed
    assert set(errors.values()) == {None}
    engine.check_integrity()
    runner._forbidden_token_ids = forbidden
    again = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, _greedy())]
    assert again == undisturbed  # prefix hits on what the failed steps left behind are exact


def test_offline_generate_raises_for_a_request_the_engine_failed(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512)
    runner = llm.engine.executor.worker.runner
    forbidden = runner._forbidden_token_ids
    runner._forbidden_token_ids = lambda state: (_ for _ in ()).throw(RuntimeError("broken"))
    with pytest.raises(RequestFailedError, match="RuntimeError: broken"):
        llm.generate([PROMPTS[0]], _greedy())
    runner._forbidden_token_ids = forbidden
    assert llm.generate([PROMPTS[0]], _greedy(max_tokens=2))[0].outputs[0].finish_reason == "length"
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"block_size": 12}, ConfigError, "power of two"),
        ({"dtype": "float64"}, ConfigError, "dtype='float64' is not supported"),
        ({"max_num_seqs": 0}, ConfigError, "max_num_seqs"),
        ({"max_model_len": 4096}, ConfigError, "exceeds the model's maximum of 1024"),
        ({"gpu_memory_utilization": 0.9}, TypeError, "unknown arguments"),
    ],
)
def test_bad_engine_settings_fail_at_construction(tiny_llama_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(model=str(tiny_llama_dir), **kwargs)


def test_unknown_model_names_the_aliases():
    from duet.models.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="not a known alias"):
        LLM(model="no-such-model")


HUB_RUN = """
import json
from duet import LLM, SamplingParams
from duet.models.loader import ModelNotFoundError
llm = LLM(model="duet-tests/tiny-llama@main", num_kv_blocks=64, max_model_len=256)
tokens = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))[0].outputs[0].token_ids
try:
    LLM(model="duet-tests/not-there")
    missing = ""
except ModelNotFoundError as error:
    missing = str(error)
print(json.dumps({"tokens": tokens, "missing": missing}))
"""


def test_a_hub_id_is_served_from_huggingface_hubs_cache(tiny_llama_dir, tmp_path):
    """``model: org/name`` (as vLLM takes it) resolves through huggingface_hub's
    ``snapshot_download``: here offline (``HF_HUB_OFFLINE=1``), from its cache, laid out as it
    keeps a download (a snapshot per commit, ``refs/main`` naming it). An id in neither the
    cache nor a reachable hub is refused, naming both."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--duet-tests--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", HUB_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    )[0].outputs[0].token_ids
    assert report["tokens"] == expected
    assert "'duet-tests/not-there' names no local directory, and the Hugging Face hub gave no snapshot" in report["missing"]


@pytest.mark.slow
def test_workers_as_ray_actors_give_the_in_process_tokens(tiny_llama_dir):
    """The executor seam: the same engine with its worker in a Ray actor (the backend a replica's
    TP/PP ranks use) gives the in-process executor's tokens, and its failed steps recover alike."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, distributed_executor_backend="ray")
        local = LLM(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512)
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, n=2)
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)] == [
            [c.token_ids for c in o.outputs] for o in local.generate(PROMPTS, params)
        ]
        llm.engine.check_integrity()
        llm.engine.close()
    finally:
        ray.shutdown()
