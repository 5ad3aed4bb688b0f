"""What an engine measures of its own load, for the router's stage balancing and the pools'
autoscaling: how fast it computes prompts, two ways (capacities: moving averages kept while
idle) — the prompt tokens per second of the steps that computed prompts (how soon a prompt is
done here) and all the tokens per second of those steps (what a prompt's tokens cost here: a
token costs about the same whether it is a prompt's or a decoding sequence's beside it) — and,
over the last ``WINDOW_S`` seconds, its time per output token (TPOT: of the steps that gave
decoding sequences their next tokens, whatever else they computed, each step's time over the
tokens a decoding sequence got from it: one, or more when drafts were accepted), the same for
the steps that computed no prompt beside them (the decode work alone: the last one seen when the
window has none), how long its requests waited for their first token, and how many output
tokens it produced per second. A window with nothing in it reads 0: an idle replica has no
latency to report.
"""

from __future__ import annotations

import time
from collections import deque

from duet.messages import LoadStats

WINDOW_S = 5.0
_WEIGHT = 0.2  # of the newest sample in a moving average (prompt throughput, the cores' step times)
# A step computing at least this many prompt tokens measures prompt throughput.
_PROMPT_STEP_TOKENS = 32


class _Window:
    """Timestamped samples of the last ``WINDOW_S`` seconds. Written by the engine thread (which
    alone trims), read from others through a snapshot."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> None:
        now = time.monotonic()
        self.samples.append((now, value))
        while now - self.samples[0][0] > WINDOW_S:
            self.samples.popleft()

    def _recent(self) -> list[float]:
        since = time.monotonic() - WINDOW_S
        return [value for at, value in list(self.samples) if at >= since]

    def mean(self) -> float:
        recent = self._recent()
        return sum(recent) / len(recent) if recent else 0.0

    def rate(self) -> float:
        """Sum of the samples per second of the window."""
        return sum(self._recent()) / WINDOW_S


def moving_average(average: float, sample: float) -> float:
    """The running mean with ``sample`` in (the first sample is the mean)."""
    return sample if average == 0 else average + _WEIGHT * (sample - average)


class LoadTracker:
    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self.tokens_per_s = 0.0
        self._tpot = _Window()
        self._decode_only_tpot = _Window()
        self._last_decode_only_tpot_s = 0.0
        self._first_tokens = _Window()
        self._outputs = _Window()

    def observe_step(
        self, num_prompt_tokens: int, num_tokens: int, num_decoding: int, num_decode_outputs: int, num_output_tokens: int, seconds: float
    ) -> None:
        """One step: prompt tokens it computed (chunks of prompts, recomputed contexts) of all the
        tokens it computed, sequences it gave their next token(s) (their drafts verified) and the
        tokens they got, all the tokens it sampled, its time."""
        if seconds <= 0:
            return
        if num_prompt_tokens >= _PROMPT_STEP_TOKENS:
            self.prefill_tokens_per_s = moving_average(self.prefill_tokens_per_s, num_prompt_tokens / seconds)
            self.tokens_per_s = moving_average(self.tokens_per_s, num_tokens / seconds)
        if num_decoding and num_decode_outputs:
            per_token = seconds * num_decoding / num_decode_outputs  # prompt chunks included: the sequences waited
            self._tpot.add(per_token)
            if num_prompt_tokens < _PROMPT_STEP_TOKENS:
                self._decode_only_tpot.add(per_token)
                self._last_decode_only_tpot_s = per_token
        self._outputs.add(num_output_tokens)

    def observe_first_token(self, seconds: float) -> None:
        """A request's wait from arrival at this engine to its first token computed here."""
        self._first_tokens.add(seconds)

    @property
    def tpot_s(self) -> float:
        return self._tpot.mean()

    @property
    def decode_only_tpot_s(self) -> float:
        return self._decode_only_tpot.mean() or self._last_decode_only_tpot_s

    @property
    def ttft_s(self) -> float:
        return self._first_tokens.mean()

    @property
    def output_tokens_per_s(self) -> float:
        return self._outputs.rate()

    def stats(self) -> LoadStats:
        return LoadStats(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tokens_per_s=self.tokens_per_s,
            tpot_s=self.tpot_s,
            decode_only_tpot_s=self.decode_only_tpot_s,
            ttft_s=self.ttft_s,
            output_tokens_per_s=self.output_tokens_per_s,
        )
