"""The router's torch-free tokenizer encodes exactly as transformers does: on the tests' small
tokenizer (SmolLM2's special tokens and chat template), and on SmolLM2's own as transformers
saved it (``slow``: it comes with the model's download)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from duet.router.tokenizer import RouterTokenizer
from duet.benchmarks.prompts import parity_conversations


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_prompts_and_chat_templates_encode_as_transformers_does(model, request):
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue("tiny_tokenizer_dir" if model == "tiny" else "smollm2_dir")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    router = RouterTokenizer(model_dir)
    for conversation in parity_conversations():
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert router.encode_chat(conversation) == expected
    for text in ["Hello world", "  spaced\nlines\t", "unicode: é 中文 🙂"]:
        assert router.encode(text) == tokenizer.encode(text, add_special_tokens=True)
    assert router.token_text(tokenizer.encode(" Paris")[0]) == " Paris"


def test_a_conversation_left_open_or_continued_encodes_as_transformers_does(tiny_tokenizer_dir):
    """``add_generation_prompt`` false leaves the assistant's turn unopened; with
    ``continue_final_message`` the text ends at the last message's (an assistant's reply begun
    by the client, trailing spaces or not), as transformers' ``apply_chat_template`` cuts it."""
    from transformers import AutoTokenizer

    from duet.router.tokenizer import ChatTemplateError

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    router = RouterTokenizer(tiny_tokenizer_dir)

    def expected(conversation, **options):
        encoded = tokenizer.apply_chat_template(conversation, tokenize=True, **options)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    for conversation in parity_conversations():
        closed = router.encode_chat_text(router.render_chat(conversation, add_generation_prompt=False))
        assert closed == expected(conversation, add_generation_prompt=False)
        for begun in ["The answer is", "The answer is ", "  Sure:\n"]:
            open_turn = conversation + [{"role": "assistant", "content": begun}]
            text = router.render_chat(open_turn, add_generation_prompt=False, continue_final_message=True)
            assert router.encode_chat_text(text) == expected(open_turn, continue_final_message=True), begun
    with pytest.raises(ChatTemplateError, match="has none"):
        router.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}], add_generation_prompt=False, continue_final_message=True)


def test_the_router_imports_no_torch(tiny_tokenizer_dir):
    code = (
        "import sys; from duet.router.ingress import RouterIngress; "
        f"from duet.router.tokenizer import RouterTokenizer; RouterTokenizer({str(tiny_tokenizer_dir)!r}).encode('hi'); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_templates_pass_tojson_the_arguments_transformers_takes_and_bad_values_are_a_template_error(tmp_path, tiny_tokenizer_dir):
    """Guards a 500 for a model whose template calls ``tojson(sort_keys=True)`` (transformers'
    filter takes it), and for a template that fails on a value with a TypeError."""
    import json
    import shutil

    import pytest

    from duet.router.tokenizer import ChatTemplateError

    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages | tojson(ensure_ascii=False, sort_keys=True) }}{{ messages[0].content + 1 if messages[0].role == 'system' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    router = RouterTokenizer(tmp_path)
    messages = [{"role": "user", "content": "é"}]
    assert router.backend.decode(router.encode_chat(messages)) == json.dumps(messages, ensure_ascii=False, sort_keys=True)
    with pytest.raises(ChatTemplateError, match="rejected the conversation"):
        router.encode_chat([{"role": "system", "content": "a string plus one"}])


def test_reasoning_effort_reaches_the_template_unless_its_own_kwargs_say_otherwise(tmp_path, tiny_tokenizer_dir):
    """OpenAI's ``reasoning_effort`` (the chat's, or a response's ``reasoning.effort``) is a
    template variable, as vLLM passes it; ``chat_template_kwargs`` set it too, and win."""
    import json
    import shutil

    from duet.router.chat import ChatRenderer
    from duet.router.chat_request import ChatCompletionRequest
    from duet.router.responses_api import ResponsesRequest

    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ reasoning_effort | default('unset') }}|{{ messages[-1].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    renderer = ChatRenderer(RouterTokenizer(tmp_path))
    messages = [{"role": "user", "content": "hi"}]

    def render(**fields) -> str:
        return renderer.render(ChatCompletionRequest.model_validate({"model": "m", "messages": messages} | fields))

    assert render() == "unset|hi" and render(reasoning_effort="low") == "low|hi"
    assert render(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == "high|hi"
    response = ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "medium", "summary": "auto"}})
    assert renderer.render(response.chat_request()) == "medium|hi"
    with pytest.raises(ValueError):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "extreme"}})


def test_a_long_prompt_is_tokenized_without_holding_the_gil(tiny_tokenizer_dir):
    """The router tokenizes on a thread so that its event loop, and every stream on it, goes on
    meanwhile; a tokenizer call that held the GIL throughout would stop the loop all the same."""
    import asyncio
    import time

    router = RouterTokenizer(tiny_tokenizer_dir)
    text = "The quick brown fox, 中文 🙂, jumps over 1234 lazy dogs.\n" * 15_000

    async def tokenize_while_ticking() -> tuple[float, float, list[int]]:
        gaps = []

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        tokens = await asyncio.to_thread(router.encode, text)
        took = time.perf_counter() - start
        ticker.cancel()
        return took, max(gaps), tokens

    took, longest_gap, tokens = asyncio.run(tokenize_while_ticking())
    assert tokens == router.backend.encode(text).ids
    assert longest_gap < took / 4, f"the loop stood still for {longest_gap:.3f} s of the {took:.3f} s the prompt took"
    assert router.decode(tokens[:50]) == router.backend.decode(tokens[:50], skip_special_tokens=False)
