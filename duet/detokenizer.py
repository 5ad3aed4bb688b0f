"""Token ids to text, incrementally, with stop strings: where text is made (the router, the
offline ``LLM``), never in the engines. Needs only the ``tokenizers`` library, not torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from duet.messages import TokenDelta
from duet.sampling_params import SamplingParams

# Tokens a character cut across tokens may take to complete (UTF-8 has at most 4 bytes, each
# token at least one); text still ending in U+FFFD after more is the text's own.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns one sequence's tokens into text as they arrive, and spots stop strings.

    Each new token's text is the decode of a short window of recent tokens minus the decode
    of the window before it (as vLLM does), held while it ends in U+FFFD (a character whose
    bytes are still arriving) for at most ``MAX_HELD_TOKENS``; ``finish()`` flushes what is
    held, so the whole text is the tokenizer's decode of the kept tokens. ``take_text()`` hands
    out the text that is safe to show: it holds back a tail that could still turn out to be
    the start of a stop string. Every step costs the window and that tail, never the text so
    far: the text is joined once, when read (``text``).

    As in vLLM, a stop string counts only where it ends in the text of a token past the first
    ``min_tokens`` (it may begin before).
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...], include_stop_str_in_output: bool, skip_special_tokens: bool,
        skipped_ids: frozenset[int] | None = None, min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids = skipped_ids if skip_special_tokens else None  # which special tokens to skip, where not all
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0  # the window: ids[prefix_offset:], its text out up to read_offset
        self._prefix_text = ""  # the decode of ids[prefix_offset:read_offset]
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self._stops_ending_in: dict[str, list[str]] = {}
        for string in stop:
            self._stops_ending_in.setdefault(string[-1], []).append(string)
        self._parts: list[str] = []
        self._length = 0
        self._unsent = ""  # the text's end not handed out yet (the hold-back, and what came since)
        self.num_tokens = 0
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything decoded so far (cut at a stop string once one is found)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears in the text. Tokens after
        the one that completed it (several arrive at once under speculation) are not taken:
        ``num_tokens`` counts the tokens the output keeps."""
        for token_id in token_ids:
            self.num_tokens += 1
            self._ids.append(token_id)
            if self._append(self._next_piece(final=False)):
                return self.stop_string
        return None

    def finish(self) -> str | None:
        """The sequence ended: add the text its last tokens held back (a character cut short
        decodes to U+FFFD, as in the whole decode); return a stop string it completes."""
        if self.stop_string is None and self._append(self._next_piece(final=True)):
            return self.stop_string
        return None

    def _decode(self, ids: list[int]) -> str:
        if self._skipped_ids is not None:
            return self._tokenizer.decode([i for i in ids if i not in self._skipped_ids], skip_special_tokens=False)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _next_piece(self, final: bool) -> str:
        ids = self._ids
        new_text = self._decode(ids[self._prefix_offset :])
        held = len(ids) - self._read_offset
        if len(new_text) <= len(self._prefix_text):
            if held > MAX_HELD_TOKENS:  # tokens without text (special ones, skipped): the window moves past them
                self._slide()
            return ""
        if new_text.endswith("\ufffd") and held <= MAX_HELD_TOKENS and not final:
            return ""
        piece = new_text[len(self._prefix_text) :]
        self._slide()
        return piece

    def _slide(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])

    def _append(self, piece: str) -> bool:
        """Add a piece of text; True if it completes a stop string (the text then ends there)."""
        if not piece:
            return False
        window = self._unsent[-self._hold_back :] if self._hold_back else ""  # where a stop could have begun
        window_start = self._length - len(window)
        window += piece
        self._parts.append(piece)
        self._length += len(piece)
        self._unsent += piece
        if not self._stop or self.num_tokens <= self._min_tokens:
            return False
        # A stop string not found before ends in the new piece: check only those end positions,
        # and at each only the stops ending in its character (a search over the whole window
        # costs its length times each stop's in the worst case: 64 adversarial stops of 1,024
        # characters made that ~3 ms a token).
        found = None
        for end in range(len(window) - len(piece) + 1, len(window) + 1):
            for stop in self._stops_ending_in.get(window[end - 1], ()):
                if window.endswith(stop, 0, end) and (found is None or (end - len(stop), stop) < found):
                    found = (end - len(stop), stop)
        if found is None:
            return False
        index, stop = found
        end = window_start + index + (len(stop) if self._include_stop else 0)
        self.stop_string = stop
        self._unsent = self._unsent[: len(self._unsent) - (self._length - end)]
        self._parts, self._length = [self.text[:end]], end
        return True

    def take_text(self, finished: bool) -> str:
        """The text safe to show that was not handed out before."""
        keep = 0 if finished or not self._stop or self.stop_string is not None else self._hold_back
        cut = max(0, len(self._unsent) - keep)
        taken, self._unsent = self._unsent[:cut], self._unsent[cut:]
        return taken


@dataclass
class TextDelta:
    """What a sequence adds to its client's output: text safe to show, the tokens kept (none past
    a stop string), their logprobs, and how the sequence ended (once it has)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first delta, where asked for


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
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def start(cls, tokenizer: Tokenizer, params: SamplingParams, skipped_ids: frozenset[int] | None = None) -> SequenceText:
        """``skipped_ids``: the special tokens that ``skip_special_tokens`` leaves out, where not
        all (a tool-call format's marker token is kept)."""
        detokenizer = IncrementalDetokenizer(
            tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens, skipped_ids, params.min_tokens
        )
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
        if stop is None and delta.finish_reason is not None:
            stop = self.detokenizer.finish()
        if stop is not None:
            self.finish_reason, self.stop_reason = "stop", stop
        elif delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return TextDelta(
            self.detokenizer.take_text(self.finished), kept, logprobs, self.finish_reason, self.stop_reason, delta.prompt_logprobs
        )
