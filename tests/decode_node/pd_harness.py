"""Drives requests through a prefill process and a decode node, as the router will."""

from __future__ import annotations

import time
from dataclasses import dataclass

from duet.prefill_node.process import PrefillProcess


def _die_after_header(node) -> None:
    """Make the node's sender crash the whole process in the middle of its first transfer."""
    import os

    from duet.kv_transfer.group import SENDER_RANK
    from duet.kv_transfer.transfer import _announce, _SenderPair

    def announce_then_crash(pair, client, control, job):
        _announce(control, f"send {job.transfer_id} {job.num_blocks}")
        pair.owner._group(client, pair.pair_key, SENDER_RANK)
        os._exit(1)

    _SenderPair._send = announce_then_crash


def doomed_prefill(engine_kwargs: dict, node_id: str = "prefill-doomed") -> PrefillProcess:
    """A prefill process whose first KV transfer dies half-way, taking the process with it."""
    return PrefillProcess(engine_kwargs, node_id, setup=_die_after_header)


@dataclass
class PDRun:
    tokens: list[list[int] | None]  # per prompt; None when the decode node failed the request
    num_cached_tokens: list[int]  # per prompt: prefix-cache hits on the prefill side


def run_disaggregated(prefill: PrefillProcess, decode, prompts, params, timeout_s: float = 600, stream=False):
    """Every prompt through prefill (first token) and decode (the rest). With ``stream`` the
    decode replica is chosen first and the KV streams in while the prefill computes."""
    for index, prompt in enumerate(prompts):
        destination = decode.reserve(f"r{index}", prompt, params, prefill.node_id) if stream else None
        prefill.submit(f"r{index}", prompt, params, destination)
    tokens: dict[str, list[int]] = {}
    cached = {}
    pending, failed = len(prompts), 0
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        while (result := prefill.receive()) is not None:
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
            prefill.send_kv(result.handle.transfer_id, decode.endpoint, pair_key)
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
