"""What a router took in lately: requests, the prompt tokens they brought, the output tokens they
asked for and those they ended with, over the last few windows, and the sequences in flight
with the tokens they have had so far. The planning autoscaler (``duet.cluster.capacity``) sizes
the pools from it, before any queue shows the load: each router replica reports
``ArrivalMeter.summary()`` to the autoscalers' board with its waiting contexts
(``duet.cluster.admin``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

WINDOWS_S = (10.0, 60.0)  # a rise shows in the short one within seconds; the long one holds the pools through lulls


class ArrivalMeter:
    """Arrivals and ends of sequences, kept for the longest window (``clock``: seconds). The
    router's loop records; its reporting thread reads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (when, prompt tokens, max_tokens or 0)
        self._ends: deque[tuple[float, int]] = deque()  # (when, output tokens) of sequences that finished
        self._live: dict[int, list[int]] = {}  # a sequence in flight: [its output tokens so far, its max_tokens or 0]
        self._tickets = 0
        self._lock = threading.Lock()

    def arrive(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """A sequence arrived; its ticket for ``progress`` and ``end``."""
        with self._lock:
            self._arrivals.append((self.clock(), prompt_tokens, max_tokens or 0))
            self._drop()
            self._tickets += 1
            self._live[self._tickets] = [0, max_tokens or 0]
            return self._tickets

    def progress(self, ticket: int, output_tokens: int) -> None:
        self._live[ticket][0] = output_tokens  # one list's item: no lock needed beside the reader's copy

    def end(self, ticket: int, finished: bool) -> None:
        """A sequence left: ``finished`` with its last token (its length counts), or not (its
        client left, it failed: its length is not one sequences end with)."""
        with self._lock:
            output_tokens = self._live.pop(ticket, [0])[0]
            if finished:
                self._ends.append((self.clock(), output_tokens))
            self._drop()

    def _drop(self) -> None:
        oldest = self.clock() - max(WINDOWS_S)
        for items in (self._arrivals, self._ends):
            while items and items[0][0] < oldest:
                items.popleft()

    def summary(self) -> list[dict[str, float]]:
        """Per window of ``WINDOWS_S``: the seconds it covers (no more than this router has run),
        the requests that arrived in it, their prompt tokens and asked-for output tokens, the
        sequences that finished in it and their output tokens; and in each, the sequences in
        flight now (``running``), their output tokens so far (``running_tokens``) and the lengths
        they are likely to end with (``running_expected``: each, on average half way, twice its
        tokens so far, at most its ``max_tokens``)."""
        with self._lock:
            self._drop()
            arrivals, ends = list(self._arrivals), list(self._ends)
            live = [(so_far, most) for so_far, most in list(self._live.values())]
        expected = sum(min(2 * so_far, most) if most else 2 * so_far for so_far, most in live)
        now = self.clock()
        windows = []
        for window in WINDOWS_S:
            since = now - window
            arrived = [item for item in arrivals if item[0] >= since]
            ended = [item for item in ends if item[0] >= since]
            windows.append({
                "seconds": min(window, now - self.started), "requests": len(arrived),
                "prompt_tokens": sum(item[1] for item in arrived), "max_tokens": sum(item[2] for item in arrived),
                "finished": len(ended), "output_tokens": sum(item[1] for item in ended),
                "running": len(live), "running_tokens": sum(so_far for so_far, _ in live), "running_expected": expected,
            })
        return windows
