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
from collections.abc import Callable

from duet.messages import LoadStats
from duet.outputs import RunnerOutput, SchedulerOutput

WINDOW_S = 5.0
_WEIGHT = 0.2  # of the newest sample in a moving average (prompt throughput, the cores' step times)
# A step computing at least this many prompt tokens measures prompt throughput.
_PROMPT_STEP_TOKENS = 32


def _now() -> float:
    return time.monotonic()  # read when called (tests set the time)


class _Window:
    """Timestamped samples of the last ``WINDOW_S`` seconds. Written by the engine thread (which
    alone trims), read from others through a snapshot."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> None:
        now = self.clock()
        self.samples.append((now, value))
        while now - self.samples[0][0] > WINDOW_S:
            self.samples.popleft()

    def _recent(self) -> list[float]:
        since = self.clock() - WINDOW_S
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
    """``clock``: the time its windows are read in (``duet simulate`` gives its simulated time)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.prefill_tokens_per_s = 0.0
        self.tokens_per_s = 0.0
        clock = clock or _now
        self._tpot = _Window(clock)
        self._decode_only_tpot = _Window(clock)
        self._last_decode_only_tpot_s = 0.0
        self._first_tokens = _Window(clock)
        self._outputs = _Window(clock)

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

    def observe(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput, seconds: float) -> tuple[int, int]:
        """``observe_step`` of a step as scheduled and run: a decoding sequence is scheduled its next
        token and its drafts; the rest is prompt work. Returns the decoding sequences and the tokens they got."""
        drafts = scheduler_output.scheduled_spec_token_ids
        decoding = {
            request_id
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items()
            if num_tokens == 1 + len(drafts.get(request_id, ()))
        }
        num_decode_tokens = sum(scheduler_output.num_scheduled_tokens[request_id] for request_id in decoding)
        sampled = dict(zip(runner_output.request_ids, runner_output.sampled_token_ids))
        num_decode_outputs = sum(len(sampled.get(request_id, ())) for request_id in decoding)
        self.observe_step(
            scheduler_output.total_num_scheduled_tokens - num_decode_tokens, scheduler_output.total_num_scheduled_tokens,
            len(decoding), num_decode_outputs, sum(map(len, runner_output.sampled_token_ids)), seconds,
        )
        return len(decoding), num_decode_outputs

    def observe_first_token(self, seconds: float) -> None:
        """A request's wait from arrival at this engine to its first token computed here."""
        self._first_tokens.add(seconds)

    @property
    def tpot_s(self) -> float:
        return self._tpot.mean()

    @property
    def decode_only_tpot_s(self) -> float:
        """Of the last ``WINDOW_S``'s steps that computed no prompt; where every step did, of all
        of them (what decoding gives now: an older figure would hide the prompts' toll, and the
        router would send more of them); idle, the last one seen."""
        return self._decode_only_tpot.mean() or self._tpot.mean() or self._last_decode_only_tpot_s

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
