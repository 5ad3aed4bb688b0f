"""Faults a test injects into the KV transfers a sender makes, and the checksum that catches
bits changed on the wire.

A test hook, off unless the sender's process has ``DUET_KV_FAULTS`` set (nothing in
production sets it): a comma-separated list of ``kind=count`` or ``kind=count:seconds``, each
fault hitting the next ``count`` transfers of that sender, once each, after their first run of
layers is on the wire:

- ``corrupt=N``: a bit of the first run is flipped after its checksum was taken (a corrupted
  wire); the receiver must refuse the KV.
- ``stall=N:S``: the sender stops for ``S`` seconds before its trailer (a hung peer); the
  receiver's wait times out and breaks the pair.
- ``drop=N``: the sender drops the pair (a connection lost mid-way) and opens a new one for
  whatever it has left to send.
"""

from __future__ import annotations

import os
import threading
import time

import torch

FAULTS_ENV = "DUET_KV_FAULTS"


class InjectedFault(ConnectionError):
    """The pair was dropped by ``DUET_KV_FAULTS`` (a test hook)."""


def checksum(tensor: torch.Tensor) -> int:
    """The sum of a contiguous tensor's bytes read as 64-bit words (narrower ones when its size
    is not a multiple of 8), wrapping in 64 bits: any flipped bit changes it, and one pass costs
    about 0.2 ms per 8 MiB on CPU. The wire delivers in order, so words swapped in place are not
    what it guards against."""
    raw = tensor.reshape(-1).view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.numel() % word.itemsize == 0:
            return int(raw.view(word).sum(dtype=torch.int64))
    return int(raw.sum(dtype=torch.int64))


class TransferFaults:
    """What ``DUET_KV_FAULTS`` asks for, counted down as transfers take their fault."""

    KINDS = ("corrupt", "stall", "drop")

    def __init__(self, spec: str) -> None:
        self._left: dict[str, int] = {}
        self.stall_s = 0.0
        self._lock = threading.Lock()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, value = item.partition("=")
            count, _, seconds = value.partition(":")
            if kind not in self.KINDS or not count.isdigit():
                raise ValueError(f"{FAULTS_ENV}: {item!r} is not one of {self.KINDS} as kind=count (stall=count:seconds)")
            self._left[kind] = int(count)
            if kind == "stall":
                self.stall_s = float(seconds or 0)

    @classmethod
    def from_env(cls) -> TransferFaults | None:
        spec = os.environ.get(FAULTS_ENV, "")
        return cls(spec) if spec.strip() else None

    def take(self, kind: str) -> bool:
        """Whether this transfer gets a fault of ``kind`` (then one fewer is left)."""
        with self._lock:
            if self._left.get(kind, 0) <= 0:
                return False
            self._left[kind] -= 1
            return True

    def corrupt(self, packed: torch.Tensor) -> None:
        """Flip a bit of a packed run (the sender's own copy: the KV cache stays intact)."""
        if self.take("corrupt"):
            packed.reshape(-1).view(torch.uint8)[0] ^= 1

    def drop(self, transfer_id: int) -> None:
        if self.take("drop"):
            raise InjectedFault(f"{FAULTS_ENV} dropped the pair during transfer {transfer_id}")

    def stall(self) -> None:
        if self.take("stall"):
            time.sleep(self.stall_s)
