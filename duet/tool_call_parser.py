"""Reading tool calls out of a model's output, whole or as it streams, in the format the model
writes them (``duet.tool_calls.ToolFormat``): the content around them, and each call's id, name
and argument text as OpenAI's clients read them. Importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from duet.tool_calls import HERMES, ToolFormat


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
    """Reads content and calls out of an output given piece by piece (``feed``), in ``style``'s
    format. Text that may be the start of a call is held back until it is known not to be.
    Output the grammar would not produce (a call cut off by ``max_tokens`` or a stop string
    aside) is kept as content from where it departs from the format."""

    def __init__(self, style: ToolFormat = HERMES) -> None:
        self.style = style
        self.calls: list[ToolCall] = []
        self._pending = ""
        self._state = "text" if style.text_first else "start"  # start, plain, text, name, arguments, end, between
        self._marker = ""  # the text that opened the call being read
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """The content and call pieces ``text`` completes; ``final``: the output ends here."""
        self._pending += text
        content: list[str] = []
        deltas: dict[int, CallDelta] = {}
        while self._step(content, deltas, final):
            pass
        if final:  # what is left was not a whole call: content (a cut call's end aside)
            if self._state != "end":
                content.append((self._marker if self._state == "name" else "") + self._pending)
            self._pending = ""
        return "".join(content), list(deltas.values())

    @property
    def finished_calls(self) -> list[ToolCall]:
        return [call for call in self.calls if call.complete]

    def _step(self, content: list[str], deltas: dict[int, CallDelta], final: bool) -> bool:
        """Advance through the pending text; False once it needs more."""
        style, pending = self.style, self._pending
        if self._state == "start":  # calls only from the first character, or none
            marker = style.opener + style.name_prefix
            if marker.startswith(pending) and not final:
                return False
            self._state = "plain"
            if pending.startswith(marker):
                self._pending, self._state, self._marker = pending[len(marker):], "name", marker
            return True
        if self._state == "plain":
            content.append(pending)
            self._pending = ""
            return False
        if self._state == "between" and style.calls_end and pending.startswith(style.calls_end):
            self._pending, self._state = pending[len(style.calls_end):], "text"  # the list of calls closed
            return True
        if self._state in ("text", "between"):
            marker = (style.opener if self._state == "text" else style.separator) + style.name_prefix
            at = pending.find(marker)
            if at >= 0:
                content.append(pending[:at])
                self._pending, self._state, self._marker = pending[at + len(marker):], "name", marker
                return True
            keep = 0 if final else partial_suffix(pending, marker)
            content.append(pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep:]
            return False
        if self._state == "name":
            end = pending.find('"')
            if end < 0 or len(pending) < end + len(style.arguments_prefix):
                return False
            if not pending.startswith(style.arguments_prefix, end):
                return self._depart(content, self._marker)
            call = ToolCall(len(self.calls), style.new_call_id(), pending[:end])
            self.calls.append(call)
            deltas[call.index] = CallDelta(call.index, "", call.id, call.name)
            self._pending, self._state = pending[end + len(style.arguments_prefix):], "arguments"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._state == "arguments":
            return self._scan_arguments(content, deltas)
        if self._state == "end":
            if not self._expect("}" + style.call_end, "between", content):
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

    def _expect(self, prefix: str, state: str, content: list[str]) -> bool:
        pending = self._pending
        if prefix.startswith(pending) and len(pending) < len(prefix):
            return False
        if not pending.startswith(prefix):
            return self._depart(content, "")
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


def parse_output(text: str, style: ToolFormat = HERMES) -> tuple[str | None, list[ToolCall]]:
    """An output's content (None where there is none) and its whole calls."""
    parser = ToolCallParser(style)
    content, _ = parser.feed(text, final=True)
    return (content or None), parser.finished_calls
