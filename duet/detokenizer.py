"""Incremental detokenization and stop strings."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


def hold_back_stop_prefix(text: str, stop: tuple[str, ...]) -> str:
    """The part of ``text`` safe to show while the request goes on: a tail that could still
    turn out to be the start of a stop string is held back."""
    hold_back = max((len(s) for s in stop), default=1) - 1
    return text[: max(0, len(text) - hold_back)]


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive, and spots stop strings.

    ``text`` is everything decoded so far (cut at a stop string once one is found).
    ``stream_text()`` is the part that is safe to show now: it holds back a tail that
    could still turn out to be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], include_stop_str_in_output: bool, skip_special_tokens: bool):
        self._backend = tokenizer.backend_tokenizer
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
            piece = self._stream.step(self._backend, token_id)
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
        return hold_back_stop_prefix(self.text, self._stop)
