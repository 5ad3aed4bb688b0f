"""RoPE scalings that depend on the sequence's length (``longrope``: Phi-3's long context;
``dynamic``: NTK), against transformers' rule: every token of a forward rotates by the
frequencies of that forward's length (its last position + 1), so a prompt's tokens all see the
whole prompt's length and a generated token its own position + 1. Greedy tokens of random
models hardly feel how early keys were rotated, so these compare log-probabilities: a prompt's
(computed in chunks, scored whole by transformers) and each generated token's."""

from __future__ import annotations

import pytest
import torch

from duet import LLM, SamplingParams
from duet.messages import EngineRequest
from tests.conftest import make_tiny_model

# Past the families' switch (20) from their first token, and crossing it while generating.
LONG, CROSSING = list(range(100, 170)), list(range(900, 917))
NEW_TOKENS = 8
FAMILIES = ["phi3-longrope", "phi3-partial", "llama-dynamic"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(family), tiny_tokenizer_dir, family)
        return made[family]

    return get


def transformers_run(path, prompt: list[int]) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, each one's log-probability, and each prompt token's after those before it,
    from a model loaded for this prompt alone (a dynamic RoPE's frequencies are state that
    outlives a ``generate`` call)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        prompt_rows = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [logits[0].float().log_softmax(-1)[token].item() for logits, token in zip(out.logits, tokens)]  # before EOS is masked
    prompt_logprobs = [prompt_rows[position - 1, prompt[position]].item() for position in range(1, len(prompt))]
    return tokens, logprobs, prompt_logprobs


def _params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0, **extra)


def _own(logprobs: list[dict[int, float]], tokens: list[int]) -> list[float]:
    return [entry[token] for entry, token in zip(logprobs, tokens)]


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "drafts"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prompts_and_generated_tokens_rotate_as_transformers_does(checkpoint, family, drafts):
    """A 70-token prompt computed in chunks of 16 rotates its first chunk by the whole prompt's
    length, as transformers' single forward does; a 17-token prompt switches frequencies at
    position 20, while generating: dynamic keeps the keys cached before, Phi-3 computes the
    whole sequence again (transformers' Phi-3 drops its cache there), drafts or not (the
    model drafting for itself: every draft is accepted, so verifying steps reach the switch)."""
    path = checkpoint(family)
    drafting = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16,
        **({"speculative_config": drafting} if drafts else {}),
    )
    prompts = [LONG, CROSSING, list(range(400, 418))]
    outputs = llm.generate(prompts, _params(prompt_logprobs=0))
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs, prompt_logprobs = transformers_run(path, prompt)
        got = output.outputs[0]
        assert got.token_ids == tokens, (family, len(prompt))
        assert _own(got.logprobs, tokens) == pytest.approx(logprobs, abs=1e-4)
        assert [output.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))] == pytest.approx(prompt_logprobs, abs=1e-4)
    llm.engine.check_integrity()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_prefix_is_reused_only_where_it_was_rotated_alike(checkpoint, family):
    """A 16-token prompt's block (rotated short: the sequence stays under the switch) is cached;
    a 36-token prompt starting with it must compute that block again (rotated by its own
    length), while the same 36-token prompt sent twice reads its blocks back."""
    path = checkpoint(family)
    prompt = LONG[:36]
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, block_size=16)
    llm.generate([prompt[:16] + [5]], SamplingParams(temperature=0.0, max_tokens=2))
    first = llm.generate([prompt], _params())[0]
    assert first.num_cached_tokens == 0
    tokens, logprobs, _ = transformers_run(path, prompt)
    assert first.outputs[0].token_ids == tokens
    assert _own(first.outputs[0].logprobs, tokens) == pytest.approx(logprobs, abs=1e-4)
    again = llm.generate([prompt], _params())[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_context_rotates_its_outputs_as_generated_tokens(checkpoint, family):
    """A sequence resumed elsewhere has its prompt and outputs computed as one context
    (``EngineRequest.own_prompt_len``, the router's way to move a sequence by recomputing it):
    the outputs past the switch keep the rotation they were generated with, so the rest of
    the sequence is transformers' and its log-probabilities too."""
    path = checkpoint(family)
    tokens, logprobs, _ = transformers_run(path, CROSSING)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256)
    engine, done = llm.engine, 5
    rest = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - done, min_tokens=NEW_TOKENS - done, logprobs=0)
    engine.add_request(EngineRequest("resumed", CROSSING + tokens[:done], rest, own_prompt_len=len(CROSSING)))
    got, got_logprobs = [], []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got += delta.token_ids
            got_logprobs += delta.logprobs or []
    assert got == tokens[done:]
    assert _own(got_logprobs, got) == pytest.approx(logprobs[done:], abs=1e-4)
    engine.check_integrity()


@pytest.mark.parametrize("family", ["phi3-longrope", "phi3-partial"])
def test_a_phi3_gguf_file_keeps_its_long_context_factors(tmp_path, monkeypatch, tiny_tokenizer_dir, family):
    """A GGUF file of a long-context Phi-3 (llama.cpp writes its factors as two tensors, the
    original context and the features rotated as keys) converts to the source's longrope
    parameters, and serves as transformers computes the converted checkpoint."""
    import json

    from tests.gguf_writer import write_tiny_gguf

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{family}.gguf", tiny_tokenizer_dir, family)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    [converted] = list((tmp_path / "cache" / "models").iterdir())
    source = json.loads((tmp_path / f"tiny-{family}-source" / "config.json").read_text())["rope_parameters"]
    rope = json.loads((converted / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == source["original_max_position_embeddings"]
    for factors in ("long_factor", "short_factor"):  # fp32 in the file, as transformers computes with them
        assert torch.equal(torch.tensor(rope[factors], dtype=torch.float32), torch.tensor(source[factors], dtype=torch.float32))
    assert rope.get("partial_rotary_factor", 1.0) == source.get("partial_rotary_factor", 1.0)
    outputs = llm.generate([LONG, CROSSING], _params())
    for prompt, output in zip([LONG, CROSSING], outputs):
        tokens, logprobs, _ = transformers_run(converted, prompt)
        assert output.outputs[0].token_ids == tokens
        assert _own(output.outputs[0].logprobs, tokens) == pytest.approx(logprobs, abs=1e-4)
