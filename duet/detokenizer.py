"""Token ids to text, incrementally, with stop strings: where text is made (the router, the
offline ``LLM``), never in the engines. Needs only the ``tokenizers`` library, not torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from duet.messages import TokenDelta
from duet.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns one sequence's tokens into text as they arrive, and spots stop strings.

    ``text`` is everything decoded so far (cut at a stop string once one is found).
    ``stream_text()`` is the part that is safe to show now: it holds back a tail that
    could still turn out to be the start of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], include_stop_str_in_output: bool, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_tokens = 0
        self.stop_string: str | None = None

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears in the text. Tokens after
        the one that completed it (several arrive at once under speculation) are not taken:
        ``num_tokens`` counts the tokens the output keeps."""
        for token_id in token_ids:
            self.num_tokens += 1
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self._hold_back)
            self.text += piece
            if self._stop and self._find_stop(search_from):
                return self.stop_string
        return None

    def _find_stop(self, search_from: int) -> bool:
        hits = [(self.text.find(stop, search_from), stop) for stop in self._stop]
        hits = [(index, stop) for index, stop in hits if index >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.stop_string = stop
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        return True

    def stream_text(self, finished: bool) -> str:
        if finished or not self._stop or self.stop_string is not None:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold_back)]


@dataclass
class TextDelta:
    """What a sequence adds to its client's output: text safe to show, the tokens kept (none past
    a stop string), their logprobs, and how the sequence ended (once it has)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class SequenceText:
    """One sequence's output as its engines' ``TokenDelta``s arrive (from a prefill replica,
    then a decode replica, or one engine). A stop string ends it; the caller then aborts the
    sequence in the engines, which know nothing of text."""

    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0

    @classmethod
    def start(cls, tokenizer: Tokenizer, params: SamplingParams) -> SequenceText:
        detokenizer = IncrementalDetokenizer(tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        return cls(detokenizer, logprobs=[] if params.logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def add(self, delta: TokenDelta) -> TextDelta:
        before = self.detokenizer.num_tokens
        stop = self.detokenizer.add_tokens(delta.token_ids)
        kept = delta.token_ids[: self.detokenizer.num_tokens - before]
        self.token_ids += kept
        logprobs = None
        if self.logprobs is not None:
            logprobs = (delta.logprobs or [])[: len(kept)]
            self.logprobs += logprobs
        if stop is not None:
            self.finish_reason, self.stop_reason = "stop", stop
        elif delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        text = self.detokenizer.stream_text(self.finished)
        new_text = text[self.num_sent_chars :]
        self.num_sent_chars = max(self.num_sent_chars, len(text))
        return TextDelta(new_text, kept, logprobs, self.finish_reason, self.stop_reason)
