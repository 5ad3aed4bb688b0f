"""An ``LLMEngine`` in a process of its own, driven over a pipe: a prefill engine and a decode
engine on one machine without Ray (the PD tests, ``duet bench transfer``).

Commands: ``("call", method, args)`` runs an engine method (``add_request``, ``freeze``,
``migrate``, ...) and is answered by ``("result", its result or error)``; ``("abort",
request_id)``; ``("stop",)`` answered by ``("stopped", None)`` after the integrity check. Every
``TokenDelta`` comes back as ``("delta", delta)``.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Callable

from duet.config import EngineArgs
from duet.messages import EngineRequest, KVDestination, TokenDelta


def serve_engine(conn, engine_kwargs: dict, setup: Callable | None) -> None:
    from duet.engine import LLMEngine

    engine = LLMEngine(EngineArgs(**engine_kwargs))
    if setup is not None:
        setup(engine)
    conn.send(("ready", engine.kv_endpoints))
    while True:
        while conn.poll(0 if engine.has_unfinished_requests() else 0.002):
            command, *args = conn.recv()
            if command == "stop":
                engine.close()
                engine.check_integrity()
                conn.send(("stopped", None))
                return
            if command == "call":
                method, call_args = args
                try:
                    conn.send(("result", getattr(engine, method)(*call_args)))
                except Exception as error:  # noqa: BLE001 - handed to the caller
                    conn.send(("result", error))
            elif command == "abort":
                engine.abort_request(args[0])
        if engine.has_unfinished_requests():
            for delta in engine.step():
                conn.send(("delta", delta))


class EngineProcess:
    """Starts ``serve_engine`` in a spawned process; ``setup(engine)`` runs there first."""

    def __init__(self, engine_kwargs: dict, setup: Callable | None = None) -> None:
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_engine, args=(child, engine_kwargs, setup))
        self.process.start()
        kind, self.kv_endpoints = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"engine process answered {kind!r} instead of ready")
        self._deltas: deque[TokenDelta] = deque()

    def add_request(self, request: EngineRequest) -> KVDestination | None:
        return self.call("add_request", request)

    def call(self, method: str, *args):
        """Run an engine method in the process; its result (an error it raised is raised here)."""
        self.conn.send(("call", method, args))
        while True:
            kind, payload = self.conn.recv()
            if kind == "delta":
                self._deltas.append(payload)
            elif isinstance(payload, Exception):
                raise payload
            else:
                return payload

    def abort_request(self, request_id: str) -> None:
        self.conn.send(("abort", request_id))

    def receive(self, timeout_s: float = 0.0) -> TokenDelta | None:
        """The next delta if one is waiting (or comes within ``timeout_s``); None if not, or if
        the process died."""
        if self._deltas:
            return self._deltas.popleft()
        try:
            return self.conn.recv()[1] if self.conn.poll(timeout_s) else None
        except (EOFError, OSError):
            return None

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop",))
            while True:
                kind, _ = self.conn.recv()
                if kind == "stopped":
                    break
        self.process.join(30)
