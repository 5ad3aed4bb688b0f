"""A pair's run buffers in shared memory, where its sender and receiver share a machine.

Over gloo each run of layers is copied four times on one machine: packed from the sender's
blocks, into the socket, out of it, and scattered into the receiver's blocks; on a small machine
the socket's copies take the same cores as the packing. Where both ends of a pair see the same
``/dev/shm`` (checked when the pair is built: ``agree``), the sender packs each run straight into
one of two slots of a file both ends map, and the wire carries signals only: ``[run, generation,
slot bytes]`` once a run is in its slot, and back from the receiver ``[run]`` once it has put
that run in place, so that its slot may take the run two after it. Checksums, trailer and
acknowledgement are those of the wire, and so are the timeouts: a signal that does not come
breaks the pair as data would.

The sender makes the file (``duet-kv-<token>-<generation>``, a new generation when a transfer's
runs outgrow the slots) and removes the one it replaces; the receiver removes each file once it
has mapped it, so none outlives the pair but where a process dies between the two. The file's
pages are allocated when it is made: where ``/dev/shm`` has no room for them (a container's is
64 MiB by default) the transfer goes on the wire instead (its first signal says so, generation
0), never into pages that are not there (a write to one kills the process).
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
FREE_TAG_BASE = 1 << 20  # the receiver's "slot free" signal for run i has tag FREE_TAG_BASE + i
_ALIGN = 4096
WIRE_SIGNAL = (0, 0, 0)  # a transfer's first signal when its runs come on the wire: generation 0


def agree(store: dist.Store, is_sender: bool, wanted: bool, timeout: timedelta) -> SharedRuns | None:
    """Whether the pair's two ends share ``/dev/shm`` and both want it (the receiver writes a file
    there, the sender reads it back): their ``SharedRuns`` if so, None for the wire."""
    if not is_sender:
        token, probe = "", None
        if wanted and SHM_DIR.is_dir():
            token = uuid.uuid4().hex
            probe = SHM_DIR / f"duet-kv-probe-{token}"
            try:
                probe.write_text(token)
            except OSError:
                token, probe = "", None
        store.set("shm/probe", token)
        try:
            store.wait(["shm/answer"], timeout)
            answer = store.get("shm/answer").decode()
        finally:
            if probe is not None:
                probe.unlink(missing_ok=True)
    else:
        store.wait(["shm/probe"], timeout)
        token = store.get("shm/probe").decode()
        answer = token if wanted and token and _reads(SHM_DIR / f"duet-kv-probe-{token}", token) else ""
        store.set("shm/answer", answer)
    return SharedRuns(SHM_DIR / f"duet-kv-{answer}", is_sender) if answer else None


def _reads(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False


class SharedRuns:
    """One pair's two run slots in a file under ``prefix`` (``<prefix>-<generation>``), as its
    sender (who makes the files) or its receiver (who maps what the sender's signals name)."""

    def __init__(self, prefix: Path, is_sender: bool) -> None:
        self.prefix = prefix
        self.is_sender = is_sender
        self.generation = 0
        self.slot_bytes = 0
        self.memory: torch.Tensor | None = None  # [2 * slot_bytes] uint8, mapped from the file

    def _path(self, generation: int) -> Path:
        return Path(f"{self.prefix}-{generation}")

    def _map(self, generation: int, slot_bytes: int, create: bool) -> None:
        path = self._path(generation)
        if create:  # every page now: OSError where /dev/shm has no room for them
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, 2 * slot_bytes)
            except OSError:
                path.unlink(missing_ok=True)
                raise
            finally:
                os.close(descriptor)
        self.memory = torch.from_file(str(path), shared=True, size=2 * slot_bytes, dtype=torch.uint8)
        self.generation, self.slot_bytes = generation, slot_bytes

    def outgoing(self, shape: tuple[int, ...], runs: list[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The sender's views to pack each run into (``shape``: a whole run's), in the two slots in
        turn; a new file first where a run does not fit the current one. None where /dev/shm has
        no room for it: this transfer goes on the wire (``WIRE_SIGNAL`` first)."""
        need = -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        if need > self.slot_bytes:
            old = self.generation
            try:
                self._map(old + 1, need, create=True)
            except OSError as error:  # the slots stay as they were, for transfers that fit them
                logger.warning("no room in %s for KV slots of %d bytes (%s): this transfer goes over the socket", SHM_DIR, need, error)
                return None
            if old:
                self._path(old).unlink(missing_ok=True)  # the receiver's, if it never mapped it
        return self._views(shape, runs, dtype)

    @staticmethod
    def on_the_wire(signal: torch.Tensor) -> bool:
        """Whether a transfer's first signal says its runs come on the wire (``WIRE_SIGNAL``)."""
        return int(signal[1]) == 0

    def signal(self, index: int) -> torch.Tensor:
        """What tells the receiver that run ``index`` is in its slot."""
        return torch.tensor([index, self.generation, self.slot_bytes], dtype=torch.int64)

    def incoming(self, signal: torch.Tensor, shape: tuple[int, ...], runs: list[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """The receiver's views of each run, from the first run's ``signal`` (mapping the file it names)."""
        _, generation, slot_bytes = (int(word) for word in signal.tolist())
        if generation != self.generation:
            self._map(generation, slot_bytes, create=False)
            self._path(generation).unlink(missing_ok=True)
        if math.prod(shape) * dtype.itemsize > self.slot_bytes:
            raise RuntimeError(f"a run of {math.prod(shape) * dtype.itemsize} bytes announced in slots of {self.slot_bytes}")
        return self._views(shape, runs, dtype)

    def _views(self, shape: tuple[int, ...], runs: list[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
        size = math.prod(shape) * dtype.itemsize
        whole = [self.memory[slot * self.slot_bytes : slot * self.slot_bytes + size].view(dtype).view(shape) for slot in range(2)]
        return [whole[index % 2][: end - start] for index, (start, end) in enumerate(runs)]

    def close(self) -> None:
        """The sender's file goes (if the receiver has not removed it); the mapping with the last view."""
        if self.is_sender and self.generation:
            self._path(self.generation).unlink(missing_ok=True)
        self.memory = None
