"""Tool calls at the router: the grammar (what it lets through and what it stops), the parser
(whole and streamed), the request's checks (each a 400 naming its field), the conversation as
chat templates render it, and the response shapes OpenAI's clients read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import llguidance
import pytest

from duet.errors import InvalidRequestError
from duet.router.chat_request import ChatCompletionRequest
from duet.router.responses import Choice, ResponseBuilder
from duet.router.tokenizer import RouterTokenizer
from duet.detokenizer import TextDelta
from duet.structured_output import StructuredOutputs
from duet.tool_call_parser import ToolCallParser, parse_output
from duet.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, Tool, short_call_ids, tool_grammar

WEATHER = Tool(
    "get_weather",
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]},
    "The weather in a city",
)
ADD = Tool("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
HERMES_TEMPLATE = Path(__file__).parents[1] / "fixtures" / "hermes" / "chat_template.jinja"
LLAMA3_TEMPLATE = Path(__file__).parents[1] / "fixtures" / "llama3_json" / "chat_template.jinja"


def _accepts(grammar: str, text: str, tokenizer_dir: Path) -> bool:
    """Whether the grammar takes ``text`` as the tokenizer splits it (special tokens as themselves)."""
    tokenizer = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text())
    matcher = llguidance.LLMatcher(tokenizer, StructuredOutputs(grammar=grammar).grammar_text())
    return matcher.consume_tokens(RouterTokenizer(tokenizer_dir).encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize(
    "choice, parallel, text, accepted",
    [
        ("auto", True, "Plain text, even with a < or <tool in it.", True),
        ("auto", True, "Let me look.\n" + CALL, True),
        ("auto", True, CALL + "\n" + ADD_CALL, True),
        ("auto", False, CALL + "\n" + ADD_CALL, False),  # one call at most
        ("auto", True, CALL + "\nand text after", False),  # the output ends after its calls
        ("auto", True, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),  # no such tool
        ("auto", True, '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>', False),  # a string for an integer
        ("auto", True, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', False),  # b is required
        ("required", True, CALL, True),
        ("required", True, "Text first.\n" + CALL, False),
        ("required", True, "", False),
        ("add", True, ADD_CALL, True),  # a named function: that one, once
        ("add", True, CALL, False),
        ("add", True, ADD_CALL + "\n" + ADD_CALL, False),
    ],
)
def test_the_grammar_admits_only_whole_calls_of_the_tools(tiny_tokenizer_dir, choice, parallel, text, accepted):
    assert _accepts(tool_grammar([WEATHER, ADD], choice, parallel), text, tiny_tokenizer_dir) is accepted


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
LLAMA_ADD = '{"name": "add", "parameters": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(
    "choice, parallel, text, accepted",
    [
        ("auto", True, "It is sunny; no call needed {really}.", True),
        ("auto", True, "", True),
        ("auto", True, LLAMA_CALL, True),
        ("auto", True, LLAMA_CALL + "; " + LLAMA_ADD, True),
        ("auto", False, LLAMA_CALL + "; " + LLAMA_ADD, False),
        ("auto", True, "Sure. " + LLAMA_CALL, True),  # text: the call is not read, and the text is free
        ("auto", True, '{"answer": 42}', False),  # text never starts as a call does
        ("auto", True, '{"name": "add", "arguments": {"a": 1, "b": 2}}', False),  # Llama's key is parameters
        ("required", True, "Sure. " + LLAMA_CALL, False),
        ("add", True, LLAMA_ADD, True),
        ("add", True, LLAMA_CALL, False),
    ],
)
def test_llama3_json_calls_are_the_whole_output_from_its_first_character(tiny_tokenizer_dir, choice, parallel, text, accepted):
    assert _accepts(tool_grammar([WEATHER, ADD], choice, parallel, LLAMA3_JSON), text, tiny_tokenizer_dir) is accepted


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'
MISTRAL_BOTH = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]'


@pytest.mark.parametrize("special", [True, False], ids=["marker-token", "marker-text"])
@pytest.mark.parametrize(
    "choice, parallel, text, accepted",
    [
        ("auto", True, "Plain text, [TOOL and [ brackets.", True),
        ("auto", True, MISTRAL_CALL, True),
        ("auto", True, "Let me look. " + MISTRAL_BOTH, True),
        ("auto", False, MISTRAL_BOTH, False),  # one call at most
        ("auto", True, MISTRAL_CALL + " and text after", False),  # the output ends after its calls
        ("auto", True, MISTRAL_CALL[:-1], False),  # the list closes
        ("auto", True, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]', False),  # b is required
        ("required", True, MISTRAL_BOTH, True),
        ("required", True, "Text first. " + MISTRAL_CALL, False),
        ("add", True, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', True),
        ("add", True, MISTRAL_CALL, False),
    ],
)
def test_mistral_calls_are_one_list_after_its_marker_token_or_text(mistral_tokenizer_dir, tiny_tokenizer_dir, special, choice, parallel, text, accepted):
    """Where ``[TOOL_CALLS]`` is a special token (Mistral's tokenizers) the grammar names it,
    since no text makes it; where it is text, text stops short of it, as Hermes' does."""
    tokenizer_dir = mistral_tokenizer_dir if special else tiny_tokenizer_dir
    style = RouterTokenizer(tokenizer_dir).own_format(MISTRAL)
    assert (style.marker_token is not None) is special
    assert _accepts(tool_grammar([WEATHER, ADD], choice, parallel, style), text, tokenizer_dir) is accepted


@pytest.mark.parametrize("style, text", [(HERMES, None), (LLAMA3_JSON, LLAMA_CALL + "; " + LLAMA_ADD), (MISTRAL, "Sure. " + MISTRAL_BOTH)])
def test_the_parser_reads_content_and_calls_the_same_whole_and_in_any_pieces(style, text):
    """Streamed deltas (the name with the id first, then argument pieces) put together equal the
    whole output's calls, wherever the text is cut, braces and quotes inside strings included."""
    if text is None:
        text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ri}s {", "n": [1, {"a": "]"}]}}\n</tool_call>\n' + ADD_CALL
    content, calls = parse_output(text, style)
    assert [call.name for call in calls] == ["get_weather", "add"] and json.loads(calls[1].arguments) == {"a": 1, "b": 2}
    for size in range(1, 12):
        parser, streamed_content, streamed = ToolCallParser(style), "", {}
        pieces = [text[start:start + size] for start in range(0, len(text), size)]
        for position, piece in enumerate(pieces):
            more, deltas = parser.feed(piece, final=position == len(pieces) - 1)
            streamed_content += more
            for delta in deltas:
                if delta.id is not None:
                    assert delta.index not in streamed and delta.name == calls[delta.index].name
                    streamed[delta.index] = ""
                streamed[delta.index] += delta.arguments
        assert (streamed_content or None) == content
        assert [streamed[index] for index in sorted(streamed)] == [call.arguments for call in calls]


def test_hermes_content_before_the_calls_and_arguments_as_written():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ri}s {", "n": [1, {"a": "]"}]}}\n</tool_call>\n' + ADD_CALL
    content, calls = parse_output(text)
    assert content == "Checking.\n"
    assert [(call.name, call.arguments) for call in calls] == [
        ("get_weather", '{"city": "Pa\\"ri}s {", "n": [1, {"a": "]"}]}'), ("add", '{"a": 1, "b": 2}'),
    ]


def test_llama3_json_text_is_content_and_a_call_only_from_the_first_character():
    assert parse_output("Sure. " + LLAMA_CALL, LLAMA3_JSON) == ("Sure. " + LLAMA_CALL, [])
    assert parse_output('{"answer": 42}', LLAMA3_JSON) == ('{"answer": 42}', [])
    content, calls = parse_output(LLAMA_CALL, LLAMA3_JSON)
    assert content is None and [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Paris", "unit": "c"}')]


def test_mistral_calls_have_ids_its_templates_take_and_the_list_end_is_not_content():
    content, calls = parse_output("Sure. " + MISTRAL_BOTH, MISTRAL)
    assert content == "Sure. " and [call.name for call in calls] == ["get_weather", "add"]
    assert all(len(call.id) == 9 and call.id.isalnum() for call in calls)
    assert parse_output("[TOOL_CALLS] [{\"name\": \"add\", \"arg", MISTRAL) == ("[TOOL_CALLS] [{\"name\": \"add\", \"arg", [])


def test_call_ids_become_nine_letters_or_digits_the_same_for_a_call_and_its_result():
    messages = short_call_ids(CONVERSATION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {"name": "add", "arguments": {}}}]},
        {"role": "tool", "content": "0", "tool_call_id": "abcDEF123"},
    ])
    short = messages[2]["tool_calls"][0]["id"]
    assert len(short) == 9 and short.isalnum() and messages[3]["tool_call_id"] == short
    assert messages[4]["tool_calls"][0]["id"] == messages[5]["tool_call_id"] == "abcDEF123"  # already fit: kept
    assert CONVERSATION[2]["tool_calls"][0]["id"] == "c1"  # the request's own messages untouched


def test_text_that_only_looks_like_a_call_is_content():
    assert parse_output("a <tool_ caller <tool") == ("a <tool_ caller <tool", [])
    # Cut by max_tokens: a call without its end is left out, the text before it kept.
    assert parse_output("Hm.\n" + CALL[:-5]) == ("Hm.\n", [])
    assert parse_output("Hm.\n<tool_call>\n{\"na") == ('Hm.\n<tool_call>\n{"na', [])
    content, calls = parse_output(CALL)
    assert content is None and [call.name for call in calls] == ["get_weather"]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields)


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD.parameters}}]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters"),
        (
            {"tools": TOOLS + [{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}}}]},
            "tools.1.function.parameters",
        ),
        ({"tools": TOOLS + TOOLS}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_a_request_whose_tools_cannot_be_used_is_refused_naming_the_field(fields, param):
    request = _chat(**fields)
    with pytest.raises(InvalidRequestError) as refused:
        request.function_tools()
        request.constraint()
    assert refused.value.param == param


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "3", "tool_call_id": "call_1"}], "messages.1.tool_call_id"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{1"}}]}],
            "messages.0.tool_calls.0.function.arguments",
        ),
        ([{"role": "user", "content": None}], "messages.0.content"),
    ],
)
def test_a_conversation_whose_tool_turns_do_not_fit_is_refused_naming_the_field(messages, param):
    with pytest.raises(InvalidRequestError) as refused:
        _chat(messages=messages).conversation()
    assert refused.value.param == param


def test_tool_choice_decides_what_is_read_from_the_output():
    assert _chat().tool_mode() is None and _chat().constraint() is None
    assert _chat(tools=TOOLS).tool_mode() == "auto"  # OpenAI's default once there are tools
    assert _chat(tools=TOOLS, tool_choice="none").tool_mode() is None
    assert _chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).constraint().json_object
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=True)
    assert named.constraint().grammar == tool_grammar([ADD], "add", False)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "content": "3", "tool_call_id": "c1"},
]


@pytest.mark.parametrize(
    "template, style, call",
    [
        (HERMES_TEMPLATE, HERMES, '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'),
        (LLAMA3_TEMPLATE, LLAMA3_JSON, '<|im_start|>assistant\n{"name": "add", "parameters": {"a": 1, "b": 2}}<|im_end|>'),
    ],
    ids=["hermes", "llama3_json"],
)
def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them(tmp_path, tiny_tokenizer_dir, template, style, call):
    """The format is read from the template, and the rendering (tools, earlier calls, their
    results) is transformers' own."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, tmp_path)
    shutil.copy(template, tmp_path / "chat_template.jinja")
    from transformers import AutoTokenizer

    request = _chat(messages=CONVERSATION, tools=TOOLS)
    tokenizer = RouterTokenizer(tmp_path)
    assert tokenizer.renders_tools and tokenizer.tool_format is style
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        request.conversation(), tools=[tool.template_dict() for tool in request.function_tools()], add_generation_prompt=True, tokenize=False
    )
    rendered = tokenizer.render_chat(request.conversation(), request.function_tools())
    assert rendered == expected and call in rendered
    assert tokenizer.backend.decode(tokenizer.encode_chat(request.conversation(), request.function_tools()), skip_special_tokens=False) == rendered


def test_a_mistral_template_gets_tools_and_short_ids_and_its_marker_is_kept_in_the_output(mistral_tokenizer_dir):
    """Mistral's template renders tools itself and refuses ids that are not 9 letters or digits:
    the ids of earlier calls are made to fit, and the rendering is transformers' own. The
    output's text keeps the ``[TOOL_CALLS]`` token (other special tokens are skipped) so that the
    calls are read from it."""
    from transformers import AutoTokenizer

    from duet.detokenizer import IncrementalDetokenizer
    from duet.router.chat import ChatRenderer

    tokenizer = RouterTokenizer(mistral_tokenizer_dir)
    renderer = ChatRenderer(tokenizer)
    assert tokenizer.renders_tools and renderer.tool_format == tokenizer.own_format(MISTRAL)
    request = _chat(messages=CONVERSATION, tools=TOOLS)
    expected = AutoTokenizer.from_pretrained(str(mistral_tokenizer_dir)).apply_chat_template(
        short_call_ids(request.conversation()), tools=[tool.template_dict() for tool in request.function_tools()],
        add_generation_prompt=True, tokenize=False,
    )
    assert renderer.render(request) == expected and '"arguments": {"a": 1, "b": 2}, "id": "' in expected
    prompt = renderer.prompt(request)
    assert prompt.reads_calls.marker_token == tokenizer.special_tokens["[TOOL_CALLS]"]
    output = tokenizer.encode(MISTRAL_CALL, add_special_tokens=False) + [tokenizer.special_tokens["<|im_end|>"]]
    detokenizer = IncrementalDetokenizer(tokenizer.backend, (), False, True, tokenizer.skipped_ids(prompt.reads_calls))
    detokenizer.add_tokens(output)
    detokenizer.finish()
    assert detokenizer.text == MISTRAL_CALL  # the marker kept, the end of sequence not
    assert tokenizer.skipped_ids(HERMES) is None  # no special marker: skip_special_tokens as asked


def test_a_reply_in_llama3_json_carries_its_calls():
    body = ResponseBuilder("c", "m", True, str, False, False, reads_calls=LLAMA3_JSON).response([Choice(0, [LLAMA_ADD], [1], "stop")], {})
    assert body["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert body["choices"][0]["finish_reason"] == "tool_calls" and body["choices"][0]["message"]["content"] is None


def test_a_template_without_tools_gets_them_written_into_the_messages(tiny_tokenizer_dir):
    """SmolLM2's template knows only roles and text: the tools go into the system turn, the
    calls into the assistant's text, the results into a user turn, all in the format the grammar
    makes the model write."""
    tokenizer = RouterTokenizer(tiny_tokenizer_dir)
    assert not tokenizer.renders_tools
    request = _chat(messages=CONVERSATION, tools=TOOLS)
    rendered = tokenizer.backend.decode(tokenizer.encode_chat(request.conversation(), request.function_tools()), skip_special_tokens=False)
    system, user, assistant, result = rendered.split("<|im_end|>\n")[:4]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(TOOLS[0]) in system
    assert user == "<|im_start|>user\n1 + 2?"
    assert assistant == '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert result == "<|im_start|>user\n<tool_response>\n3\n</tool_response>"


def _builder() -> ResponseBuilder:
    return ResponseBuilder("chatcmpl-1", "m", True, str, False, False, reads_calls=HERMES)


def test_a_response_carries_the_calls_in_openais_shape():
    body = _builder().response([Choice(0, ["Sure.\n" + CALL], [1, 2], "stop")], {})["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["content"] == "Sure.\n"
    (call,) = body["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    cut = _builder().response([Choice(0, [CALL[:40]], [1], "length")], {})["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]


def test_stream_chunks_add_up_to_the_calls_as_openais_client_reads_them():
    """The id, type and name come once, with the call's first argument text; later chunks carry
    argument pieces by index; the last chunk's finish_reason is tool_calls."""
    builder, text = _builder(), "Ok.\n" + CALL + "\n" + ADD_CALL
    pieces = [text[start:start + 7] for start in range(0, len(text), 7)]
    chunks = [
        builder.chunk(0, TextDelta(piece, [], None, "stop" if position == len(pieces) - 1 else None, None), position == 0, 0)["choices"][0]
        for position, piece in enumerate(pieces)
    ]
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "tool_calls"
    content = "".join(chunk["delta"].get("content") or "" for chunk in chunks)
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for piece in chunk["delta"].get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in calls and piece["type"] == "function"
                calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert content == "Ok.\n"
    assert [(call["name"], json.loads(call["arguments"])) for call in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2}),
    ]


def test_a_template_writing_calls_in_another_format_is_refused_naming_tools(tmp_path, tiny_tokenizer_dir):
    """A template that renders tools but shows no call in a format duet reads gets a 400
    before generation, unless the router names the format."""
    from duet.router.chat import ChatRenderer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    )
    request = _chat(tools=TOOLS)
    with pytest.raises(InvalidRequestError) as refused:
        ChatRenderer(RouterTokenizer(tmp_path)).prompt(request)
    assert refused.value.param == "tools"
    assert ChatRenderer(RouterTokenizer(tmp_path), tool_call_parser="hermes").prompt(request).reads_calls is HERMES
    assert ChatRenderer(RouterTokenizer(tmp_path)).prompt(_chat(tools=TOOLS, tool_choice="none")).reads_calls is None
