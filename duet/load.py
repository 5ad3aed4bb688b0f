"""What an engine measures of its own load, for the router's stage balancing and the pools'
autoscaling: how fast it computes prompts (a capacity: a moving average kept while idle), and,
over the last ``WINDOW_S`` seconds, how long its decode steps took (the steps that gave
decoding sequences their next tokens, whatever else they computed: each one's wait per step), how long its requests waited for their first token, and how many
output tokens it produced per second. A window with nothing in it reads 0: an idle replica has
no latency to report.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 5.0
_WEIGHT = 0.2  # of the newest sample in the prompt throughput's moving average
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


class LoadTracker:
    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self._decode_steps = _Window()
        self._first_tokens = _Window()
        self._outputs = _Window()

    def observe_step(self, num_prompt_tokens: int, num_decoding: int, num_output_tokens: int, seconds: float) -> None:
        """One step: prompt tokens it computed (chunks of prompts, recomputed contexts), sequences
        it gave their next token(s) (their drafts verified), tokens it sampled, its time."""
        if seconds <= 0:
            return
        if num_prompt_tokens >= _PROMPT_STEP_TOKENS:
            # Beside whatever decoded in the same step: the speed prompts get on this replica.
            sample = num_prompt_tokens / seconds
            self.prefill_tokens_per_s = sample if self.prefill_tokens_per_s == 0 else self.prefill_tokens_per_s + _WEIGHT * (
                sample - self.prefill_tokens_per_s
            )
        if num_decoding:
            self._decode_steps.add(seconds)  # what each decoding sequence waited, prompt chunks included
        self._outputs.add(num_output_tokens)

    def observe_first_token(self, seconds: float) -> None:
        """A request's wait from arrival at this engine to its first token computed here."""
        self._first_tokens.add(seconds)

    @property
    def decode_step_s(self) -> float:
        return self._decode_steps.mean()

    @property
    def ttft_s(self) -> float:
        return self._first_tokens.mean()

    @property
    def output_tokens_per_s(self) -> float:
        return self._outputs.rate()
