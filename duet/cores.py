"""One machine's cores, shared by the engines on it one step at a time, decode first.

Replicas of both roles on one machine take turns at all of its cores: a step computes while it
holds the machine's lease (an exclusive ``flock`` on a file in ``DIRECTORY``, a memory-backed
folder), on as many threads as the machine has cores. An idle machine gives a prompt all its
cores, as one engine would.

Decode comes first. A prefill engine that finds a decoder waiting for the lease lets it take
the lease (``YIELD_S`` at most), then queues on the lock, so the two alternate while both have
work. While a decoder is busy, a prefill step's prompt is cut to the decoder's ``gap_s``: its
TPOT budget times the tokens a sequence gets from one of its steps, less its step time, at the
prompt speed the prefill engine measured in its turns (``MIN_CHUNK_TOKENS`` at least, so
prompts always advance). An engine's load figures count its waits for turns (``LLMEngine.step``).

Each engine publishes its ``EngineState`` in a small file of its own beside the lock; a file
whose process is gone is removed by the next reader, and the kernel drops a dead process's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import struct
import time
import uuid
from pathlib import Path

from duet.load import moving_average

DIRECTORY = Path("/dev/shm/duet-cores") if Path("/dev/shm").is_dir() else Path("/tmp/duet-cores")
YIELD_S = 0.5  # the longest a prefill step waits for a waiting decoder's step
MIN_CHUNK_TOKENS = 32  # the least prompt a prefill step computes while decoders are busy
POLL_S = 0.0005  # how often a yielding prefill step looks again (each look reads a few small files)
_STATE = struct.Struct("<BBBxxxxxQdd")  # decode, wanting, busy, steps, step_s, gap_s


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclasses.dataclass
class EngineState:
    """What one engine on the machine publishes."""

    decode: bool
    wanting: bool = False  # blocked on the lease (a decoder clears it once it holds it)
    busy: bool = False  # its last step computed, and it has more
    steps: int = 0
    step_s: float = 0.0  # a decode step's time on the whole machine, a running mean
    gap_s: float = 0.0  # how long a decoder may wait between its steps

    size = _STATE.size

    def pack(self) -> bytes:
        return _STATE.pack(self.decode, self.wanting, self.busy, self.steps, self.step_s, self.gap_s)

    @classmethod
    def unpack(cls, data: bytes) -> EngineState:
        decode, wanting, busy, steps, step_s, gap_s = _STATE.unpack(data)
        return cls(bool(decode), bool(wanting), bool(busy), steps, step_s, gap_s)


class CoreLease:
    """One engine's turn at the machine's cores. ``decode``: its steps go first, and it keeps
    its steps within ``tpot_budget_s`` of each other. Not thread-safe: the engine thread's."""

    def __init__(self, decode: bool, tpot_budget_s: float, directory: Path | None = None) -> None:
        self.directory = Path(directory or DIRECTORY)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tpot_budget_s = tpot_budget_s
        self.cores = machine_cores()
        self.state = EngineState(decode)
        self._lock_fd = os.open(self.directory / "cores.lock", os.O_RDWR | os.O_CREAT, 0o666)
        self._name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}.state"
        self._state_fd = os.open(self.directory / self._name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        self._publish()
        self.waited_s = 0.0  # time spent waiting for the lease (and, prefill, for decoders' steps)
        self.prompt_tokens_per_s = 0.0  # a prefill engine's speed in its turns (0: not measured yet)
        self.tokens_per_step = 1.0  # a decoding sequence's tokens per step, a running mean

    def _publish(self) -> None:
        os.pwrite(self._state_fd, self.state.pack(), 0)

    def peers(self) -> list[EngineState]:
        """The other engines' states (a file whose process is gone is removed)."""
        peers = []
        for name in os.listdir(self.directory):
            pid = name.split("-", 1)[0]
            if not name.endswith(".state") or name == self._name or not pid.isdigit():
                continue
            path = self.directory / name
            if not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            with contextlib.suppress(OSError, struct.error):
                peers.append(EngineState.unpack(path.read_bytes()[: EngineState.size]))
        return peers

    def token_budget(self) -> int | None:
        """Before a prefill engine schedules a step: let a waiting decoder take the lease first
        (``YIELD_S`` at most), then the prompt tokens this step may compute so that busy decoders step again
        within their gap (None: no bound, or no speed measured yet). A decode engine's own steps
        are never bounded."""
        if self.state.decode:
            return None
        started = time.perf_counter()
        while any(peer.decode and peer.wanting for peer in self.peers()) and time.perf_counter() - started < YIELD_S:
            time.sleep(POLL_S)
        self.waited_s += time.perf_counter() - started
        gaps = [peer.gap_s for peer in self.peers() if peer.decode and (peer.busy or peer.wanting)]
        if not gaps or self.prompt_tokens_per_s <= 0:
            return None
        return max(MIN_CHUNK_TOKENS, int(min(gaps) * self.prompt_tokens_per_s))

    @contextlib.contextmanager
    def hold(self, num_tokens: int):
        """A step of ``num_tokens``' compute, on all the cores while it holds the lease (a step
        that computes nothing, which only carries transfers, does not wait for it)."""
        if not num_tokens:
            yield
            self._after(0, 0.0)
            return
        if self.state.decode:
            self.state.wanting = True
            self._publish()
        asked = time.perf_counter()
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        started = time.perf_counter()
        self.waited_s += started - asked
        if self.state.wanting:  # holds it: a yielding prefill engine may queue on the lock now
            self.state.wanting = False
            self._publish()
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            self._after(num_tokens, time.perf_counter() - started)

    def _after(self, num_tokens: int, seconds: float) -> None:
        state = self.state
        before = dataclasses.replace(state)
        state.wanting = False
        state.busy = num_tokens > 0
        if num_tokens:
            state.steps += 1
            if state.decode:
                state.step_s = moving_average(state.step_s, seconds)
                state.gap_s = max(0.0, self.tpot_budget_s * self.tokens_per_step - state.step_s)
            elif num_tokens >= MIN_CHUNK_TOKENS and seconds > 0:
                self.prompt_tokens_per_s = moving_average(self.prompt_tokens_per_s, num_tokens / seconds)
        if state.decode or state != before:
            self._publish()

    def observe_decode(self, num_decoding: int, num_tokens: int) -> None:
        """A step gave ``num_decoding`` decoding sequences ``num_tokens`` tokens."""
        if num_decoding:
            self.tokens_per_step = moving_average(self.tokens_per_step, max(1.0, num_tokens / num_decoding))

    def idle(self) -> None:
        """The engine ran out of work: it holds no claim on the cores."""
        if self.state.busy or self.state.wanting:
            self.state.busy = self.state.wanting = False
            self._publish()

    def close(self) -> None:
        for fd in (self._state_fd, self._lock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            (self.directory / self._name).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
