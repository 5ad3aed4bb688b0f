"""Drives requests through a prefill engine (in a process of its own) and a decode engine (here)
as the router does: the decode engine is chosen first and reserves the blocks, the prefill
engine streams the KV into them while it computes and sends its first token along."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from duet.engine_process import EngineProcess
from duet.messages import EngineRequest


def _crash_after_announcing(engine) -> None:
    """Make the engine's process die in the middle of its first KV transfer (announced, the
    group joined, no data sent)."""
    import os

    from duet.kv_transfer.sender import _SenderPair

    _SenderPair._send = lambda pair, group, job: os._exit(1)


def doomed_prefill(engine_kwargs: dict) -> EngineProcess:
    """A prefill engine process whose first KV transfer dies half-way, taking the process with it."""
    return EngineProcess(engine_kwargs, setup=_crash_after_announcing)


@dataclass
class PDRun:
    tokens: list[list[int] | None]  # per prompt; None when the KV was lost and not recomputed
    num_cached_tokens: list[int]  # per prompt: prefix-cache hits on the prefill side
    lost: list[str] = field(default_factory=list)  # why transfers were lost
    logprobs: list[list[dict[int, float]]] = field(default_factory=list)  # per prompt, where asked for (first token's too)


def run_disaggregated(prefill: EngineProcess, decode, prompts, params, timeout_s: float = 600, recompute: bool = True) -> PDRun:
    """Every prompt through prefill (first token) and decode (the rest). A lost transfer is
    recomputed on the decode engine, from the prompt and the first token if the prefill engine
    sent one (the router's ``recompute`` policy), or given up (``recompute=False``)."""
    ids = [f"r{index}" for index in range(len(prompts))]
    by_id = dict(zip(ids, prompts))
    for request_id, prompt in by_id.items():
        destination = decode.add_request(EngineRequest(request_id, prompt, params, kv_receive=True))
        prefill.add_request(EngineRequest(request_id, prompt, params, kv_send=destination))
    first: dict[str, list[int]] = {}
    rest: dict[str, list[int]] = {request_id: [] for request_id in ids}
    logprobs: dict[str, list[dict[int, float]]] = {request_id: [] for request_id in ids}
    cached: dict[str, int] = {}
    lost_ids: list[str] = []
    run = PDRun([], [])
    pending = set(ids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        progressed = False
        while (delta := prefill.receive()) is not None:
            assert delta.error is None, delta.error
            first[delta.request_id] = delta.token_ids
            logprobs.setdefault(delta.request_id, [])[:0] = delta.logprobs or []
            cached[delta.request_id] = delta.num_cached_tokens
            progressed = True
        for delta in decode.step():
            progressed = True
            if delta.kv_lost:
                run.lost.append(delta.error)
                lost_ids.append(delta.request_id)
                continue
            rest[delta.request_id] += delta.token_ids
            logprobs[delta.request_id] += delta.logprobs or []
            if delta.finished:
                pending.discard(delta.request_id)
        for request_id in list(lost_ids):
            if request_id not in first and prefill.process.is_alive():
                continue  # its first token may still come
            lost_ids.remove(request_id)
            if recompute:
                resumed = first.pop(request_id, [])
                decode.add_request(EngineRequest(request_id, by_id[request_id], params, output_token_ids=resumed))
                first[request_id] = resumed
            else:
                rest[request_id] = None
                pending.discard(request_id)
        if not progressed:
            # Nothing came and nothing ran (the decode engine waits for KV, or for nothing): leave
            # the CPU to the prefill process and the transfer threads, on two cores as on many.
            time.sleep(0.002)
    assert not pending, f"{len(pending)} requests unfinished after {timeout_s}s"
    run.tokens = [None if rest[i] is None else first.get(i, []) + rest[i] for i in ids]
    run.num_cached_tokens = [cached.get(i, 0) for i in ids]
    run.logprobs = [logprobs[i] for i in ids]
    return run


def finish_moved(target, request_id: str, timeout_s: float = 60) -> tuple[list[int], list[dict[int, float]]]:
    """Step ``target`` (an engine here) until it has nothing left: the tokens and logprobs it gave
    ``request_id``, a sequence moved to it (every request's deltas must be error-free)."""
    tokens, logprobs, deadline = [], [], time.monotonic() + timeout_s
    while target.has_unfinished_requests() and time.monotonic() < deadline:
        deltas = target.step()
        for delta in deltas:
            assert delta.error is None, delta.error
            if delta.request_id == request_id:
                tokens += delta.token_ids
                logprobs += delta.logprobs or []
        if not deltas:
            time.sleep(0.002)  # waiting for the KV: leave the transfer threads the CPU
    return tokens, logprobs


def migrate_live(source: EngineProcess, target, request: EngineRequest, after: int = 6, timeout_s: float = 60) -> tuple[list[int], list[int]]:
    """Run ``request`` on ``source`` (a decode engine's process) until it has streamed ``after``
    tokens, hold it still, and move it by KV to ``target`` (an engine here), which finishes it:
    the tokens the source held, and those the target gave."""
    source.add_request(request)
    streamed, deadline = [], time.monotonic() + timeout_s
    while len(streamed) < after:
        assert time.monotonic() < deadline, "the source stopped streaming"
        delta = source.receive()
        if delta is not None:
            streamed += delta.token_ids
        else:
            time.sleep(0.002)  # a busy wait here took a core from the source process
    held = source.call("freeze", request.request_id)
    assert held[: len(streamed)] == streamed and len(held) >= after
    moved = replace(request, output_token_ids=held, kv_receive=True)
    assert source.call("migrate", request.request_id, target.add_request(moved)) is True
    rest, _ = finish_moved(target, request.request_id, timeout_s)
    return held, rest
