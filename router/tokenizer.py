"""Tokenization for the router from ``tokenizer.json`` and the chat template, without transformers
(which would load torch into the ingress process). Encodes exactly as transformers does: plain
prompts with the special tokens, rendered chat templates without them."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from duet import reasoning, tool_calls
from duet.structured_output import build_before_serving


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the model's chat template."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson`` filter for chat templates (the arguments templates pass it)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class RouterTokenizer:
    """Encode prompts and conversations, decode single tokens (for logprobs)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tokenizer_json = model_dir / "tokenizer.json"
        self._tokenizer = Tokenizer.from_file(str(self._tokenizer_json))
        self._grammar_tokenizer = None
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.special_tokens = {  # text to id, of the tokens that skip_special_tokens drops
            token.content: token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items() if token.special
        }
        build_before_serving(self.grammar_tokenizer)  # its build holds the GIL: at a first constrained request it stalls every stream
        template_file = model_dir / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self._template = None
        self.renders_tools = self.thinks = False
        self.tool_format: tool_calls.ToolFormat | None = self.own_format(tool_calls.HERMES)  # how the model writes calls (None: a format duet does not read)
        if source:
            # The same sandbox and whitespace settings as transformers' apply_chat_template.
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = environment.from_string(source)
            self.renders_tools = "tools" in meta.find_undeclared_variables(environment.parse(source))
            if self.renders_tools:  # else duet writes the tools in, in Hermes' format
                self.tool_format = self.own_format(tool_calls.template_format(source))
            self.thinks = reasoning.CLOSE in source  # a reasoning model's template (Qwen 3, DeepSeek-R1 style)

    def own_format(self, style: tool_calls.ToolFormat | None) -> tool_calls.ToolFormat | None:
        """``style`` with its marker as this tokenizer has it (a special token, or text)."""
        return style.with_marker_token(self.special_tokens) if style is not None else None

    def skipped_ids(self, reads_calls: tool_calls.ToolFormat | None) -> frozenset[int] | None:
        """The special tokens an output's text leaves out while its calls are read in
        ``reads_calls`` (None: all of them, as ``skip_special_tokens`` does): all but the
        format's marker, where that is one."""
        if reads_calls is None or reads_calls.marker_token is None:
            return None
        return frozenset(self.special_tokens.values()) - {reads_calls.marker_token}

    @property
    def backend(self) -> Tokenizer:
        """The ``tokenizers`` tokenizer, for incremental detokenization."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s tokens. Through ``encode_batch``, which lets go of the GIL while it works
        (``encode`` holds it throughout): a long prompt tokenized off the event loop would
        otherwise still stop the loop, and every other stream, for as long as it takes (about
        a second for a 1 MiB prompt)."""
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(self, messages: list[dict], tools: list[tool_calls.Tool] | None = None, template_kwargs: dict | None = None) -> list[int]:
        return self.encode_chat_text(self.render_chat(messages, tools, template_kwargs))

    def encode_chat_text(self, text: str) -> list[int]:
        """A rendered conversation's tokens (the template wrote its special tokens)."""
        return self.encode(text, add_special_tokens=False)

    def render_chat(
        self, messages: list[dict], tools: list[tool_calls.Tool] | None = None, template_kwargs: dict | None = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
    ) -> str:
        """A conversation rendered by the chat template, with ``tools`` where given: passed to a
        template that renders tools, written into the messages (``tool_calls.hermes_messages``)
        for one that does not. ``template_kwargs``: the request's own template variables;
        ``add_generation_prompt``: the assistant's turn opened after the messages;
        ``continue_final_message``: the text cut after the last message's, so that the output
        goes on from it (``continued``)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        has_tool_turns = any(message.get("tool_calls") or message["role"] == "tool" for message in messages)
        variables = dict(template_kwargs or {})
        if self.renders_tools:
            if tools:
                variables["tools"] = [tool.template_dict() for tool in tools]
        elif tools or has_tool_turns:
            messages = tool_calls.hermes_messages(messages, tools or [])
        try:
            text = self._template.render(**variables | {"messages": messages, "add_generation_prompt": add_generation_prompt} | self._special)
        except (TemplateError, TypeError, ValueError) as error:  # a template's own error, or a value it cannot take
            raise ChatTemplateError(f"the chat template rejected the conversation: {error}") from error
        return continued(text, messages[-1]["content"]) if continue_final_message else text

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, token_ids: list[int]) -> str | None:
        """The tokens' text, special tokens included (None where one is not a token id)."""
        vocab_size = self.vocab_size
        if not all(0 <= token_id < vocab_size for token_id in token_ids):
            return None
        return self._tokenizer.decode_batch([token_ids], skip_special_tokens=False)[0]  # lets go of the GIL, as encode

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def grammar_tokenizer(self):
        """llguidance's view of the same tokenizer, to check constraints against its tokens
        (about 0.25 s to build, holding the GIL: built with this tokenizer, before the router serves)."""
        if self._grammar_tokenizer is None:
            import llguidance

            eos = self._special["eos_token"]
            eos_id = None if eos is None else self._tokenizer.token_to_id(eos)
            self._grammar_tokenizer = llguidance.LLTokenizer(self._tokenizer_json.read_text(), eos_token=eos_id)
        return self._grammar_tokenizer


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def continued(text: str, final: str) -> str:
    """A rendered conversation cut right after its last message's text ``final`` (transformers'
    ``continue_final_message``): what the template closes the turn with is dropped. A template
    that strips the message's trailing spaces is cut after its stripped text."""
    stripped = final.strip()
    if not stripped:
        raise ChatTemplateError("continue_final_message goes on from the last message's text, and it has none")
    if stripped not in text:
        raise ChatTemplateError("continue_final_message: the last message's text does not appear in the rendered conversation")
    start = text.rindex(stripped)
    kept = final.lstrip()
    end = start + (len(kept) if text[start : start + len(kept)] == kept else len(stripped))
    return text[:end]
