"""A prefill node in a process of its own, driven over a multiprocessing pipe.

For benchmarks and tests that split prefill and decode across processes without Ray.
Commands: ``("submit", request_id, prompt, params, destination)``, ``("send", transfer_id,
endpoint, pair_key)``, ``("stop",)``; each ``PrefillResult`` comes back as ``("result", r)``.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable

from duet.config import EngineArgs


def serve_prefill_node(conn, engine_kwargs: dict, node_id: str, setup: Callable | None) -> None:
    from duet.prefill_node.node import PrefillNode

    node = PrefillNode(EngineArgs(**engine_kwargs), node_id, transfer_timeout_s=60)
    if setup is not None:
        setup(node)
    conn.send(("ready", node.kv_spec))
    while True:
        while conn.poll(0.002):
            command, *args = conn.recv()
            if command == "stop":
                node.close()
                node.check_integrity()
                conn.send(("stopped", None))
                return
            if command == "submit":
                node.submit(*args)
            elif command == "send":
                node.send_kv(*args)
        for result in node.step():
            conn.send(("result", result))


class PrefillProcess:
    """Starts ``serve_prefill_node`` in a spawned process; ``setup(node)`` runs there first."""

    def __init__(self, engine_kwargs: dict, node_id: str = "prefill-0", setup: Callable | None = None) -> None:
        context = mp.get_context("spawn")
        self.node_id = node_id
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_prefill_node, args=(child, engine_kwargs, node_id, setup))
        self.process.start()
        kind, self.kv_spec = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"prefill process answered {kind!r} instead of ready")

    def submit(self, request_id: str, prompt: list[int], params, destination=None) -> None:
        self.conn.send(("submit", request_id, list(prompt), params, destination))

    def send_kv(self, transfer_id: int, endpoint, pair_key: str) -> None:
        self.conn.send(("send", transfer_id, endpoint, pair_key))

    def receive(self):
        """The next PrefillResult if one is waiting; None if not, or if the process died."""
        try:
            return self.conn.recv()[1] if self.conn.poll(0) else None
        except (EOFError, OSError):
            return None

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop",))
            kind, _ = self.conn.recv()
            if kind != "stopped":
                raise RuntimeError(f"prefill process answered {kind!r} instead of stopped")
        self.process.join(30)
