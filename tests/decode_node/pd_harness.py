"""A prefill node in a process of its own, and a driver that runs requests through P then D."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

from duet.config import EngineArgs


def prefill_worker(conn, engine_kwargs: dict, node_id: str, crash_on_send: bool) -> None:
    """Serve commands from the pipe; send back each PrefillResult as it comes."""
    from duet.prefill_node.node import PrefillNode

    node = PrefillNode(EngineArgs(**engine_kwargs), node_id, transfer_timeout_s=20)
    if crash_on_send:
        _die_after_first_layer(node)
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


def _die_after_first_layer(node) -> None:
    """Make the node's sender crash the whole process in the middle of its first transfer."""
    import os

    import torch

    def header_and_one_layer(group, job):
        group.send(torch.tensor([job.transfer_id, len(job.block_ids)]), 0).wait()
        group.send(node.sender.kv_cache[0, :, :, job.block_ids].contiguous(), 2).wait()
        os._exit(1)

    node.sender._transfer = header_and_one_layer


class PrefillProcess:
    def __init__(self, engine_kwargs: dict, node_id: str = "prefill-0", crash_on_send: bool = False) -> None:
        context = mp.get_context("spawn")
        self.node_id = node_id
        self.conn, child = context.Pipe()
        self.process = context.Process(target=prefill_worker, args=(child, engine_kwargs, node_id, crash_on_send))
        self.process.start()
        kind, self.kv_spec = self.conn.recv()
        assert kind == "ready"

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop",))
            kind, _ = self.conn.recv()
            assert kind == "stopped"
        self.process.join(30)


@dataclass
class PDRun:
    tokens: list[list[int] | None]  # per prompt; None when the decode node failed the request
    num_cached_tokens: list[int]  # per prompt: prefix-cache hits on the prefill side


def run_disaggregated(prefill: PrefillProcess, decode, prompts, params, timeout_s: float = 600, stream=False):
    """Every prompt through prefill (first token) and decode (the rest). With ``stream`` the
    decode replica is chosen first and the KV streams in while the prefill computes."""
    for index, prompt in enumerate(prompts):
        destination = decode.reserve(f"r{index}", prompt, params, prefill.node_id) if stream else None
        prefill.conn.send(("submit", f"r{index}", list(prompt), params, destination))
    tokens: dict[str, list[int]] = {}
    cached = {}
    pending, failed = len(prompts), 0
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        while (result := _receive(prefill)) is not None:
            cached[result.request_id] = result.num_cached_tokens
            if result.finish_reason is not None:
                tokens[result.request_id] = [result.first_token_id]
                pending -= 1
                if stream:
                    decode.abort(result.request_id)
                continue
            if stream:
                decode.set_first_token(result.request_id, result.first_token_id)
                continue
            pair_key = decode.accept(result.handle, params)
            prefill.conn.send(("send", result.handle.transfer_id, decode.endpoint, pair_key))
        for output in decode.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
                pending -= 1
        while failed < len(decode.failures):
            tokens[decode.failures[failed].request_id] = None  # the policy was to fail it
            failed += 1
            pending -= 1
        if not decode.engine.has_unfinished_requests():
            time.sleep(0.002)
    assert pending == 0, f"{pending} requests unfinished after {timeout_s}s"
    ids = [f"r{index}" for index in range(len(prompts))]
    return PDRun([tokens[i] for i in ids], [cached.get(i, 0) for i in ids])


def _receive(prefill: PrefillProcess):
    """The next PrefillResult if one is waiting; None if not, or if the prefill process died."""
    try:
        return prefill.conn.recv()[1] if prefill.conn.poll(0) else None
    except (EOFError, OSError):
        return None
