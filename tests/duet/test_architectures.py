"""Every architecture duet runs, from tiny random checkpoints written by transformers itself,
against transformers with the same weights: batched with chunked prompts, with n-gram
speculation, under a sliding window no sequence reaches, at TP=2; and the checkpoints it
refuses, each refused naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from duet import LLM, SamplingParams
from duet.errors import DamagedCheckpointError, UnsupportedCheckpointError
from duet.models.loader import read_arch
from tests.conftest import make_tiny_model
from tests.tiny_families import TINY_FAMILIES
from tests.reference import check_outputs, hf_greedy

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33, list(range(900, 917))]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "adaptive": False}
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir):
    """Each family's checkpoint and transformers' greedy tokens on it, made once."""
    made = {}

    def get(family: str):
        if family not in made:
            path = make_tiny_model(tmp_path_factory.mktemp(family), tiny_tokenizer_dir, family)
            if family == "llama-dynamic":  # transformers' dynamic RoPE keeps state from one prompt to the next
                made[family] = (path, [hf_greedy(path, [prompt], NEW_TOKENS)[0] for prompt in PROMPTS])
            else:
                made[family] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS))
        return made[family]

    return get


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_each_family_matches_transformers_batched_with_chunked_prompts(checkpoints, family):
    """Guards each family's parts: Qwen 2's q/k/v biases, Qwen 3's per-head q/k norms and head
    dims of their own (tied embeddings, 8:1 GQA), Mistral's head_dim and window, Phi-3's fused
    tensors, Llama 3's and YaRN's scaled RoPE, Phi-3's longrope and dynamic NTK, Qwen 3 MoE's unnormalised and normalised top-k
    and its dense layers, Gemma 2's soft-capped scores and logits, (1 + w) norms around both
    blocks, GeGLU and alternating windows, Gemma 3's q/k norms and two RoPEs (linear-scaled
    global), Granite MoE's experts stacked one tensor a projection (and its shared MLP); the 70-token prompt (past every window) is computed in chunks of 32 beside the
    others' decoding."""
    path, references = checkpoints(family)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, family)
    llm.engine.check_integrity()


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen3-moe", "gemma2", "olmo2", "granite-moe"])
def test_ngram_speculation_keeps_each_family_exact(checkpoints, family):
    path, references = checkpoints(family)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, speculative_config=NGRAM)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, f"{family} with n-gram drafts")
    llm.engine.check_integrity()


def test_the_layers_run_in_python_where_the_cpp_stack_lacks_the_family_parts(checkpoints):
    """The C++ decoder stack has no biases or q/k norms: a Qwen's decode steps keep the Python
    loop (its tokens are checked above); a Llama with scaled RoPE keeps the stack (the tables
    carry the scaling), and SmolLM3 too (its NoPE layers' tables have no width)."""
    from duet.kernels import cpu_ops
    from duet.models.decoder_stack import DecoderStack
    from duet.models.loader import load_model

    for family, takes_stack in (("qwen2", False), ("qwen3", False), ("llama3-rope", True), ("smollm3", True)):
        path, _ = checkpoints(family)
        model = load_model(path, torch.float32, "cpu", 256)
        stack = DecoderStack.build(model)
        assert (stack is not None) == (takes_stack and cpu_ops.load() is not None and cpu_ops.load_gguf() is not None), family


def test_sliding_windows_past_the_window_with_cached_prefixes_and_drafts(checkpoints, tmp_path, tiny_tokenizer_dir):
    """Layers with a window see their last ``window`` keys once a sequence is longer (Mistral's
    20, Gemma 3's 24 on two of its three layers): prompts and decodes past the window, a prompt
    whose first 48 tokens are cached (longer than the window), and n-gram drafts verified past
    it, each with transformers' tokens. Qwen's window applies only with ``use_sliding_window``."""
    for family in ("mistral-windowed", "gemma3"):
        path, _ = checkpoints(family)
        assert read_arch(path).max_sequence_len == 1024
        shared = list(range(200, 248))
        prompts = [shared + [5, 6, 7], shared + [9, 10], [11, 12, 13, 11, 12, 13, 11, 12, 13] * 4]
        references = hf_greedy(path, prompts, 2 * NEW_TOKENS)
        params = SamplingParams(temperature=0.0, max_tokens=2 * NEW_TOKENS, min_tokens=2 * NEW_TOKENS)
        for label, settings in (("cached prefix", {}), ("n-gram drafts", {"speculative_config": NGRAM})):
            llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, **settings)
            outputs = [llm.generate([prompt], params)[0] for prompt in prompts]  # one at a time: the second hits the cache
            check_outputs(outputs, references, f"{family}, {label}")
            llm.engine.check_integrity()
    qwen = make_tiny_model(tmp_path / "qwen2", tiny_tokenizer_dir, "qwen2", sliding_window=40, use_sliding_window=False)
    assert read_arch(qwen).layer_windows is None


def _edit_config(path, **changes) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def test_unsupported_checkpoints_are_refused_naming_the_architecture_or_the_field(checkpoints, tmp_path, tiny_tokenizer_dir):
    path = make_tiny_model(tmp_path / "gelu", tiny_tokenizer_dir, "qwen2", hidden_act="gelu")
    with pytest.raises(UnsupportedCheckpointError, match=r"Qwen2ForCausalLM.*hidden_act='gelu' is not supported"):
        LLM(model=str(path), num_kv_blocks=16)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedCheckpointError, match=r"GPT2LMHeadModel.*duet runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        read_arch(path)
    scaled = make_tiny_model(tmp_path / "scaled", tiny_tokenizer_dir, "llama3-rope")
    _edit_config(scaled, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedCheckpointError, match="rope scaling 'proportional' is not supported"):
        read_arch(scaled)


def test_damaged_checkpoints_fail_at_load_naming_the_tensor(tmp_path, tiny_tokenizer_dir):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path / "qwen3", tiny_tokenizer_dir, "qwen3")
    weights_file = path / "model.safetensors"
    weights = load_file(str(weights_file))
    save_file({name: tensor for name, tensor in weights.items() if name != "model.layers.1.self_attn.k_norm.weight"}, str(weights_file))
    with pytest.raises(DamagedCheckpointError, match=r"tensor model\.layers\.1\.self_attn\.k_norm\.weight is missing"):
        LLM(model=str(path), num_kv_blocks=16)
    weights["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"][:, :-8].contiguous()
    save_file(weights, str(weights_file))
    with pytest.raises(DamagedCheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \(64, 88\) where config\.json gives \(64, 96\)"):
        LLM(model=str(path), num_kv_blocks=16)


TP2 = {"tensor_parallel_size": 2}
LAYOUTS = [(family, "TP=2", TP2) for family in ("qwen3", "qwen2", "qwen3-moe", "qwen2-moe", "gemma2", "llama-biases", "olmo2")] + [
    ("qwen2-moe", "EP=2", {**TP2, "enable_expert_parallel": True}),
    ("granite-moe-shared", "EP=2", {**TP2, "enable_expert_parallel": True}),
    ("olmo2", "PP=2", {"pipeline_parallel_size": 2}),
    ("gemma3", "PP=2", {"pipeline_parallel_size": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, layout, settings", LAYOUTS, ids=[f"{family}-{layout}" for family, layout, _ in LAYOUTS])
def test_parallel_layouts_match_transformers(ray_cluster, checkpoints, family, layout, settings):
    """TP=2: each rank holds its heads' rows of the q/k/v biases and the whole per-head norms
    (OLMo 2's norms over all heads gather the ranks' rows); a MoE's dense layer splits its own
    width; Gemma 2's soft-capped, windowed heads split as any; a Llama's gate/up biases split
    with their features, its o and down biases are added once. EP=2: Qwen 2 MoE's and Granite MoE
    Shared's ranks hold two routed experts each and half the shared expert's features, so that
    their sum adds it once (Granite's ungated).
    PP=2: a stage boundary between blocks whose norms sit after them (OLMo 2) or around them
    (Gemma 3): the second stage's first block takes the residual stream as the first leaves it."""
    path, references = checkpoints(family)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, **settings)
    try:
        check_outputs(llm.generate(PROMPTS, _greedy()), references, f"{family} at {layout}")
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


def test_generation_config_eos_ids_end_generation_unless_eos_is_ignored(checkpoints, tmp_path):
    """Qwen's and Gemma's ``generation_config.json`` name several EOS ids: each ends a sequence,
    with the token, as transformers' ``generate`` stops; ``ignore_eos`` runs past them."""
    import shutil

    source, references = checkpoints("qwen2")
    path = tmp_path / "qwen2-eos"
    shutil.copytree(source, path)
    stop_at = references[1].token_ids[3]  # the fourth greedy token of the second prompt
    config = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop_at]}))
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256)
    output = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))[0].outputs[0]
    first = references[1].token_ids.index(stop_at)
    assert output.token_ids == references[1].token_ids[: first + 1]
    assert output.finish_reason == "stop"
    ignoring = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))[0].outputs[0]
    assert ignoring.token_ids == references[1].token_ids


def test_a_sharded_checkpoint_loads_from_its_shards(checkpoints, tmp_path, tiny_tokenizer_dir):
    """The same weights saved in shards with ``model.safetensors.index.json`` give the same tokens."""
    _, references = checkpoints("qwen3")
    path = make_tiny_model(tmp_path / "sharded", tiny_tokenizer_dir, "qwen3", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256)
    check_outputs(llm.generate(PROMPTS, _greedy()), references, "qwen3 from shards")
