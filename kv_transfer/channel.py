"""The control channel of a KV receiver: numbered messages in its TCPStore.

Any sender (and the receiver itself) appends a message by claiming the next free slot
``m/<n>`` with an atomic compare-and-set, so slots fill in order with no gaps, whoever writes
(each message is stamped with a word of its own, so that a writer never mistakes another's
identical message for its own write);
the receiver reads them in order, one blocking wait at a time. Control travels here and never
over gloo: a gloo wait that times out tears its whole group down, so gloo only carries data
that an announcement has promised.
"""

from __future__ import annotations

import datetime
import uuid

import torch.distributed as dist

# How long a blocked wait lasts before it is renewed (each renewal logs a c10d warning line).
_WAIT = datetime.timedelta(hours=1)
# Read messages are deleted this far behind: a writer's hint may lag by as many messages as are
# being posted at once, and must never land on a slot already read and deleted.
_KEEP = 1024


class Channel:
    """One client's view of a receiver's message log (a client per thread: a blocked wait
    holds the connection)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore("duet/channel", store)

    def post(self, *words: object) -> None:
        """Append a message of space-separated words."""
        # compare_set answers with the slot's value: without the stamp, two prefill ranks posting
        # the same "cancel <id> timeout" at once both read the slot as theirs, and the slot after
        # it stayed empty for good (the listener waits on it forever).
        message = " ".join([uuid.uuid4().hex, *(str(word) for word in words)]).encode()
        index = self.store.add("count", 0) + 1  # a hint: never past the first free slot
        while self.store.compare_set(f"m/{index}", "", message) != message:
            index += 1
        self.store.add("count", 1)

    def read(self, index: int, stopped) -> list[str] | None:
        """Message ``index`` (1-based), waiting for it; None once ``stopped()``."""
        key = f"m/{index}"
        while True:
            try:
                self.store.wait([key], _WAIT)
                break
            except dist.DistStoreError:
                if stopped():
                    return None
        _stamp, *words = self.store.get(key).decode().split()
        if index > _KEEP:
            self.store.delete_key(f"m/{index - _KEEP}")
        return words
