"""GGUF files as llama.cpp writes them, for each architecture duet converts (Llama, Qwen 2,
Qwen 3, Qwen 2 and 3 MoE, Phi-3 with its fused projections, Gemma 2 and 3, OLMo 2), written by
gguf's own writer from tiny random models: ``model=`` names the file, it is converted once into
the cache, its Q8_0 projections compute from their blocks, its tokenizer and chat template come
from the file, and greedy output equals transformers loading the same file (its own GGUF reader:
an oracle of the conversion, names, RoPE rows and all), or for Gemma and OLMo 2 transformers on
the weights the file holds."""

from __future__ import annotations

import importlib.util
import json

import pytest

from duet import LLM, SamplingParams
from duet.errors import UnsupportedCheckpointError
from duet.kernels import cpu_ops
from duet.models.linear import Linear
from tests.gguf_writer import write_tiny_gguf
from tests.reference import check_outputs, hf_greedy

# transformers reads a GGUF file only with accelerate (the test extras have it); found, not imported.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")

PROMPTS = [[1, 5, 9, 200, 31], list(range(100, 170)), [7] * 33]
NEW_TOKENS = 10


# transformers' GGUF reader takes Qwen 3's head_dim from its config's default (128), not the
# file's key_length: the tiny Qwen 3 has that head_dim (its hidden size over its heads is 16).
# It reads no expert_feed_forward_length either (its Qwen 3 MoE takes the config's default, 768)
# and renormalizes the top k's weights, as llama.cpp does; every layer is experts.
# Its Qwen 2 MoE reads neither expert size (it takes 1,408 and 5,632) and leaves the top k's
# weights as they are, as llama.cpp does.
SHAPES = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}, "phi3": {},
    "qwen3-moe": {"moe_intermediate_size": 768, "norm_topk_prob": True, "mlp_only_layers": []},
    "qwen2-moe": {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False},
}
K_QUANT_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}  # rows of 256


@pytest.mark.parametrize(
    ("family", "projections"),
    [
        ("llama", "Q8_0"), ("qwen2", "Q8_0"), ("qwen3", "Q8_0"), ("qwen3", "Q4_0"), ("phi3", "Q8_0"), ("llama", "Q5_K"),
        ("qwen3-moe", "Q8_0"), ("qwen2", "Q5_1"), ("qwen2-moe", "Q8_0"), ("qwen3", "IQ4_XS"), ("llama", "IQ4_NL"), ("qwen2", "IQ2_XXS"),
    ],
)
def test_a_gguf_file_serves_with_transformers_tokens_from_its_blocks(tmp_path, monkeypatch, tiny_tokenizer_dir, family, projections):
    """Q8_0 projections compute from their blocks as they are, Q4_0 ones rewritten as Q4_1
    blocks, Q5_K and Q5_1 ones as blocks of a byte a code, IQ4_XS and IQ4_NL ones as Q8_0 blocks
    of their table's values, IQ2_XXS ones as Q8_0 blocks of their grid's signed values; a MoE file's stacked experts are
    split per expert (and computed from floats), a Qwen 2 MoE's shared expert computes from its
    blocks and its gate (a vector in the file) becomes a row."""
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    super_blocks = projections.endswith("_K") or (projections.startswith("IQ") and projections != "IQ4_NL")
    shape = SHAPES[family] | (K_QUANT_SHAPE if super_blocks else {})
    path = write_tiny_gguf(tmp_path / f"tiny-{family}.gguf", tiny_tokenizer_dir, family, projections=projections, **shape)
    references = hf_greedy(tmp_path, PROMPTS, NEW_TOKENS, gguf_file=path.name)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    check_outputs(llm.generate(PROMPTS, params), references, f"{family} from {projections} GGUF")
    llm.engine.check_integrity()
    if cpu_ops.load_gguf() is not None:  # the projections compute from the file's blocks
        model = llm.engine.executor.worker.runner.model
        linears = {name: module for name, module in model.named_modules() if isinstance(module, Linear) and "layers" in name}
        routers = {name for name in linears if name.endswith("mlp.gate")}  # F32 in the file, as llama.cpp keeps them
        gates = {name for name in linears if name.endswith("shared_expert_gate")}  # F32 likewise
        assert len(gates) == (model.arch.num_layers if family == "qwen2-moe" else 0)
        assert len(routers) == (model.arch.num_layers if family.endswith("moe") else 0)
        qtype = {"Q8_0": 8, "Q4_0": 3, "Q5_K": 13, "Q5_1": 13, "IQ4_XS": 8, "IQ4_NL": 8, "IQ2_XXS": 8}[projections]
        kept = {name: linear for name, linear in linears.items() if name not in routers | gates}
        assert kept and all(linear.gguf is not None and linear.gguf.qtype == qtype for linear in kept.values())
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ours = llm.get_tokenizer()
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert ours.encode("Hello there, world") == theirs.encode("Hello there, world")
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1
    LLM(model=str(path), num_kv_blocks=16)  # the second load reads the converted directory
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1


def test_a_gguf_file_of_another_architecture_is_refused_naming_it(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="GGUF architecture 'mamba' is not supported; duet converts llama, qwen2, qwen3, phi3"):
        LLM(model=str(path), num_kv_blocks=16)


# Gemma models as llama.cpp can write them: tied embeddings (it drops Gemma's LM head), queries
# scaled by the head dim, Gemma 3's global layer every sixth.
GEMMA_SHAPES = {
    "gemma2": {"tie_word_embeddings": True, "query_pre_attn_scalar": 32},
    "gemma3": {"tie_word_embeddings": True, "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
END_OF_TURN = 7


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_gemma_gguf_file_serves_as_llama_cpp_reads_it(tmp_path, monkeypatch, tiny_tokenizer_dir, family):
    """Norms stored as 1 + w, Q/K rows as they are, the window, soft-caps and Gemma 3's global
    RoPE scaling from the file's keys, and from what llama.cpp fixes per architecture the
    alternation of windowed layers, the query scale and Gemma 3's windowed RoPE base; the file's
    end-of-turn token ends generation beside its EOS. The oracle is transformers on the source
    model with the weights the file holds (transformers' GGUF reader reads no Gemma soft-cap or
    query scale: it takes its defaults)."""
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{family}.gguf", tiny_tokenizer_dir, family, eot_token_id=END_OF_TURN, **GEMMA_SHAPES[family])
    reference_dir = tmp_path / f"tiny-{family}-reference"
    references = hf_greedy(reference_dir, PROMPTS, NEW_TOKENS)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    check_outputs(llm.generate(PROMPTS, params), references, f"{family} from a GGUF file")
    llm.engine.check_integrity()
    assert llm.engine.extra_eos_token_ids == (END_OF_TURN,)
    (converted,) = (tmp_path / "cache" / "models").iterdir()
    ours, source = (json.loads((folder / "config.json").read_text()) for folder in (converted, reference_dir))
    assert ours["layer_types"] == source["layer_types"] and ours["sliding_window"] == source["sliding_window"]
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert ours[key] == pytest.approx(source[key]), key
    if family == "gemma3":
        for layers in ("full_attention", "sliding_attention"):
            assert {key: ours["rope_parameters"][layers].get(key) for key in ("rope_type", "rope_theta", "factor")} == {
                key: source["rope_parameters"][layers].get(key) for key in ("rope_type", "rope_theta", "factor")
            }


def test_an_olmo2_gguf_file_serves_with_its_norms_after_each_block(tmp_path, monkeypatch, tiny_tokenizer_dir):
    """OLMo 2's norms after attention and after the MLP (none before), its q/k norms over all
    heads' features, its Q/K rows as they are (llama.cpp rotates OLMo 2 by halves, NeoX's way).
    transformers reads no OLMo 2 file: the oracle is transformers on the source model with the
    weights the file holds."""
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny-olmo2.gguf", tiny_tokenizer_dir, "olmo2")
    references = hf_greedy(tmp_path / "tiny-olmo2-reference", PROMPTS, NEW_TOKENS)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    check_outputs(llm.generate(PROMPTS, params), references, "olmo2 from a GGUF file")
    llm.engine.check_integrity()
    (converted,) = (tmp_path / "cache" / "models").iterdir()
    assert json.loads((converted / "config.json").read_text())["architectures"] == ["Olmo2ForCausalLM"]
