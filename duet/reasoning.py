"""Reasoning output (``<think>...</think>``, as Qwen 3 and DeepSeek-R1 style templates write it):
where an output starts, the splitter that parts reasoning from content (whole or as it
streams), and the grammar that applies a constraint only once the reasoning has ended.

An output starts ``inside`` its reasoning when the prompt opened it (the template ends the
generation prompt with ``<think>``), has none when the prompt closed it (Qwen 3 with
``enable_thinking: false`` renders an empty ``<think></think>``), and may open it otherwise
(``optional``). Importable without torch.
"""

from __future__ import annotations

import functools
import json

from duet.tool_call_parser import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
INSIDE, OPTIONAL = "inside", "optional"
MODES = (INSIDE, OPTIONAL)


def start_mode(prompt_text: str) -> str | None:
    """How an output that follows ``prompt_text`` starts: ``inside``, ``optional``, or None (the
    prompt closed the reasoning: the output is content)."""
    opened, closed = prompt_text.rfind(OPEN), prompt_text.rfind(CLOSE)
    if opened > closed:
        return INSIDE
    if closed >= 0 and not prompt_text[closed + len(CLOSE):].strip(" \n"):
        return None
    return OPTIONAL


@functools.lru_cache(maxsize=256)
def after_reasoning(grammar: str, mode: str) -> str:
    """``grammar`` (llguidance's, as ``structured_output.compiled_grammar`` makes it: a JSON
    list of grammars or Lark text) applied after the reasoning: any text up to ``</think>``
    (opened by the prompt, or by the output itself or not at all), whitespace, then the grammar."""
    inner = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    grammars = inner["grammars"]
    constrained = dict(grammars[0]) | {"name": "constrained"}
    start = "start: think WS @constrained" if mode == INSIDE else 'start: "<think>" think WS @constrained | @constrained'
    wrapper = "\n".join([start, "think[lazy]: /(?s:.*)<\\/think>/", "WS: /[ \\t\\r\\n]*/"])
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, constrained, *grammars[1:]], "max_tokens": inner.get("max_tokens")})


class ReasoningSplitter:
    """Parts an output given piece by piece (``feed``) into reasoning and content; text that may
    be the start of a tag is held back until it is known."""

    def __init__(self, mode: str) -> None:
        self._state = "reasoning" if mode == INSIDE else "start"
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content ``text`` completes; ``final``: the output ends here."""
        self._pending += text
        reasoning = content = ""
        if self._state == "start":
            if self._pending.startswith(OPEN):
                self._pending, self._state = self._pending[len(OPEN):], "reasoning"
            elif OPEN.startswith(self._pending) and not final:
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._pending.find(CLOSE)
            if at >= 0:
                reasoning, self._pending, self._state = self._pending[:at], self._pending[at + len(CLOSE):], "content"
            else:
                keep = 0 if final else partial_suffix(self._pending, CLOSE)
                reasoning, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
                return reasoning, ""
        content, self._pending = self._pending, ""
        return reasoning, content


def count_reasoning_tokens(pieces: list[str], mode: str) -> int:
    """How many of an output's tokens (``pieces``: each token's text, in order) are its
    reasoning's, as ``ReasoningSplitter`` parts the text: the tokens that end inside it. The
    tags' own tokens are not counted (as vLLM counts them); an output cut off while reasoning
    is reasoning to its end."""
    text = "".join(pieces)
    start = 0
    if mode != INSIDE:
        if not text.startswith(OPEN):
            return 0
        start = len(OPEN)
    close = text.find(CLOSE, start)
    end = len(text) if close < 0 else close
    count, offset = 0, 0
    for piece in pieces:
        offset += len(piece)
        if offset > end:
            break
        count += offset > start
    return count
