"""What a router took in lately: requests, the prompt tokens they brought, the output tokens they
asked for and those they ended with, over the last few windows. The planning autoscaler
(``duet.cluster.capacity``) sizes the pools from it, before any queue shows the load: each
router replica reports ``ArrivalMeter.summary()`` to the autoscalers' board with its waiting
contexts (``duet.cluster.admin``)."""

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
        self._lock = threading.Lock()

    def arrive(self, prompt_tokens: int, max_tokens: int | None) -> None:
        with self._lock:
            self._arrivals.append((self.clock(), prompt_tokens, max_tokens or 0))
            self._drop()

    def finish(self, output_tokens: int) -> None:
        """A sequence that ended with its last token (not one its client left)."""
        with self._lock:
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
        sequences that finished in it and their output tokens."""
        with self._lock:
            self._drop()
            arrivals, ends = list(self._arrivals), list(self._ends)
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
            })
        return windows
