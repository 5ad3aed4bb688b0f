"""Tool calls (OpenAI's ``tools``) in the Hermes format: the grammar that makes every call valid
by construction, the messages that carry tools to a chat template without tool support, and
the parser that reads calls out of the output, whole or as it streams.

The format is the one Qwen 2.5/3 and Hermes models are trained on, and the one duet writes into
templates that do not render tools: optional text, then calls, one after another::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar (``tool_grammar``) lets the model write text until it opens a call (``auto``), or
opens one at once (``required``, a named function); from ``<tool_call>`` on, the call is one of
the tools' JSON schemas, name first, in compact JSON; after the last call the output ends.
Importable without torch: the router builds the grammar and parses the text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# What follows OPEN, up to the name, and what follows the name, up to the arguments: the
# grammar's compact JSON with ", " and ": " (structured_output.JSON_OPTIONS).
_NAME_PREFIX, _ARGUMENTS_PREFIX = '\n{"name": "', '", "arguments": '
_CALL_END = "}\n" + CLOSE
_NEXT_CALL = "\n" + OPEN
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

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


def call_schema(tool: Tool) -> dict:
    """The JSON schema of one call of ``tool``: its name, then arguments that fit its schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_grammar(tools: list[Tool], choice: str, parallel: bool) -> str:
    """The llguidance (Lark) grammar of an output under ``choice``: ``auto`` (text, or text then
    calls), ``required`` (calls only) or a tool's name (one call of it). ``parallel``: more than
    one call may follow each other."""
    if choice not in ("auto", "required"):
        tools, parallel = [tool for tool in tools if tool.name == choice], False
    schemas = [call_schema(tool) for tool in tools]
    schema = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": JSON_STYLE}
    calls = 'call ("\\n<tool_call>" call)*' if parallel else "call"
    start = "TEXT | head calls" if choice == "auto" else '"<tool_call>" calls'
    return "\n".join([
        f"start: {start}",
        # Text that never opens a call (the lexer then takes the lazy head, which ends at the first one).
        "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>(?s:.*))/",
        "head[lazy]: /(?s:.*)<tool_call>/",
        f"calls: {calls}",
        f'call: "\\n" %json {json.dumps(schema)} "\\n</tool_call>"',
    ])


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


@dataclass
class ToolCall:
    """A call read from the output: ``arguments`` as the model wrote them (JSON text)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """What one piece of output added to a call: its start (``id`` and ``name``) and argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Reads content and calls out of an output given piece by piece (``feed``). Text that may
    be the start of ``<tool_call>`` is held back until it is known not to be. Output the grammar
    would not produce (a call cut off by ``max_tokens`` or a stop string aside) is kept as
    content from where it departs from the format."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._pending = ""
        self._state = "text"  # text, head, name, arguments, end, between
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """The content and call pieces ``text`` completes; ``final``: the output ends here."""
        self._pending += text
        content: list[str] = []
        deltas: dict[int, CallDelta] = {}
        while self._step(content, deltas, final):
            pass
        if final:  # what is left was not a whole call: content (a cut call's close aside)
            restore = {"head": OPEN, "name": OPEN + _NAME_PREFIX}.get(self._state, "")
            if self._state != "end":
                content.append(restore + self._pending)
            self._pending = ""
        return "".join(content), list(deltas.values())

    @property
    def finished_calls(self) -> list[ToolCall]:
        return [call for call in self.calls if call.complete]

    def _step(self, content: list[str], deltas: dict[int, CallDelta], final: bool) -> bool:
        """Advance through the pending text; False once it needs more."""
        pending = self._pending
        if self._state in ("text", "between"):
            marker = OPEN if self._state == "text" else _NEXT_CALL
            at = pending.find(marker)
            if at >= 0:
                content.append(pending[:at])
                self._pending, self._state = pending[at + len(marker):], "head"
                return True
            keep = 0 if final else partial_suffix(pending, marker)
            content.append(pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep:]
            return False
        if self._state == "head":
            return self._expect(_NAME_PREFIX, "name", content, restore=OPEN)
        if self._state == "name":
            end = pending.find('"')
            if end < 0 or len(pending) < end + len(_ARGUMENTS_PREFIX):
                return False
            if not pending.startswith(_ARGUMENTS_PREFIX, end):
                return self._depart(content, OPEN + _NAME_PREFIX)
            call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", pending[:end])
            self.calls.append(call)
            deltas[call.index] = CallDelta(call.index, "", call.id, call.name)
            self._pending, self._state = pending[end + len(_ARGUMENTS_PREFIX):], "arguments"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._state == "arguments":
            return self._scan_arguments(content, deltas)
        if self._state == "end":
            if not self._expect(_CALL_END, "between", content, restore=""):
                return False
            self.calls[-1].complete = True
            return True
        return False

    def _scan_arguments(self, content: list[str], deltas: dict[int, CallDelta]) -> bool:
        """Take argument text up to the end of its object (strings and nesting followed)."""
        call, pending = self.calls[-1], self._pending
        if not pending:
            return False
        if not call.arguments and pending[0] != "{":
            return self._depart(content, "")
        taken, done = 0, False
        for char in pending:
            taken += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done = True
                    break
        call.arguments += pending[:taken]
        deltas.setdefault(call.index, CallDelta(call.index, "")).arguments += pending[:taken]
        self._pending = pending[taken:]
        if done:
            self._state = "end"
        return done

    def _expect(self, prefix: str, state: str, content: list[str], restore: str) -> bool:
        pending = self._pending
        if len(pending) < len(prefix):
            if prefix.startswith(pending):
                return False
            return self._depart(content, restore)
        if not pending.startswith(prefix):
            return self._depart(content, restore)
        self._pending, self._state = pending[len(prefix):], state
        return True

    def _depart(self, content: list[str], restore: str) -> bool:
        """The output left the format (never under the grammar): what remains is content."""
        content.append(restore + self._pending)
        self._pending, self._state = "", "text"
        return False


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (text to hold back while
    it may yet become the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_output(text: str) -> tuple[str | None, list[ToolCall]]:
    """An output's content (None where there is none) and its whole calls."""
    parser = ToolCallParser()
    content, _ = parser.feed(text, final=True)
    return (content or None), parser.finished_calls
