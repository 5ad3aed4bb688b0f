"""LoRA adapters written by PEFT itself, applied per request beside the base weights: in one
batch with each other and with base requests, greedy output equals transformers on the base
model with that adapter merged by PEFT; adapters and the base never share prefix-cached KV;
adapters that do not fit are refused at load, naming the reason."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from duet import LLM, SamplingParams
from duet.config import ConfigError
from duet.errors import InvalidRequestError
from duet.lora import LoRAError
from tests.conftest import TINY_VOCAB, make_tiny_llama
from tests.reference import check_outputs, hf_greedy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

NEW_TOKENS = 12
# name: (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "attention": (8, 16, ["q_proj", "v_proj"], False),
    "everywhere": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(base_dir, target, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    """A PEFT LoRA adapter of ``base_dir``'s model, its A and B both random (PEFT's own init
    leaves B at zero: an adapter that changes nothing), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.5)
    peft_model.save_pretrained(str(target))
    return target


def merged_model(base_dir, adapter_dir, target):
    """transformers' base model with the adapter merged by PEFT, saved as a plain checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().save_pretrained(str(target))
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(target))
    return target


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "base", tiny_tokenizer_dir, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    adapters, references = {}, {None: hf_greedy(base, prompts, NEW_TOKENS)}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        adapters[name] = make_adapter(base, root / name, rank, alpha, targets, rslora, seed)
        references[name] = hf_greedy(merged_model(base, adapters[name], root / f"{name}-merged"), prompts, NEW_TOKENS)
        assert [ref.token_ids for ref in references[name]] != [ref.token_ids for ref in references[None]]  # it changes the output
    return base, adapters, prompts, references


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_adapters_and_the_base_in_one_batch_match_peft_merged(lora_setup, speculative):
    """Every prompt under every adapter and the base, all in one batch (the same prompts: a
    prefix cache shared across adapters would hand one adapter another's KV), then each again
    alone after the others (prefix-cache hits on its own KV)."""
    base, adapters, prompts, references = lora_setup
    extra = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if speculative else {}
    llm = LLM(model=str(base), lora_modules={name: str(path) for name, path in adapters.items()}, num_kv_blocks=256, **extra)
    names = [None, *ADAPTERS]
    batch = [(prompt, name) for name in names for prompt in prompts]
    random.Random(5).shuffle(batch)
    outputs = llm.generate([prompt for prompt, _ in batch], _greedy(), lora=[name for _, name in batch])
    for (prompt, name), output in zip(batch, outputs):
        check_outputs([output], [references[name][prompts.index(prompt)]], f"adapter {name}")
    for name in names:
        check_outputs(llm.generate(prompts, _greedy(), lora=name), references[name], f"adapter {name} again")
    llm.engine.check_integrity()
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'missing'"):
        llm.generate(prompts[:1], _greedy(), lora="missing")


def test_adapters_that_do_not_fit_are_refused_naming_the_reason(lora_setup, tmp_path, tiny_tokenizer_dir):
    base, adapters, _, _ = lora_setup
    with pytest.raises(LoRAError, match="rank 8 is above max_lora_rank=4"):
        LLM(model=str(base), lora_modules={"attention": str(adapters["attention"])}, max_lora_rank=4, num_kv_blocks=16)
    other = make_tiny_llama(tmp_path / "other", tiny_tokenizer_dir, hidden_size=96, intermediate_size=128)
    foreign = make_adapter(other, tmp_path / "foreign", 4, 8, ["q_proj"], False, 0)
    with pytest.raises(LoRAError, match="an adapter of another base model"):
        LLM(model=str(base), lora_modules={"foreign": str(foreign)}, num_kv_blocks=16)
    with pytest.raises(ConfigError, match="lora_modules.nowhere: no PEFT adapter at"):
        LLM(model=str(base), lora_modules={"nowhere": str(tmp_path / "nowhere")}, num_kv_blocks=16)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAError, match="cannot read a PEFT adapter"):
        LLM(model=str(base), lora_modules={"broken": str(broken)}, num_kv_blocks=16)
    dora = tmp_path / "dora"
    dora.mkdir()
    for file in adapters["attention"].iterdir():
        (dora / file.name).symlink_to(file)
    (dora / "adapter_config.json").unlink()
    (dora / "adapter_config.json").write_text(json.dumps(json.loads((adapters["attention"] / "adapter_config.json").read_text()) | {"use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora=True is not supported"):
        LLM(model=str(base), lora_modules={"dora": str(dora)}, num_kv_blocks=16)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_adapters_at_parallel_ranks_match_peft_merged(ray_cluster, lora_setup, many_adapters, tmp_path, tiny_tokenizer_dir, layout):
    """At TP=2 each rank holds its rows of B for the projections it splits by output (q/k/v,
    gate/up) and its input features of A for those it splits by input (o, down), whose updates
    are then summed over the ranks with their products; at PP=2 each stage holds its layers'.
    Every adapter and the base in one batch, then an adapter loaded at run time by its folder,
    give PEFT's merged tokens; one of another base model is refused by the ranks, naming why."""
    base, adapters, prompts, references = lora_setup
    many, many_references = many_adapters
    llm = LLM(model=str(base), lora_modules={name: str(path) for name, path in adapters.items()}, num_kv_blocks=256, **layout)
    try:
        names = [None, *ADAPTERS]
        batch = [(prompt, name) for name in names for prompt in prompts]
        outputs = llm.generate([prompt for prompt, _ in batch], _greedy(), lora=[name for _, name in batch])
        for (prompt, name), output in zip(batch, outputs):
            check_outputs([output], [references[name][prompts.index(prompt)]], f"adapter {name} at {layout}")
        check_outputs(llm.generate(prompts, _greedy(), lora=("late", str(many["tune2"]))), many_references["tune2"], f"loaded by folder at {layout}")
        other = make_tiny_llama(tmp_path / "other", tiny_tokenizer_dir, hidden_size=96, intermediate_size=128)
        foreign = make_adapter(other, tmp_path / "foreign", 4, 8, ["q_proj"], False, 0)
        with pytest.raises(InvalidRequestError, match="an adapter of another base model"):
            llm.generate(prompts[:1], _greedy(), lora=("foreign", str(foreign)))
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


# Eight adapters of several ranks and targets, for an engine that holds four at a time.
MANY_TARGETS = (["q_proj", "v_proj"], ["k_proj", "o_proj"], ["gate_proj", "down_proj"], ["q_proj", "up_proj", "o_proj"])


@pytest.fixture(scope="module")
def many_adapters(lora_setup, tmp_path_factory):
    base, _, prompts, _ = lora_setup
    root = tmp_path_factory.mktemp("many")
    adapters, references = {}, {}
    for index in range(8):
        name = f"tune{index}"
        adapters[name] = make_adapter(base, root / name, 2 << (index % 3), 8, list(MANY_TARGETS[index % 4]), index % 2 == 1, 10 + index)
        references[name] = hf_greedy(merged_model(base, adapters[name], root / f"{name}-merged"), prompts, NEW_TOKENS)
    return adapters, references


def test_eight_adapters_round_robin_with_four_held_each_answer_with_its_own(lora_setup, many_adapters):
    """Every prompt under each of 8 adapters, interleaved in one submission, with ``max_loras=4``:
    the engine holds at most four, loads the others in place of those no running request
    uses, and every output is its own adapter's."""
    base, _, prompts, _ = lora_setup
    adapters, references = many_adapters
    names = list(adapters)
    llm = LLM(model=str(base), lora_modules={name: str(path) for name, path in adapters.items()}, max_loras=4, num_kv_blocks=256)
    assert llm.engine.stats().lora.held == names[:4]
    batch = [(prompt, names[index % 8]) for index, prompt in enumerate(prompts * 8)]
    outputs = llm.generate([prompt for prompt, _ in batch], _greedy(), lora=[name for _, name in batch])
    for (prompt, name), output in zip(batch, outputs):
        check_outputs([output], [references[name][prompts.index(prompt)]], f"adapter {name}")
    stats = llm.engine.stats().lora
    assert len(stats.held) == 4 and stats.max_loras == 4
    assert stats.loads >= 4 and stats.evictions == stats.loads  # every load past the first four evicted one
    assert len(llm.engine.executor.worker.runner.loras) == 4
    llm.engine.check_integrity()


def test_adapters_unloaded_are_kept_in_host_memory_up_to_max_cpu_loras(lora_setup, many_adapters):
    """Eight adapters, two held: with ``max_cpu_loras=8`` each is read from its folder once (when
    the engine starts and checks it) and two rounds through all eight read none again, unless an
    adapter's files change; unset (``max_loras``), every load reads its folder. Every output is
    its own adapter's."""
    import os

    base, _, prompts, _ = lora_setup
    adapters, references = many_adapters
    for max_cpu_loras in (8, None):
        llm = LLM(model=str(base), lora_modules={name: str(path) for name, path in adapters.items()}, max_loras=2,
                  max_cpu_loras=max_cpu_loras, num_kv_blocks=128)
        worker = llm.engine.executor.worker
        assert worker.num_lora_reads == 8
        for _ in range(2):
            for name in adapters:
                check_outputs(llm.generate(prompts[:2], _greedy(), lora=name), references[name][:2], f"adapter {name}")
        loads = llm.engine.stats().lora.loads
        assert loads >= 12
        assert worker.num_lora_reads == (8 if max_cpu_loras else 8 + loads)
        if max_cpu_loras:
            weights = adapters["tune0"] / "adapter_model.safetensors"
            os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
            check_outputs(llm.generate(prompts[:2], _greedy(), lora="tune0"), references["tune0"][:2], "tune0 after a touch")
            assert worker.num_lora_reads == 9
        llm.engine.check_integrity()


def test_adapters_loaded_at_run_time_by_folder_and_refused_without_disturbing_others(lora_setup, many_adapters, tmp_path, tiny_tokenizer_dir):
    """An adapter named with its folder is loaded when first used; the same name from another
    folder is another adapter (its own KV, never the first's cached blocks); one that does not
    fit is refused, naming why, and the adapters held go on answering."""
    base, adapters, prompts, references = lora_setup
    many, many_references = many_adapters
    llm = LLM(model=str(base), lora_modules={"attention": str(adapters["attention"])}, max_loras=2, num_kv_blocks=256)
    check_outputs(llm.generate(prompts, _greedy(), lora=("late", str(many["tune3"]))), many_references["tune3"], "loaded by folder")
    check_outputs(llm.generate(prompts, _greedy(), lora=("late", str(many["tune5"]))), many_references["tune5"], "same name, other folder")
    other = make_tiny_llama(tmp_path / "other", tiny_tokenizer_dir, hidden_size=96, intermediate_size=128)
    foreign = make_adapter(other, tmp_path / "foreign", 4, 8, ["q_proj"], False, 0)
    with pytest.raises(InvalidRequestError, match="an adapter of another base model"):
        llm.generate(prompts[:1], _greedy(), lora=("foreign", str(foreign)))
    with pytest.raises(InvalidRequestError, match="rank 8 is above max_lora_rank=4"):
        LLM(model=str(base), max_lora_rank=4, num_kv_blocks=16).generate(prompts[:1], _greedy(), lora=("big", str(adapters["attention"])))
    with pytest.raises(InvalidRequestError, match="cannot read a PEFT adapter"):
        llm.generate(prompts[:1], _greedy(), lora=("nowhere", str(tmp_path / "nowhere")))
    check_outputs(llm.generate(prompts, _greedy(), lora="attention"), references["attention"], "held before the refusals")
    check_outputs(llm.generate(prompts, _greedy(), lora=("late", str(many["tune5"]))), many_references["tune5"], "held before the refusals")
    assert llm.engine.stats().lora.held == ["attention", "late"]
    llm.engine.check_integrity()


@pytest.mark.parametrize(("dtype", "weight_dtype"), [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)])
def test_the_cpp_update_adds_each_rows_own_adapter_and_leaves_the_others(dtype, weight_dtype):
    """``lora_add`` against torch: rows of three adapters (one leaving this product out: an empty
    A), base rows (-1) untouched, more rows of one adapter than a block takes; rows and adapters
    in fp32 or bf16."""
    from duet.kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("the C++ kernels did not build here")
    generator = torch.Generator().manual_seed(0)
    rows, in_features, out_features = 29, 48, 80
    a = [torch.randn(rank, in_features, generator=generator).to(weight_dtype) for rank in (4, 16)] + [torch.empty(0)]
    bt = [torch.randn(rank, out_features, generator=generator).to(weight_dtype) for rank in (4, 16)] + [torch.empty(0)]
    slots = torch.tensor([index % 4 - 1 if index < 12 else 1 for index in range(rows)], dtype=torch.int32)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    y = torch.randn(rows, out_features, generator=generator).to(dtype)
    expected = y.float().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot in (0, 1):
            expected[row] += (x[row].float() @ a[slot].float().T) @ bt[slot].float()
    got = y.clone()
    ops.lora_add(got, x, slots, a, bt)
    untouched = (slots == -1) | (slots == 2)
    assert torch.equal(got[untouched], y[untouched])
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:  # the fp32 sum rounded once (bf16's own tolerance: its last bit may differ)
        torch.testing.assert_close(got, expected.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decoder_stack_runs_adapters_rows_to_the_loops_bits(lora_setup, dtype):
    """Decode steps with adapters' rows take the C++ stack, to the Python loop's very bits (in
    bf16, adapters kept in bf16 too); in fp32 every output is still transformers' with PEFT's merge."""
    from duet.dtypes import cpu_has_fast_bf16
    from tests.duet.test_decoder_stack import _check_every_short_step

    if dtype == "bfloat16" and not cpu_has_fast_bf16():
        pytest.skip("bf16 models take the dequantized float path on CPUs without native bf16")
    base, adapters, prompts, references = lora_setup
    llm = LLM(model=str(base), dtype=dtype, lora_modules={name: str(path) for name, path in adapters.items()}, num_kv_blocks=256)
    model = llm.engine.executor.worker.runner.model
    if model.decoder_stack() is None:
        pytest.skip("the C++ kernels did not build here")
    rows = _check_every_short_step(model)
    names = [None, *ADAPTERS]
    outputs = llm.generate(prompts * len(names), _greedy(), lora=[name for name in names for _ in prompts])
    if dtype == "float32":
        for index, output in enumerate(outputs):
            check_outputs([output], [references[names[index // len(prompts)]][index % len(prompts)]], "stack")
    assert len(rows["stack"]) >= NEW_TOKENS - 1
