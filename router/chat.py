"""A chat request made into a prompt: its conversation checked and rendered by the model's chat
template (with its tools), and what the output will be read for: tool calls in the format the
model writes them (``duet.tool_calls``), reasoning before the content (``duet.reasoning``)."""

from __future__ import annotations

from dataclasses import dataclass

from duet import reasoning
from duet.errors import InvalidRequestError
from duet.router.chat_request import ChatCompletionRequest
from duet.router.tokenizer import ChatTemplateError, RouterTokenizer
from duet.tool_calls import FORMATS, HERMES, ToolFormat, short_call_ids


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    reads_calls: ToolFormat | None  # the format calls are read from the output in (None: none are)
    reasoning_mode: str | None  # where the output starts against its reasoning (None: it has none)


class ChatRenderer:
    """``tool_call_parser``, ``reasoning_parser``: the router's settings (``auto``: from the
    chat template)."""

    def __init__(self, tokenizer: RouterTokenizer, tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.tool_format = tokenizer.tool_format if tool_call_parser == "auto" else tokenizer.own_format(FORMATS[tool_call_parser])
        self.splits_reasoning = reasoning_parser == "think" or (reasoning_parser == "auto" and tokenizer.thinks)

    def prompt(self, body: ChatCompletionRequest) -> ChatPrompt:
        """The request's prompt; ``InvalidRequestError`` naming the field for a conversation or
        tools that cannot be used (a schema check takes milliseconds: call it off the event loop)."""
        text = self.render(body)
        reads_calls = body.tool_mode() is not None
        if reads_calls and self.tool_format is None:
            raise InvalidRequestError(
                "this model's chat template writes tool calls in a format duet does not read (it reads hermes, llama3_json and mistral); "
                "set the router's tool_call_parser to the one the model writes, or send tool_choice: none",
                "tools",
            )
        return ChatPrompt(
            self.tokenizer.encode_chat_text(text),
            self.tool_format if reads_calls else None,
            reasoning.start_mode(text) if self.splits_reasoning else None,
        )

    def render(self, body: ChatCompletionRequest) -> str:
        """The conversation and its tools (their schemas checked as the model writes calls) as
        the chat template renders them."""
        messages, tools = body.conversation(), body.function_tools(self.tool_format or HERMES)
        if self.tool_format is not None and self.tool_format.short_ids:
            messages = short_call_ids(messages)
        if body.continue_final_message and body.add_generation_prompt:
            raise InvalidRequestError("continue_final_message goes on from the last message: set add_generation_prompt to false", "continue_final_message")
        try:
            variables = body.chat_template_kwargs
            if body.reasoning_effort is not None:
                variables = {"reasoning_effort": body.reasoning_effort} | (variables or {})
            return self.tokenizer.render_chat(messages, tools, variables, body.add_generation_prompt, body.continue_final_message)
        except ChatTemplateError as error:
            raise InvalidRequestError(str(error), "messages") from None
