"""One machine's cores, shared step by step by the engines on it: prompts first while decoding
streams have time to spare, decode's share kept when they have none.

Before each step an engine reads the others' published ``EngineState`` and sizes its torch
thread pool:

- A decode engine whose streams are ahead of their TPOT budget (``slack_s``: how long the
  slowest of them may still wait, by ``tpot_budget_s`` a token) skips its steps while a prompt
  engine wants the cores for a lone request (``yielding``). Its streams lose only time they had
  to spare. Beside a backlog of prompts the cores stay split: the other processes' threads (the
  transfers, the router) slow a team of threads on every core more than one on each.
- A prompt engine computes on every core the stepping decoders leave. It waits for decoders
  that will yield (``YIELD_WAIT_S`` at most), and cuts its chunk to their least slack at the
  speed it measured on that many threads, so that they step again in time. Beside a decoder
  with no slack it computes on what that decoder leaves (the decoder's ``need``: the threads its
  steps take to stay within the budget), in chunks of ``SPLIT_CHUNK_S``, so that it takes the
  whole machine again as soon as the decoder has time to spare.
- A decode engine with no prompt engine wanting the cores steps on all of them.

So an idle machine gives a prompt all its cores, as one engine would, and the streams left when
the prompts stop (the drain) decode on all of them; under load each role keeps a share, as
static cores do. Each engine publishes its state in a small file of its own in ``DIRECTORY`` (a
memory-backed folder); a file whose process is gone is removed by the next reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import struct
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from duet.load import moving_average

DIRECTORY = Path("/dev/shm/duet-cores") if Path("/dev/shm").is_dir() else Path("/tmp/duet-cores")
YIELD_WAIT_S = 0.05  # the longest a prompt step waits for decoders with slack to yield
MIN_PAUSE_S = 0.02  # the least slack with which a decoder still yields to prompts
SPLIT_CHUNK_S = 0.1  # the longest prompt step beside a decoder that has no slack
MAX_SLACK_S = 1.0  # the longest one pause: a stream ahead of its budget for long banks no more
MIN_CHUNK_TOKENS = 32  # the least prompt a bounded step computes, so prompts always advance
POLL_S = 0.0005  # how often a waiting prompt step looks again (each look reads a few small files)
_STATE = struct.Struct("<BBBBHxxQd")  # decode, wanting, backlog, yielding, need, steps, slack_s


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclasses.dataclass
class EngineState:
    """What one engine on the machine publishes."""

    decode: bool
    wanting: bool = False  # it has work to compute
    backlog: bool = False  # a prompt engine with more than one request to compute
    yielding: bool = False  # a decoder skipping its steps while prompts compute
    need: int = 1  # a decoder's threads beside prompts
    steps: int = 0
    slack_s: float = 0.0  # a decoder's: how long its streams may still wait

    size = _STATE.size

    def pack(self) -> bytes:
        return _STATE.pack(self.decode, self.wanting, self.backlog, self.yielding, self.need, self.steps, self.slack_s)

    @classmethod
    def unpack(cls, data: bytes) -> EngineState:
        decode, wanting, backlog, yielding, need, steps, slack_s = _STATE.unpack(data)
        return cls(bool(decode), bool(wanting), bool(backlog), bool(yielding), need, steps, slack_s)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    threads: int
    token_budget: int | None  # prompt tokens this step may compute (None: no bound)


class CoreShare:
    """One engine's share of the machine's cores. ``decode``: its streams keep within
    ``tpot_budget_s`` a token. Not thread-safe: the engine thread's."""

    def __init__(self, decode: bool, tpot_budget_s: float, directory: Path | None = None) -> None:
        self.directory = Path(directory or DIRECTORY)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tpot_budget_s = tpot_budget_s
        self.cores = machine_cores()
        self.state = EngineState(decode)
        self._name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}.state"
        self._state_fd = os.open(self.directory / self._name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        self._publish()
        self.waited_s = 0.0  # a decoder's yields; a prompt engine's waits for decoders to yield
        self.last_threads = self.cores  # of its last step that computed
        self.prompt_tokens_per_s: dict[int, float] = {}  # a prompt engine's speed on so many threads
        self._thread_s = 0.0  # a decoder's step, in thread-seconds, a running mean
        self._tokens_per_step = 1.0  # a decoding stream's tokens per step, a running mean
        self._streams: dict[str, tuple[float, int]] = {}  # a decoder's streams: (since, tokens then)
        self._yield_started: float | None = None

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

    def before_step(self, streams: Iterable[tuple[str, int]] = (), requests: int = 1) -> StepPlan | None:
        """The threads and prompt budget of the engine's next step, or None: a decoder skips it
        (it yields to prompts). ``streams``: a decoder's decoding sequences, (id, tokens so far);
        ``requests``: how many requests the engine has to compute (a prompt engine whose sends
        are all it has left wants no cores; one with more than one has a backlog)."""
        if self.state.decode:
            return self._decode_plan(list(streams), requests > 0)
        if not requests:
            self.idle()
            return StepPlan(self.last_threads, None)
        return self._prompt_plan(backlog=requests > 1)

    def _decode_plan(self, streams: list[tuple[str, int]], computes: bool) -> StepPlan | None:
        state, now = self.state, time.perf_counter()
        state.slack_s = self._slack(streams, now)
        state.need = self._need()
        prompts = [peer for peer in self.peers() if not peer.decode and peer.wanting]
        # Beside a backlog of prompts the cores stay split: turns of every core cost more than a core each.
        if streams and prompts and not any(peer.backlog for peer in prompts) and state.slack_s >= MIN_PAUSE_S:
            if self._yield_started is None:
                self._yield_started = now
            state.wanting = state.yielding = True
            self._publish()
            return None
        if self._yield_started is not None:
            self.waited_s += now - self._yield_started
            self._yield_started = None
        state.wanting, state.yielding = computes or bool(streams), False
        self._publish()  # its slack and need, for a prompt engine sizing its step beside this one
        return StepPlan(state.need if prompts else self.cores, None)

    def _prompt_plan(self, backlog: bool) -> StepPlan:
        state = self.state
        if not state.wanting or state.backlog != backlog:
            state.wanting, state.backlog = True, backlog
            self._publish()
        started = time.perf_counter()
        while True:
            decoders = [peer for peer in self.peers() if peer.decode and peer.wanting]
            stepping = [peer for peer in decoders if not peer.yielding]
            will_yield = not backlog and any(peer.slack_s >= MIN_PAUSE_S for peer in stepping)  # only to a lone prompt
            if not will_yield or time.perf_counter() - started >= YIELD_WAIT_S:
                break
            time.sleep(POLL_S)
        self.waited_s += time.perf_counter() - started
        threads = max(1, self.cores - sum(peer.need for peer in stepping))
        if stepping:
            seconds = SPLIT_CHUNK_S
        elif decoders:
            seconds = min(peer.slack_s for peer in decoders)
        else:
            return StepPlan(threads, None)
        speed = self.prompt_tokens_per_s.get(threads, 0.0)
        return StepPlan(threads, max(MIN_CHUNK_TOKENS, int(seconds * speed)) if speed > 0 else None)

    def _slack(self, streams: list[tuple[str, int]], now: float) -> float:
        """How long the decoding streams may still wait: the least, over them, of their TPOT
        budget for the tokens they got here (and the next) less the time they took (none: 0, a
        decoder without streams does not yield)."""
        known, self._streams = self._streams, {}
        slack = MAX_SLACK_S if streams else 0.0
        for stream_id, tokens in streams:
            since, tokens_then = self._streams[stream_id] = known.get(stream_id, (now, tokens))
            slack = min(slack, self.tpot_budget_s * (tokens - tokens_then + 1) - (now - since))
        return max(0.0, slack)

    def _need(self) -> int:
        """A decoder's threads beside prompts: enough for a step within its streams' budget."""
        if self.cores <= 1 or self._thread_s <= 0:
            return 1
        budget_s = self.tpot_budget_s * self._tokens_per_step
        return min(self.cores - 1, max(1, math.ceil(self._thread_s / budget_s)))

    @contextlib.contextmanager
    def hold(self, num_tokens: int, threads: int):
        """A step of ``num_tokens``' compute on ``threads`` threads (a step that computes nothing,
        which only carries transfers, changes nothing)."""
        if not num_tokens:
            yield
            if not self.state.decode and self.state.wanting:  # nothing to compute: it wants no cores
                self.state.wanting = False
                self._publish()
            return
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.last_threads = threads
        started = time.perf_counter()
        try:
            yield
        finally:
            self._after(num_tokens, threads, time.perf_counter() - started)

    def _after(self, num_tokens: int, threads: int, seconds: float) -> None:
        state = self.state
        state.steps += 1
        if state.decode:
            self._thread_s = moving_average(self._thread_s, seconds * threads)
        elif num_tokens >= MIN_CHUNK_TOKENS and seconds > 0:
            speeds = self.prompt_tokens_per_s
            speeds[threads] = moving_average(speeds.get(threads, 0.0), num_tokens / seconds)
        self._publish()

    def observe_decode(self, num_decoding: int, num_tokens: int) -> None:
        """A step gave ``num_decoding`` decoding sequences ``num_tokens`` tokens."""
        if num_decoding:
            self._tokens_per_step = moving_average(self._tokens_per_step, max(1.0, num_tokens / num_decoding))

    def idle(self) -> None:
        """The engine ran out of work: it wants no cores."""
        state = self.state
        if state.wanting or state.yielding or state.backlog:
            state.wanting = state.yielding = state.backlog = False
            self._publish()
        self._streams.clear()
        if self._yield_started is not None:
            self.waited_s += time.perf_counter() - self._yield_started
            self._yield_started = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._state_fd)
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
