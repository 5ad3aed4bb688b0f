"""How far the engine has computed a request's KV, for the sender that ships it as it goes."""

from __future__ import annotations

import threading
from collections.abc import Callable


class TransferCancelled(Exception):
    """The request whose KV this is was aborted; what remains to send is not valid KV."""


class LayerProgress:
    """Layers of a request's KV computed so far, its block ids once allocated, and the first
    token once sampled (it travels with the KV, at the end).

    The engine's forward marks layers as it writes them; the sender ships each run of layers as
    soon as it is complete, so the transfer overlaps the rest of the prefill.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._condition = threading.Condition()
        self._num_ready = 0
        self._block_ids: list[int] | None = None
        self._first_token_id: int | None = None
        self._cancelled = False
        self.on_change: Callable[[], None] | None = None  # called, without this lock, after each change

    @classmethod
    def complete(cls, num_layers: int, block_ids: list[int], first_token_id: int) -> LayerProgress:
        progress = cls(num_layers)
        progress.mark_ready(num_layers, block_ids)
        progress.set_first_token(first_token_id)
        return progress

    def mark_ready(self, num_ready: int, block_ids: list[int] | None = None) -> None:
        with self._condition:
            if block_ids is not None:
                self._block_ids = list(block_ids)
            self._num_ready = max(self._num_ready, num_ready)
            self._condition.notify_all()
        self._changed()

    def set_first_token(self, token_id: int) -> None:
        with self._condition:
            self._first_token_id = token_id
            self._condition.notify_all()
        self._changed()

    def cancel(self) -> None:
        with self._condition:
            self._cancelled = True
            self._condition.notify_all()
        self._changed()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def block_ids(self) -> list[int] | None:
        return self._block_ids

    def ready(self, num_layers: int) -> bool:
        with self._condition:
            return self._num_ready >= num_layers and self._block_ids is not None

    def wait_for(self, num_layers: int, timeout_s: float) -> list[int]:
        """Block ids, once the first ``num_layers`` layers are computed; TransferCancelled if the
        request was aborted, TimeoutError if they do not come in time."""
        self._wait(lambda: self._num_ready >= num_layers and self._block_ids is not None, timeout_s, f"layers 0-{num_layers - 1}")
        return self._block_ids

    def wait_first_token(self, timeout_s: float) -> int:
        self._wait(lambda: self._first_token_id is not None, timeout_s, "the first token")
        return self._first_token_id

    def _wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._condition:
            done = self._condition.wait_for(lambda: self._cancelled or condition(), timeout_s)
            if self._cancelled:
                raise TransferCancelled("the request was aborted")
            if not done:
                raise TimeoutError(f"{what} not computed within {timeout_s}s")

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
