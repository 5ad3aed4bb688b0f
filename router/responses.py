"""OpenAI response bodies and stream chunks, for completions and chat completions."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from duet.detokenizer import TextDelta
from duet.reasoning import ReasoningSplitter, count_reasoning_tokens
from duet.tool_call_parser import ToolCallParser
from duet.tool_calls import ToolFormat

MIN_LOGPROB = -9999.0


def error_body(message: str, error_type: str, param: str | None = None, code: int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass
class Choice:
    """What one sequence has produced so far."""

    index: int
    parts: list[str] = field(default_factory=list)  # its text, as it came (joined when read: no copy per delta)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (token id, top logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # where the request asked for them

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def add(self, delta: TextDelta) -> None:
        if delta.text:
            self.parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(zip(delta.token_ids, delta.logprobs))
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


def best_choices(choices: list[Choice], n: int, best_of: int) -> list[Choice]:
    """Of each prompt's ``best_of`` sequences (its consecutive run of choices), the ``n`` whose
    tokens have the highest total log-probability, numbered as ``n`` choices per prompt."""
    best = []
    for first in range(0, len(choices), best_of):
        group = choices[first:first + best_of]
        prompt_logprobs = next((choice.prompt_logprobs for choice in group if choice.prompt_logprobs is not None), None)
        ranked = sorted(group, key=lambda choice: -sum(top[token] for token, top in choice.logprobs))
        for rank, choice in enumerate(ranked[:n]):
            best.append(dataclasses.replace(choice, index=first // best_of * n + rank, prompt_logprobs=prompt_logprobs))
    return best


def _calls_finish(finish_reason: str | None) -> str | None:
    """A sequence that ended after its calls ended for them (OpenAI's ``tool_calls``); one cut
    off (``length``) or aborted says so."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ResponseBuilder:
    """Builds one request's bodies; ``chat`` picks the chat completion shapes."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        token_text: Callable[[int], str],
        want_logprobs: bool,
        want_token_ids: bool,
        reads_calls: ToolFormat | None = None,
        reasoning_mode: str | None = None,
        echo_prompts: list[tuple[str, list[int]]] | None = None,
        n: int = 1,
    ) -> None:
        # A completion's ``echo``: each prompt's text and tokens, before its ``n`` choices' own.
        self.echo_prompts = echo_prompts
        self.n = n
        self.reads_calls = reads_calls  # the format tool calls are read out of the text in (duet.tool_calls)
        self.reasoning_mode = reasoning_mode  # reasoning is parted from content (duet.reasoning)
        self._parsers: dict[int, ToolCallParser] = {}
        self._splitters: dict[int, ReasoningSplitter] = {}
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.want_token_ids = want_token_ids
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, num_prompt_tokens: int, choices: list[Choice], num_cached_tokens: int) -> dict:
        completion = sum(len(choice.token_ids) for choice in choices)
        usage = {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        }
        if self.chat and self.reasoning_mode:  # as vLLM reports them where it parts reasoning
            reasoning = sum(count_reasoning_tokens([self.token_text(token) for token in choice.token_ids], self.reasoning_mode) for choice in choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def response(self, choices: list[Choice], usage: dict) -> dict:
        # A prompt's logprobs come with its first sequence only (the others read the prompt from the cache).
        by_prompt = {choice.index // self.n: choice.prompt_logprobs for choice in choices if choice.prompt_logprobs is not None}
        body = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(choice, by_prompt.get(choice.index // self.n)) for choice in choices],
            "usage": usage,
        }
        if self.chat and by_prompt:  # vLLM's place for a chat's
            body["prompt_logprobs"] = self._prompt_logprobs(by_prompt[0])
        return body

    def _choice(self, choice: Choice, prompt_logprobs: list[dict[int, float] | None] | None = None) -> dict:
        body = {"index": choice.index, "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        entries = choice.logprobs
        if self.chat:
            body["message"], finish_reason = self._read(choice.index, choice.text, choice.finish_reason, whole=True)
            body["message"] = {"role": "assistant"} | body["message"]
            body["finish_reason"] = finish_reason
        else:
            body["text"] = choice.text
            if self.echo_prompts is not None:
                prompt_text, prompt_ids = self.echo_prompts[choice.index // self.n]
                body["text"] = prompt_text + choice.text
                entries = list(zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids))) + entries
            if prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(prompt_logprobs)
        body["logprobs"] = self._logprobs(entries, 0) if self.want_logprobs else None
        if self.want_token_ids:
            body["token_ids"] = choice.token_ids
        return body

    def carries_prompt(self, delta: TextDelta, first: bool) -> bool:
        """Whether ``chunk`` writes a prompt's tokens (an echo, or its logprobs): a detokenized
        token per prompt token and alternative."""
        return delta.prompt_logprobs is not None or (first and self.echo_prompts is not None)

    def chunk(self, index: int, delta: TextDelta, first: bool, text_offset: int) -> dict:
        choice = {"index": index, "finish_reason": delta.finish_reason}
        if self.chat:
            choice["delta"], choice["finish_reason"] = self._read(index, delta.text, delta.finish_reason, whole=False)
            if first:
                choice["delta"] = {"role": "assistant"} | choice["delta"]
        else:
            choice["text"] = delta.text
        entries = list(zip(delta.token_ids, delta.logprobs or []))
        if not self.chat and first and self.echo_prompts is not None:
            prompt_text, prompt_ids = self.echo_prompts[index // self.n]
            choice["text"] = prompt_text + delta.text
            entries = list(zip(prompt_ids, delta.prompt_logprobs or [None] * len(prompt_ids))) + entries
        if delta.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(delta.prompt_logprobs)
        if self.want_logprobs:
            choice["logprobs"] = self._logprobs(entries, text_offset)
        if self.want_token_ids:
            choice["token_ids"] = delta.token_ids
        return {
            "id": self.request_id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def _read(self, index: int, text: str, finish_reason: str | None, whole: bool) -> tuple[dict, str | None]:
        """A chat message's fields (``whole``), or a chunk's delta, from the output's text: its
        reasoning parted from its content, and its tool calls read out of the content, where the
        request has them; with the finish reason they make."""
        if not (self.reasoning_mode or self.reads_calls):
            return {"content": text}, finish_reason
        final = whole or finish_reason is not None
        fields, reasoning = {}, None
        if self.reasoning_mode:
            splitter = ReasoningSplitter(self.reasoning_mode) if whole else self._splitters.setdefault(index, ReasoningSplitter(self.reasoning_mode))
            reasoning, text = splitter.feed(text, final)
            if reasoning or whole:
                fields["reasoning_content"] = reasoning or None
        calls = []
        if self.reads_calls:
            parser = ToolCallParser(self.reads_calls) if whole else self._parsers.setdefault(index, ToolCallParser(self.reads_calls))
            text, deltas = parser.feed(text, final)
            calls = parser.finished_calls if whole else deltas
            if final and parser.finished_calls:
                finish_reason = _calls_finish(finish_reason)
        fields["content"] = text or (None if whole or reasoning or calls else "")
        if calls:
            fields["tool_calls"] = [call.to_dict() for call in calls]
        return fields, finish_reason

    def usage_chunk(self, usage: dict) -> dict:
        return {
            "id": self.request_id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }

    def _prompt_logprobs(self, entries: list[dict[int, float] | None]) -> list[dict | None]:
        """vLLM's shape: per prompt token, None for the first, else its top tokens by id."""
        return [
            None if top is None else {
                str(token_id): {"logprob": max(logprob, MIN_LOGPROB), "decoded_token": self.token_text(token_id)}
                for token_id, logprob in top.items()
            }
            for top in entries
        ]

    def _logprobs(self, entries: list[tuple[int, dict[int, float] | None]], text_offset: int) -> dict:
        """``entries``: (token id, its top logprobs; None for an echoed prompt's first token)."""
        # A token a constraint forbids has logprob -inf, which JSON cannot carry: -9999.0, as vLLM sends.
        entries = [
            (token_id, None if top is None else {other: max(logprob, MIN_LOGPROB) for other, logprob in top.items()})
            for token_id, top in entries
        ]
        if self.chat:
            return {"content": [self._chat_logprob(token_id, top) for token_id, top in entries]}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, top in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(None if top is None else top.get(token_id))
            top_logprobs.append(None if top is None else {self.token_text(other): logprob for other, logprob in top.items()})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}

    def _chat_logprob(self, token_id: int, top: dict[int, float]) -> dict:
        text = self.token_text(token_id)
        return {
            "token": text,
            "logprob": top.get(token_id),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": self.token_text(other), "logprob": logprob, "bytes": list(self.token_text(other).encode())}
                for other, logprob in sorted(top.items(), key=lambda item: -item[1])
            ],
        }
