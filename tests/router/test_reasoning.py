"""Reasoning output: where an output starts (in, before or after its reasoning), reasoning parted
from content whole and streamed, and a constraint that applies only once the reasoning ends."""

from __future__ import annotations

import json

import llguidance
import pytest

from duet.detokenizer import TextDelta
from duet.reasoning import INSIDE, OPTIONAL, ReasoningSplitter, count_reasoning_tokens, start_mode
from duet.router.responses import Choice, ResponseBuilder
from duet.structured_output import StructuredOutputs, StructuredOutputsError
from duet.tool_calls import HERMES, Tool, tool_grammar

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize(
    "prompt, mode",
    [
        ("<|im_start|>assistant\n", OPTIONAL),  # Qwen 3 thinking: the model opens <think> itself
        ("<|im_start|>assistant\n<think>\n", INSIDE),  # DeepSeek-R1 style: the template opened it
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # Qwen 3, enable_thinking false
        ("<think>old</think> earlier turn<|im_start|>assistant\n", OPTIONAL),
    ],
)
def test_where_an_output_starts(prompt, mode):
    assert start_mode(prompt) == mode


@pytest.mark.parametrize(
    "mode, text, reasoning, content",
    [
        (OPTIONAL, "<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", "\nLet me see: 2 < 3.\n", "\n\nYes."),
        (OPTIONAL, "No thinking here, <thin or not.", "", "No thinking here, <thin or not."),
        (INSIDE, "step one</think>done", "step one", "done"),
        (INSIDE, "cut off while thinking </thi", "cut off while thinking </thi", ""),
        (OPTIONAL, "<thi", "", "<thi"),
    ],
)
def test_reasoning_parts_from_content_the_same_whole_and_in_any_pieces(mode, text, reasoning, content):
    assert ReasoningSplitter(mode).feed(text, final=True) == (reasoning, content)
    for size in range(1, 9):
        splitter, parts = ReasoningSplitter(mode), ("", "")
        pieces = [text[start:start + size] for start in range(0, len(text), size)]
        for position, piece in enumerate(pieces):
            more = splitter.feed(piece, final=position == len(pieces) - 1)
            parts = (parts[0] + more[0], parts[1] + more[1])
        assert parts == (reasoning, content)


@pytest.mark.parametrize(
    "mode, pieces, reasoning",
    [
        (INSIDE, ["Let", " me", " see", "</", "think", ">", "\n\n", "Yes"], 3),  # the closing tag's tokens are not counted
        (INSIDE, ["Let", " me", "</think>", "Yes"], 2),  # nor a tag that is one token
        (OPTIONAL, ["<", "think", ">\n", "Hm", ".", "</think>", "Yes"], 3),  # a token that ends past the opening tag is reasoning
        (OPTIONAL, ["<think>", "Hm", "</think>", "Yes", "</think>"], 1),
        (OPTIONAL, ["No", " thinking", " <think>", "x"], 0),  # the output did not open it
        (INSIDE, ["cut", " off", " </", "thi"], 4),  # cut off while reasoning: all of it
        (INSIDE, ["</think>", "Yes"], 0),
    ],
)
def test_reasoning_tokens_are_the_tokens_that_end_inside_it(mode, pieces, reasoning):
    assert count_reasoning_tokens(pieces, mode) == reasoning
    text = "".join(pieces)
    assert (ReasoningSplitter(mode).feed(text, final=True)[0] != "") == (reasoning > 0)


def test_a_chat_with_reasoning_reports_its_tokens_in_the_usage_as_vllm_does():
    pieces = {1: "<think>", 2: "Hm", 3: "m.", 4: "</think>", 5: "Yes"}
    builder = ResponseBuilder("chatcmpl-1", "m", True, pieces.get, False, False, reasoning_mode=OPTIONAL)
    choices = [Choice(0, ["<think>Hmm.</think>Yes"], [1, 2, 3, 4, 5], "stop"), Choice(1, ["<think>Hm"], [1, 2], "length")]
    usage = builder.usage(4, choices, 0)
    assert usage["completion_tokens"] == 7 and usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert "completion_tokens_details" not in ResponseBuilder("chatcmpl-2", "m", True, pieces.get, False, False).usage(4, choices, 0)


def _accepts(constraint: StructuredOutputs, text: str, tokenizer_dir) -> bool:
    tokenizer = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text())
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar_text())
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize(
    "mode, text, accepted",
    [
        (INSIDE, 'Is it {"answer": "x"}? No: 42.</think>\n\n{"answer": 42}', True),  # anything while thinking
        (INSIDE, 'thinking</think>{"answer": "x"}', False),  # the schema after it
        (INSIDE, '{"answer": 42}', False),  # the reasoning must end first
        (OPTIONAL, '<think>hm</think>\n{"answer": 1}', True),
        (OPTIONAL, '{"answer": 1}', True),
        (OPTIONAL, "Plain text", False),
    ],
)
def test_a_constraint_applies_once_the_reasoning_ends(tiny_tokenizer_dir, mode, text, accepted):
    assert _accepts(StructuredOutputs(json=SCHEMA, reasoning=mode), text, tiny_tokenizer_dir) is accepted


def test_tool_calls_and_regexes_compose_with_reasoning(tiny_tokenizer_dir):
    tools = StructuredOutputs(grammar=tool_grammar([Tool("f")], "required", False), reasoning=INSIDE)
    assert _accepts(tools, 'Which tool? f.</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', tiny_tokenizer_dir)
    assert not _accepts(tools, "Which tool? f.</think>\nNone.", tiny_tokenizer_dir)
    assert _accepts(StructuredOutputs(regex="[0-9]+", reasoning=INSIDE), "count</think>\n123", tiny_tokenizer_dir)
    with pytest.raises(StructuredOutputsError):
        StructuredOutputs(regex="[0-9]+", reasoning="before")


def test_responses_carry_reasoning_content_apart_and_calls_after_it():
    text = '<think>\nThe user wants f.\n</think>\n\nCalling.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    builder = ResponseBuilder("chatcmpl-1", "m", True, str, False, False, reads_calls=HERMES, reasoning_mode=OPTIONAL)
    message = builder.response([Choice(0, [text], [1], "stop")], {})["choices"][0]["message"]
    assert message["reasoning_content"] == "\nThe user wants f.\n" and message["content"] == "\n\nCalling.\n"
    assert [call["function"] for call in message["tool_calls"]] == [{"name": "f", "arguments": '{"a": 1}'}]
    pieces = [text[start:start + 5] for start in range(0, len(text), 5)]
    deltas = [
        builder.chunk(0, TextDelta(piece, [], None, "stop" if position == len(pieces) - 1 else None), position == 0, 0)["choices"][0]
        for position, piece in enumerate(pieces)
    ]
    assert "".join(delta["delta"].get("reasoning_content") or "" for delta in deltas) == message["reasoning_content"]
    assert "".join(delta["delta"].get("content") or "" for delta in deltas) == message["content"]
    arguments = "".join(call["function"]["arguments"] for delta in deltas for call in delta["delta"].get("tool_calls", []))
    assert json.loads(arguments) == {"a": 1} and deltas[-1]["finish_reason"] == "tool_calls"
    plain = ResponseBuilder("chatcmpl-2", "m", True, str, False, False, reasoning_mode=INSIDE)
    cut = plain.response([Choice(0, ["still thinking"], [1], "length")], {})["choices"][0]["message"]
    assert cut == {"role": "assistant", "reasoning_content": "still thinking", "content": None}


THINKING_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


def test_chat_template_kwargs_reach_the_template_and_decide_where_the_output_starts(tmp_path, tiny_tokenizer_dir):
    import shutil

    from duet.router.tokenizer import RouterTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, tmp_path)
    (tmp_path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tokenizer, messages = RouterTokenizer(tmp_path), [{"role": "user", "content": "2 + 2?"}]
    assert tokenizer.thinks and not RouterTokenizer(tiny_tokenizer_dir).thinks
    assert start_mode(tokenizer.render_chat(messages)) == OPTIONAL
    assert start_mode(tokenizer.render_chat(messages, template_kwargs={"enable_thinking": False})) is None
