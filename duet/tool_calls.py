"""Tool calls (OpenAI's ``tools``): the formats models write calls in, the grammar that makes
every call valid by construction, and the messages that carry tools to a chat template
(``duet.tool_call_parser`` reads the calls back out of the output).

Three formats, each as its models are trained to write it (``ToolFormat``):

- ``hermes`` (Qwen 2.5/3, Hermes; and the one duet writes into templates that render no tools):
  optional text, then calls, one after another::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1-3.3): the whole output is text, or calls from its first character,
  separated by ``"; "``: ``{"name": "get_weather", "parameters": {"city": "Paris"}}``.
- ``mistral`` (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo and Small): optional text, then the
  ``[TOOL_CALLS]`` token and the calls as one JSON list, each call's id 9 letters or digits::

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Where a format's marker (``<tool_call>``, ``[TOOL_CALLS]``) is a special token of the model's
tokenizer, the grammar names that token (``<[id]>``) and the output's text keeps it
(``ToolFormat.marker_token``), since text alone neither produces nor shows a special token.

The grammar (``tool_grammar``) lets the model write text until it opens a call (``auto``), or
opens one at once (``required``, a named function); from there on the call is one of the tools'
JSON schemas, name first, in compact JSON; after the last call the output ends. Importable
without torch: the router builds the grammar and parses the text.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field, replace

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
_ID_CHARACTERS = string.ascii_letters + string.digits
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes its calls: ``opener`` before the first (it begins with the
    ``marker`` word), ``separator`` between two, ``call_end`` after each call's JSON object,
    ``calls_end`` after the last, and the key its arguments go under. With ``text_first``, text
    may come before the calls; without, the output is text or calls from its first character
    (and text never starts like a call). ``marker_token``: the marker's id where the model's
    tokenizer has it as a special token (``with_marker_token``); ``short_ids``: call ids are 9
    letters or digits, as Mistral's templates demand."""

    name: str
    opener: str
    separator: str
    call_end: str
    arguments_key: str
    text_first: bool
    marker: str = ""
    calls_end: str = ""
    short_ids: bool = False
    marker_token: int | None = None
    name_prefix: str = '{"name": "'

    @property
    def arguments_prefix(self) -> str:
        return f'", "{self.arguments_key}": '

    def with_marker_token(self, special_tokens: dict[str, int]) -> ToolFormat:
        """The format for a tokenizer whose special tokens (text to id) are ``special_tokens``."""
        token = special_tokens.get(self.marker) if self.marker else None
        return self if token == self.marker_token else replace(self, marker_token=token)

    def new_call_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


HERMES = ToolFormat("hermes", OPEN + "\n", "\n" + OPEN + "\n", "\n" + CLOSE, "arguments", text_first=True, marker=OPEN)
LLAMA3_JSON = ToolFormat("llama3_json", "", "; ", "", "parameters", text_first=False)
MISTRAL = ToolFormat(
    "mistral", MISTRAL_MARKER + " [", ", ", "", "arguments", text_first=True, marker=MISTRAL_MARKER, calls_end="]", short_ids=True,
)
FORMATS = {style.name: style for style in (HERMES, LLAMA3_JSON, MISTRAL)}


def template_format(source: str) -> ToolFormat | None:
    """The format a chat template that renders tools writes calls in (None: one duet does not read)."""
    if OPEN in source:
        return HERMES
    if MISTRAL_MARKER in source:
        return MISTRAL
    if "<|python_tag|>" in source or '"parameters": ' in source:
        return LLAMA3_JSON
    return None


SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str | None = None

    def template_dict(self) -> dict:
        """The tool as chat templates take it (transformers' ``tools=`` argument)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def call_schema(tool: Tool, style: ToolFormat = HERMES) -> dict:
    """The JSON schema of one call of ``tool``: its name, then arguments that fit its schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, style.arguments_key: tool.parameters},
        "required": ["name", style.arguments_key],
        "additionalProperties": False,
    }


def tool_grammar(tools: list[Tool], choice: str, parallel: bool, style: ToolFormat = HERMES) -> str:
    """The llguidance (Lark) grammar of an output under ``choice``: ``auto`` (text, or calls
    where the format allows them), ``required`` (calls only) or a tool's name (one call of it).
    ``parallel``: more than one call may follow each other."""
    if choice not in ("auto", "required"):
        tools, parallel = [tool for tool in tools if tool.name == choice], False
    schemas = [call_schema(tool, style) for tool in tools]
    schema = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": JSON_STYLE}
    calls = f"call ({json.dumps(style.separator)} call)*" if parallel else "call"
    if style.calls_end:
        calls += f" {json.dumps(style.calls_end)}"
    call = f"call: %json {json.dumps(schema)}" + (f" {json.dumps(style.call_end)}" if style.call_end else "")
    if not style.text_first:
        start = "TEXT | calls" if choice == "auto" else "calls"
        text = ["TEXT: /([^{](?s:.*))?/"]  # text never starts as a call does
    else:
        rest = style.opener[len(style.marker):]
        tail = (f"{json.dumps(rest)} " if rest else "") + "calls"  # after the marker
        if style.marker_token is not None:  # text cannot hold a special token: any text may precede it
            mark = f"<[{style.marker_token}]>"
            start = f"TEXT | TEXT? {mark} {tail}" if choice == "auto" else f"{mark} {tail}"
            text = ["TEXT: /(?s:.+)/"]
        else:
            marker = re.escape(style.marker)
            start = f"TEXT | calls_head {tail}" if choice == "auto" else f"{json.dumps(style.marker)} {tail}"
            text = [
                # Text that never opens a call (the lexer then takes the lazy head, which ends at the first one).
                f"TEXT: /(?s:.*)/ & ~/(?s:.*{marker}(?s:.*))/",
                f"calls_head[lazy]: /(?s:.*){marker}/",
            ]
    return "\n".join([f"start: {start}", *text, f"calls: {calls}", call])


def system_prompt(tools: list[Tool]) -> str:
    return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(tool.template_dict(), ensure_ascii=False) for tool in tools))


def call_text(name: str, arguments) -> str:
    """A call as the model writes it (``arguments``: a dict, or the JSON text of one)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def hermes_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """A conversation with tools for a chat template that knows only roles and text: the tools
    described in the system message, an assistant's calls written into its content, and tool
    results as a user turn of ``<tool_response>`` blocks (consecutive results in one turn)."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [call_text(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_results", None)
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def short_call_ids(messages: list[dict]) -> list[dict]:
    """The conversation with each call id that is not 9 letters or digits (another server's, or
    the client's own) replaced by 9 that are, the same for a call and the result that answers
    it: Mistral's templates refuse any other id."""

    def short(call_id: str) -> str:
        if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
            return call_id
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        return "".join(_ID_CHARACTERS[(digest >> (6 * place)) % len(_ID_CHARACTERS)] for place in range(9))

    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [call | {"id": short(call["id"])} for call in message["tool_calls"]]
        if message.get("tool_call_id") is not None:
            message["tool_call_id"] = short(message["tool_call_id"])
        out.append(message)
    return out
