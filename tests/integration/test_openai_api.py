"""The OpenAI API over a real cluster, driven by the official ``openai`` client."""

from __future__ import annotations

import pytest

from duet.benchmarks.prompts import PARITY_NEW_TOKENS
from tests.integration.conftest import MAX_MODEL_LEN
from tests.reference import compare_to_reference

pytestmark = pytest.mark.slow

# Prompts of 19 to 572 tokens: short ones take the decode pool's local-prefill path or not
# depending on the threshold (16), long ones span several KV transfer runs.
PARITY_CASES = [0, 3, 7, 12]


def _greedy(client, prompt, **extra):
    return client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=PARITY_NEW_TOKENS, temperature=0,
        extra_body={"min_tokens": PARITY_NEW_TOKENS, "return_token_ids": True, **extra},
    )


@pytest.fixture(scope="module")
def offline_tokens(smollm2_dir, parity_prompts):
    """The offline engine's greedy tokens for the same prompts."""
    import gc

    from duet import LLM, SamplingParams

    llm = LLM(model=str(smollm2_dir), max_model_len=1024, kv_cache_memory_gib=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS, min_tokens=PARITY_NEW_TOKENS)
    outputs = llm.generate([parity_prompts[i] for i in PARITY_CASES], params)
    del llm
    gc.collect()
    return [output.outputs[0].token_ids for output in outputs]


def test_models_lists_the_configured_name(cluster):
    models = cluster.client().models.list()
    assert [model.id for model in models.data] == ["smollm2"]


@pytest.mark.parametrize("colocated", [False, True], ids=["pd", "colocated"])
def test_greedy_over_http_equals_offline_engine_and_transformers(cluster, colocated, parity_prompts, parity_references, offline_tokens):
    client = cluster.client(colocated)
    for case, offline in zip(PARITY_CASES, offline_tokens):
        response = _greedy(client, parity_prompts[case])
        choice = response.choices[0]
        tokens = choice.model_extra["token_ids"]
        note = compare_to_reference(tokens, parity_references[case], f"http prompt {case}")
        offline_note = compare_to_reference(offline, parity_references[case], f"offline prompt {case}")
        if note is None and offline_note is None:
            assert tokens == offline
        assert response.usage.prompt_tokens == len(parity_prompts[case])
        assert response.usage.completion_tokens == PARITY_NEW_TOKENS
        assert choice.finish_reason == "length"


def test_chat_streamed_equals_chat_unstreamed_with_usage(cluster):
    client = cluster.client()
    messages = [{"role": "user", "content": "Name three primary colours."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    content_chunks = [chunk for chunk in chunks if chunk.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks)
    assert streamed == whole.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 16  # long enough for the prefill pool
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_completion_text_equals_unstreamed(cluster):
    client = cluster.client()
    prompt = "The three largest cities of France are"
    whole = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0)
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=20, temperature=0, stream=True
    )]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].text


def test_n_choices_are_seeded_and_counted(cluster):
    client = cluster.client()
    kwargs = dict(
        model="smollm2", prompt="Write a word that rhymes with cat:", max_tokens=8, temperature=1.0, n=2, seed=11,
        extra_body={"return_token_ids": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(choice.index for choice in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in first.choices)


def test_stop_string_cuts_the_text_and_is_reported(cluster):
    client = cluster.client()
    # Over 16 tokens, so it takes the PD path: the first token's text comes from the prefill replica.
    prompt = "Please count from one up to ten, writing every number out in words: one, two,"
    free = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    words = [word for word in free.split(",") if word.strip()]
    assert len(words) >= 3, free
    stop = words[2].strip()
    response = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert response.usage.prompt_tokens > 16
    stopped = response.choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop
    assert stopped.text == free[: free.index(stop)]


def test_logprobs_name_the_sampled_tokens(cluster):
    client = cluster.client()
    response = client.completions.create(model="smollm2", prompt="Paris is the capital of", max_tokens=4, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and max(top.values()) == logprob  # greedy takes the top one


def test_tokenize_and_detokenize_agree_with_what_the_endpoints_count(cluster):
    """vLLM's /tokenize and /detokenize: a chat's tokens are the ones its completion is charged for."""
    import httpx

    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenized = httpx.post(f"{cluster.url}/tokenize", json={"model": "smollm2", "messages": messages}, headers=headers, timeout=60).json()
    completion = cluster.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=2, temperature=0)
    assert tokenized["count"] == len(tokenized["tokens"]) == completion.usage.prompt_tokens
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{cluster.url}/detokenize", json={"model": "smollm2", "tokens": tokenized["tokens"]}, headers=headers, timeout=60).json()
    assert text["prompt"].endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    plain = httpx.post(f"{cluster.url}/tokenize", json={"model": "smollm2", "prompt": "Paris"}, headers=headers, timeout=60).json()
    assert plain["count"] == len(plain["tokens"]) >= 1
    both = httpx.post(f"{cluster.url}/tokenize", json={"model": "smollm2", "prompt": "a", "messages": messages}, headers=headers, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"


def test_a_prompt_past_the_context_is_cut_only_when_asked(cluster):
    """``truncate_prompt_tokens`` (vLLM's) keeps a prompt's last k tokens, a chat's after its
    template: the answer is the cut prompt's sent alone, and usage counts the tokens kept."""
    import httpx

    client = cluster.client()
    long_prompt = [300 + index % 500 for index in range(MAX_MODEL_LEN + 200)]
    cut = _greedy(client, long_prompt, truncate_prompt_tokens=64)
    alone = _greedy(client, long_prompt[-64:])
    assert cut.usage.prompt_tokens == 64 and cut.choices[0].token_ids == alone.choices[0].token_ids
    messages = [{"role": "user", "content": "Tell me about the history of Paris. " * 3}]
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    tokens = httpx.post(f"{cluster.url}/tokenize", json={"model": "smollm2", "messages": messages}, headers=headers, timeout=60).json()["tokens"]
    chat = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, extra_body={"truncate_prompt_tokens": 20, "return_token_ids": True},
    )
    same = client.completions.create(model="smollm2", prompt=tokens[-20:], max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert chat.usage.prompt_tokens == 20 and chat.choices[0].token_ids == same.choices[0].token_ids


def test_an_assistant_turn_begun_by_the_client_is_continued(cluster):
    """vLLM's ``continue_final_message``: the output goes on from the last message's text (the
    tokens /tokenize gives for the same flags, answered as a completion of them would be); the
    fields OpenAI's clients send along that ask nothing of generation are taken."""
    import httpx

    client = cluster.client()
    messages = [{"role": "user", "content": "Name a city in France."}, {"role": "assistant", "content": "A city in France is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    tokens = httpx.post(f"{cluster.url}/tokenize", json={"model": "smollm2", "messages": messages} | flags, headers=headers, timeout=60).json()["tokens"]
    chat = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, store=False, metadata={"run": "test"}, service_tier="auto",
        reasoning_effort="low",  # SmolLM2's template does not read it: the same tokens
        extra_body=flags | {"return_token_ids": True},
    )
    same = client.completions.create(model="smollm2", prompt=tokens, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    detokenized = httpx.post(f"{cluster.url}/detokenize", json={"model": "smollm2", "tokens": tokens}, headers=headers, timeout=60).json()
    assert detokenized["prompt"].endswith("<|im_start|>assistant\nA city in France is")
    assert chat.usage.prompt_tokens == len(tokens) and chat.choices[0].token_ids == same.choices[0].token_ids


@pytest.mark.parametrize("colocated", [False, True], ids=["pd", "colocated"])
def test_logit_bias_steers_every_token_through_the_pools(cluster, colocated):
    """+100 on one token makes it every greedy choice, on the prefill replica's first token and
    the decode replica's after it (the request is not speculated); -100 keeps the greedy token out."""
    client = cluster.client(colocated)
    plain = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    first = plain.choices[0].model_extra["token_ids"][0]
    steered = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0, logit_bias={"1234": 100},
        extra_body={"return_token_ids": True, "min_tokens": 6},
    )
    assert steered.choices[0].model_extra["token_ids"] == [1234] * 6
    banned = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=1, temperature=0, logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    assert banned.choices[0].model_extra["token_ids"] != [first]


def test_best_of_returns_the_most_likely_of_its_seeded_sequences(cluster):
    """best_of=3 runs the three sequences n=3 would (seeds seed, seed+1, seed+2) and returns the
    one whose tokens have the highest total log-probability."""
    client = cluster.client()
    fields = dict(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5)
    three = client.completions.create(n=3, logprobs=0, **fields).choices
    totals = [sum(choice.logprobs.token_logprobs) for choice in three]
    best = client.completions.create(best_of=3, **fields)
    assert [choice.text for choice in best.choices] == [three[totals.index(max(totals))].text]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == sum(len(choice.logprobs.tokens) for choice in three)


@pytest.mark.parametrize("colocated", [False, True], ids=["pd", "colocated"])
def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(cluster, colocated, smollm2_dir):
    """echo=True with logprobs gives the prompt's tokens and their logprobs before the output's
    (the first prompt token has none), through the prefill pool too; prompt_logprobs gives the
    same numbers in vLLM's shape."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is Paris, and the capital of Italy is"
    response = cluster.client(colocated).completions.create(
        model="smollm2", prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True, extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    num_prompt = response.usage.prompt_tokens
    token_logprobs = choice.logprobs.token_logprobs
    assert len(token_logprobs) == num_prompt + 2 and token_logprobs[0] is None
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == num_prompt
    ids = httpx_tokenize(cluster, prompt)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for position in range(1, num_prompt):
        assert token_logprobs[position] == pytest.approx(expected[position - 1, ids[position]].item(), abs=2e-3)
        assert prompt_logprobs[position][str(ids[position])]["logprob"] == token_logprobs[position]


def test_a_streamed_echo_carries_the_prompt_and_its_logprobs_as_the_unstreamed_body_does(cluster):
    """A streamed echo's first chunk (built off the router's event loop: it scores every prompt
    token) holds the prompt, its tokens' logprobs and prompt_logprobs; the stream joins into the
    unstreamed body's text and logprobs."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    kwargs = dict(model="smollm2", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    whole = cluster.client().completions.create(**kwargs).choices[0]
    chunks = [chunk.choices[0] for chunk in cluster.client().completions.create(stream=True, **kwargs) if chunk.choices]
    assert "".join(choice.text for choice in chunks) == whole.text
    assert [token for choice in chunks if choice.logprobs for token in choice.logprobs.tokens] == whole.logprobs.tokens
    streamed = [logprob for choice in chunks if choice.logprobs for logprob in choice.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)
    assert chunks[0].model_extra["prompt_logprobs"] == whole.model_extra["prompt_logprobs"]


def httpx_tokenize(cluster, prompt: str) -> list[int]:
    import httpx

    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    return httpx.post(f"{cluster.url}/tokenize", json={"model": "smollm2", "prompt": prompt}, headers=headers, timeout=60).json()["tokens"]


def test_sequences_decoded_side_by_side_each_get_their_own_items_through_their_replicas_channel(cluster):
    """A replica sends each router one message a step for all the sequences it follows there
    (``duet.decode_node.channel``): streams read side by side each end at their own length, with
    their own token ids, and the messages carried more than one item each. Through the colocated
    application: the PD one's router admits two sequences at a time (``MAX_RUNNING``)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.client import metric

    client = cluster.client(colocated=True)
    lengths = [24, 28, 32, 36, 40, 44]

    def read(length: int) -> tuple[int, int, str]:
        stream = client.completions.create(
            model="smollm2", prompt=f"Count slowly from one to {length}:", max_tokens=length, temperature=0, stream=True,
            extra_body={"min_tokens": length, "return_token_ids": True},
        )
        token_ids, reason = [], None
        for chunk in stream:
            token_ids += chunk.choices[0].model_extra.get("token_ids") or []
            reason = chunk.choices[0].finish_reason or reason
        return len(token_ids), length, reason

    def counts() -> tuple[float, float]:
        samples = [metric(cluster.colocated_url, f"duet:channel_{name}_total") for name in ("messages", "items")]
        return sum(samples[0].values()), sum(samples[1].values())

    messages_before, items_before = counts()
    with ThreadPoolExecutor(len(lengths)) as pool:
        results = list(pool.map(read, lengths))
    messages, items = (after - before for after, before in zip(counts(), (messages_before, items_before)))
    assert all(got == asked and reason == "length" for got, asked, reason in results)
    assert 0 < messages < items
