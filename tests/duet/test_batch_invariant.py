"""``batch_invariant: true``: a request's tokens and logprobs are bitwise the same alone, in any
batch at any place, whatever the prefill chunks, on a prefix-cache hit, after preemption, with
n-gram speculation, a quantized KV cache, a LoRA adapter, experts, a sliding window or soft caps, greedy
and seeded
(``duet.models.batch_invariant``).

The engine tests run a tiny random Llama with heads of 64 (the C++ prompt attention's tiles) on
token ids; one slow test runs SmolLM2 against transformers' greedy tokens.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.nn.functional as F

from duet import LLM, SamplingParams
from duet.config import ConfigError, EngineArgs
from duet.engine import LLMEngine
from duet.kernels import cpu_ops
from duet.messages import EngineRequest
from duet.models.linear import Linear
from tests.conftest import make_tiny_llama
from tests.gguf_writer import make_tiny_gguf_llama

pytestmark = pytest.mark.skipif(cpu_ops.load_gguf() is None or cpu_ops.load() is None, reason="needs duet's C++ CPU kernels")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, seed=1234, max_tokens=24, min_tokens=24, logprobs=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_product_row_is_the_same_whatever_rows_and_threads_share_the_call(dtype):
    ops = cpu_ops.load_gguf()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 320, generator=generator).to(dtype)  # 1000: a last panel part full
    linear = Linear(320, 1000)
    linear.weight.data = weight
    linear.make_batch_invariant()
    panels = linear.invariant_panels
    assert panels is not None and linear.packed_weight is None
    x = torch.randn(64, 320, generator=generator).to(dtype)
    full = ops.invariant_linear(x, panels, 1000)
    exact = F.linear(x.double(), weight.double())
    assert torch.allclose(full.double(), exact, atol=1e-3, rtol=1e-4)
    for rows in (1, 2, 3, 7, 12, 13, 25, 33):
        for first in (0, 5, 31):
            assert torch.equal(ops.invariant_linear(x[first : first + rows], panels, 1000), full[first : first + rows])
    order = torch.randperm(64, generator=generator)
    assert torch.equal(ops.invariant_linear(x[order], panels, 1000), full[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.invariant_linear(x, panels, 1000), full)
    finally:
        torch.set_num_threads(threads)


HEADS_OF_64 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), tiny_tokenizer_dir, **HEADS_OF_64)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_tiny_gguf_llama(tmp_path_factory.mktemp("tiny-gguf-llama-64"), tiny_tokenizer_dir, **HEADS_OF_64)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(3, 120))] for _ in range(count)]


TARGET = _prompts(1, seed=7)[0][:100] + list(range(10, 60))  # 150 tokens


def _signature(output) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(tuple(sorted(step.items())) for step in completion.logprobs)


def _engine(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), batch_invariant=True, max_model_len=512, **kwargs)


def _target_among(llm: LLM, params: SamplingParams, size: int, place: int, seed: int) -> tuple:
    background = _prompts(size - 1, seed)
    prompts = background[:place] + [TARGET] + background[place:]
    rng = random.Random(seed)
    lengths = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40)) for _ in background]
    all_params = lengths[:place] + [params] + lengths[place:]
    outputs = llm.generate(prompts, all_params)
    llm.engine.check_integrity()
    return _signature(outputs[place])


def check_alone_and_in_batches(llm: LLM, alone: dict[float, tuple] | None = None) -> None:
    """Greedy and seeded, ``TARGET``'s tokens and logprobs amid 7 and 19 other requests (first
    and a middle place) equal its own alone, and those of ``alone`` (by temperature) where given:
    the check of the parallel layouts (``tests/duet/test_tensor_parallel.py`` and others)."""
    for params in (GREEDY, SEEDED):
        signature = _signature(llm.generate([TARGET], params)[0])
        if alone is not None:
            assert signature == alone[params.temperature], params.temperature
        for place, background in ((0, _prompts(7, seed=1)), (9, _prompts(19, seed=2))):
            prompts = background[:place] + [TARGET] + background[place:]
            all_params = [SamplingParams(temperature=0.0, max_tokens=5 + index) for index in range(len(background))]
            all_params.insert(place, params)
            assert _signature(llm.generate(prompts, all_params)[place]) == signature, (params.temperature, place)
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def alone(model_dir):
    llm = _engine(model_dir, enable_prefix_caching=False)
    signatures = {name: _signature(llm.generate([TARGET], params)[0]) for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}
    del llm
    gc.collect()
    return signatures


@pytest.mark.parametrize("name, params", [("greedy", GREEDY), ("seeded", SEEDED)])
def test_a_request_is_bitwise_the_same_in_batches_of_2_to_64_at_every_place(model_dir, alone, name, params):
    llm = _engine(model_dir, enable_prefix_caching=False)
    for size in (2, 5, 16, 64):
        for place in sorted({0, size // 2, size - 1}):
            assert _target_among(llm, params, size, place, seed=size * 100 + place) == alone[name], (name, size, place)


@pytest.mark.parametrize("budget", [16, 33, 64])
def test_a_request_is_bitwise_the_same_whatever_its_prefill_chunks(model_dir, alone, budget):
    llm = _engine(model_dir, enable_prefix_caching=False, max_num_batched_tokens=budget, max_num_seqs=8)
    assert _target_among(llm, GREEDY, 6, 2, seed=budget) == alone["greedy"]
    assert _signature(llm.generate([TARGET], SEEDED)[0]) == alone["seeded"]


@pytest.mark.parametrize("weights", ["gguf", "int8", "int8 by tiles"])
def test_blocks_give_a_request_the_same_bits_in_any_batch_and_chunks(model_dir, gguf_dir, weights, monkeypatch):
    """A GGUF file's blocks kept beside the floats, and weights quantized at load (blocks alone),
    go by panels for every row count where this CPU's kernels have them (AVX-512); elsewhere
    GGUF's floats take the float kernel and blocks alone go by tiles of rows for every row count
    ("int8 by tiles": blocks alone with no panel layout, as on a CPU without AVX-512)."""
    from duet.kernels.gguf import GGUFWeight

    directory, kwargs = (gguf_dir, {}) if weights == "gguf" else (model_dir, {"quantization": "int8"})
    panels = cpu_ops.load_gguf().panels_need_layout()
    if weights == "int8 by tiles":
        monkeypatch.setattr(GGUFWeight, "lay_out_panels", lambda self: None)
        panels = False
    llm = _engine(directory, enable_prefix_caching=False, max_num_batched_tokens=48, **kwargs)
    linears = [module for module in llm.engine.executor.worker.runner.model.modules() if isinstance(module, Linear)]
    if panels:
        assert all(linear.gguf is not None and linear.gguf.panel_min_rows == 1 for linear in linears)
    elif weights != "gguf":  # blocks alone (the LM head in floats, by the float panels)
        blocks = [linear.gguf for linear in linears if linear.weight is None]
        assert blocks and all(block.panel_codes is None and block.panel_min_rows == cpu_ops.NEVER for block in blocks)
    alone = _signature(llm.generate([TARGET], GREEDY)[0])
    for size, place in ((5, 2), (32, 0), (32, 31)):
        assert _target_among(llm, GREEDY, size, place, seed=size + place) == alone, (size, place)
    if weights == "int8 by tiles":  # steps of hundreds of rows (whole prompts at once) go by the tiles too
        del llm
        wide = _engine(directory, enable_prefix_caching=False, max_num_batched_tokens=1024, **kwargs)
        assert _signature(wide.generate([TARGET], GREEDY)[0]) == alone
        assert _target_among(wide, GREEDY, 16, 3, seed=16) == alone


def test_a_prefix_cache_hit_gives_the_same_bits_as_a_miss(model_dir, alone):
    llm = _engine(model_dir)
    llm.generate([TARGET[:64] + [5, 6, 7]], GREEDY)  # caches the first 64 tokens' blocks
    hit = llm.generate([TARGET], GREEDY)[0]
    assert hit.num_cached_tokens >= 48, hit.num_cached_tokens
    assert _signature(hit) == alone["greedy"]
    again = llm.generate([TARGET], SEEDED)[0]
    assert again.num_cached_tokens > hit.num_cached_tokens and _signature(again) == alone["seeded"]


def test_a_preempted_request_gives_the_same_bits(model_dir, alone):
    llm = _engine(model_dir, enable_prefix_caching=False, num_kv_blocks=40, block_size=16, max_num_seqs=16)
    before = llm.engine.scheduler.num_preemptions
    prompts = [TARGET] + _prompts(11, seed=3)
    params = [GREEDY] + [SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60)] * 11
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > before  # the KV cache cannot hold them all
    assert _signature(outputs[0]) == alone["greedy"]
    llm.engine.check_integrity()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_moved_by_recompute_goes_on_with_the_same_bits(model_dir, alone, params):
    """A sequence taken off one engine after some tokens and sent whole, with those tokens, to
    another (migration by recompute, as the router does when the KV cannot travel): the second
    engine computes the prompt and the tokens as a prompt, amid other requests, and the tokens and
    logprobs that follow are those of the undisturbed run."""
    expected_tokens, expected_logprobs = alone["greedy" if params is GREEDY else "seeded"]
    source = LLMEngine(EngineArgs(model=str(model_dir), batch_invariant=True, max_model_len=512))
    source.add_request(EngineRequest("m", TARGET, params))
    held = []
    while len(held) < 7:
        held += [token for delta in source.step() for token in delta.token_ids]
    source.abort_request("m")
    target = LLMEngine(EngineArgs(model=str(model_dir), batch_invariant=True, max_model_len=512, max_num_batched_tokens=64))
    for index, prompt in enumerate(_prompts(6, seed=21)):
        target.add_request(EngineRequest(f"b{index}", prompt, SamplingParams(temperature=0.0, max_tokens=30)))
    target.add_request(EngineRequest("m", TARGET, params, output_token_ids=held))
    tokens, logprobs = [], []
    for _ in range(200):
        for delta in target.step():
            if delta.request_id == "m":
                tokens += delta.token_ids
                logprobs += delta.logprobs or []
        if not target.has_unfinished_requests():
            break
    assert held + tokens == list(expected_tokens)
    assert tuple(tuple(sorted(step.items())) for step in logprobs) == expected_logprobs[len(held) :]
    target.check_integrity()


def test_ngram_speculation_accepts_the_tokens_the_model_computes_alone(model_dir):
    # Requests asking for logprobs do not draft: the tokens alone are compared here.
    repetitive = [11, 12, 13, 14, 15, 16] * 12
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    plain = _engine(model_dir, enable_prefix_caching=False)
    reference = plain.generate([repetitive], params)[0].outputs[0].token_ids
    del plain
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive": False}
    llm = _engine(model_dir, enable_prefix_caching=False, speculative_config=ngram)
    outputs = llm.generate([repetitive] + _prompts(7, seed=11), [params] * 8)
    spec = llm.engine.stats().spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec  # drafts both kept and rejected
    assert outputs[0].outputs[0].token_ids == reference


def test_a_thousand_identical_requests_amid_random_load_give_one_completion(model_dir):
    llm = _engine(model_dir, max_num_seqs=64)
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=1)
    completions, identical = set(), 0
    while identical < 1000:
        count = min(rng.randint(10, 60), 1000 - identical)
        requests = [(TARGET, params)] * count + [
            (prompt, SamplingParams(temperature=1.0, seed=rng.randrange(10**6), max_tokens=rng.randint(1, 12)))
            for prompt in _prompts(rng.randint(0, 30), seed=rng.randrange(10**6))
        ]
        rng.shuffle(requests)
        outputs = llm.generate([prompt for prompt, _ in requests], [p for _, p in requests])
        completions.update(_signature(output) for (_, p), output in zip(requests, outputs) if p is params)
        identical += count
    assert len(completions) == 1
    llm.engine.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_kv_cache_gives_a_request_the_same_bits_in_any_batch(model_dir, kv_cache_dtype):
    llm = _engine(model_dir, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    alone = _signature(llm.generate([TARGET], GREEDY)[0])
    for size, place in ((5, 2), (32, 0), (32, 31)):
        assert _target_among(llm, GREEDY, size, place, seed=size + place) == alone, (kv_cache_dtype, size, place)


def test_a_lora_adapter_gives_its_request_the_same_bits_amid_the_base_and_itself(model_dir, tmp_path):
    """Rows of one adapter and rows of the base share each step's products; the adapter's
    update of a row does not depend on which rows share it either."""
    from tests.duet.test_lora import make_adapter

    adapter = make_adapter(model_dir, tmp_path / "adapter", 8, 16, ["q_proj", "v_proj", "down_proj"], False, seed=3)
    llm = _engine(model_dir, enable_prefix_caching=False, lora_modules={"a": str(adapter)})
    alone = _signature(llm.generate([TARGET], GREEDY, lora="a")[0])
    assert alone != _signature(llm.generate([TARGET], GREEDY)[0])  # the adapter changes the output
    for size, place in ((5, 2), (32, 0), (32, 31)):
        background = _prompts(size - 1, seed=size + place)
        prompts = background[:place] + [TARGET] + background[place:]
        params = [SamplingParams(temperature=0.0, max_tokens=8 + index % 30) for index in range(size)]
        params[place] = GREEDY
        adapters = ["a" if index % 2 else None for index in range(size)]
        adapters[place] = "a"
        outputs = llm.generate(prompts, params, lora=adapters)
        assert _signature(outputs[place]) == alone, (size, place)
    llm.engine.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen2-moe", "mistral-windowed", "gemma2", "gemma3", "olmo2"])
def test_experts_windows_and_caps_give_a_request_the_same_bits_in_any_batch_and_chunks(tmp_path, tiny_tokenizer_dir, family):
    """Each expert's rows vary with the batch (the tokens routed to it); its products do not,
    and a token adds its experts' outputs in one order. A window of 40 keys (Gemma's: 24), past
    which the 150-token request runs, is masked row by row in the same chunks of keys whatever
    the tile; Gemma 2's capped scores are capped per row too, and Gemma's GeGLU and capped
    logits take torch's tanh one row at a time, as Qwen 2 MoE's shared expert its sigmoid; OLMo 2's
    q/k norms span a row's heads. Greedy still gives transformers' tokens."""
    from tests.conftest import make_tiny_mixtral, make_tiny_model
    from tests.reference import compare_to_reference, hf_greedy

    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    if family == "mixtral":
        path = make_tiny_mixtral(tmp_path / family, tiny_tokenizer_dir, intermediate_size=128, **shape)
    elif family in ("qwen3-moe", "qwen2-moe"):  # renormalised top-k weights; Qwen 3's dense MLP, Qwen 2's shared expert and its sigmoid
        path = make_tiny_model(tmp_path / family, tiny_tokenizer_dir, family, head_dim=64, norm_topk_prob=True, **shape)
    elif family == "mistral-windowed":
        path = make_tiny_model(tmp_path / family, tiny_tokenizer_dir, family, head_dim=64, sliding_window=40, **shape)
    else:  # 1,000 features: torch's threads split a step's GeGLU mid-row (both fail so without ``by_row``)
        path = make_tiny_model(tmp_path / family, tiny_tokenizer_dir, family, head_dim=64, intermediate_size=1000, **shape)
    llm = _engine(path, enable_prefix_caching=False)
    chunked = _engine(path, enable_prefix_caching=False, max_num_batched_tokens=33, max_num_seqs=8)
    for params in (GREEDY, SEEDED):
        alone = _signature(llm.generate([TARGET], params)[0])
        for size, place in ((5, 2), (32, 0), (32, 31)):
            assert _target_among(llm, params, size, place, seed=size + place) == alone, (params.temperature, size, place)
        assert _target_among(chunked, params, 6, 2, seed=33) == alone, params.temperature
    (reference,) = hf_greedy(path, [TARGET], GREEDY.max_tokens)
    assert compare_to_reference(list(llm.generate([TARGET], GREEDY)[0].outputs[0].token_ids), reference, family) is None


def test_models_it_is_not_built_for_are_refused(tmp_path, tiny_tokenizer_dir):
    small_heads = make_tiny_llama(tmp_path / "heads-16", tiny_tokenizer_dir)  # heads of 16
    if cpu_ops.load().prompt_attention_takes(16):
        pytest.skip("this CPU's prompt attention takes heads of 16")
    with pytest.raises(ConfigError, match="batch_invariant"):
        LLM(model=str(small_heads), batch_invariant=True)


@pytest.mark.slow
def test_smollm2_in_one_batch_gives_transformers_tokens_and_the_bits_of_each_alone(parity_prompts, parity_references):
    from tests.duet.test_parity_smollm2 import GREEDY as PARITY, _check

    llm = LLM(model="smollm2", max_model_len=1024, batch_invariant=True, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0.0, max_tokens=PARITY.max_tokens, min_tokens=PARITY.max_tokens, logprobs=2)
    batched = llm.generate(parity_prompts, params)
    _check(batched, parity_references, "batch-invariant")  # transformers' tokens, but at near-ties
    for index in (0, 7, 15):
        assert _signature(llm.generate([parity_prompts[index]], params)[0]) == _signature(batched[index]), index
