"""What a busy holder's streams pay for a conversation's next turn on the history it holds, sent
(the holder computes the turn's new tokens past its cache and sends the whole context's KV) or
pulled (it sends its cached blocks' KV and one token more; the receiver computes the rest).

    duet bench pull [--model smollm2] [--history 1024] [--new 256] [--streams 8] [--threads 1]
                    [--rounds 3] [--json out.json]

The holder is an engine in this process, stepped here (each step timed) while it decodes
``--streams`` sequences; the receiver is an engine in a process of its own. Both compute on
``--threads`` threads, as replicas of one core each do. Per turn: its TTFT (the holder's answer
for a send, the receiver's first token for a pull), the holder's longest step while it serves
the turn against its median step, and whether both ways gave the turn the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

MODES = ("send", "pull")
WARM_STEPS = 20  # decode steps the holder's streams take before the turn comes
TURN_TOKENS = 8


def _tokens(seed: int, length: int, vocab: int) -> list[int]:
    """``length`` token ids of ``seed``'s own, spread over the vocabulary past its first ten."""
    return [10 + (index * 7919 + seed * 104729) % (vocab - 10) for index in range(length)]


def serve_turn(mode: str, holder, receiver, tag: int, round_index: int, args: argparse.Namespace) -> dict:
    """One turn on ``holder`` (busy with its streams), by ``mode``: the round's history (the
    same both ways), ``tag`` naming the requests."""
    from duet import SamplingParams
    from duet.messages import EngineRequest

    vocab = holder.model_config.vocab_size
    history = _tokens(round_index, args.history, vocab)
    holder.add_request(EngineRequest(f"history-{tag}", history, SamplingParams(temperature=0.0, max_tokens=1)))
    while holder.has_unfinished_requests():
        holder.step()
    streams = SamplingParams(temperature=0.0, max_tokens=WARM_STEPS + 80, ignore_eos=True)
    for index in range(args.streams):
        holder.add_request(EngineRequest(f"stream-{tag}-{index}", _tokens(1000 + tag * 64 + index, 30, vocab), streams))
    for _ in range(WARM_STEPS):
        holder.step()
    context = history + _tokens(500 + round_index, args.new, vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS, min_tokens=TURN_TOKENS)
    fill = SamplingParams(temperature=0.0, max_tokens=1)
    request_id = f"turn-{tag}"
    pulled = args.history // holder.block_size * holder.block_size + 1 if mode == "pull" else None
    started = time.perf_counter()
    destination = receiver.add_request(EngineRequest(request_id, context, greedy, kv_receive=True, kv_receive_tokens=pulled))
    holder.add_request(EngineRequest(request_id, context[:pulled], fill, kv_send=destination))
    first, tokens, steps, finished = None, [], [], False
    while not finished or holder.has_unfinished_requests():
        step_start = time.perf_counter()
        for delta in holder.step():
            if delta.request_id == request_id and mode == "send":
                first = first or time.perf_counter() - started
                tokens += delta.token_ids
        steps.append(time.perf_counter() - step_start)
        while (delta := receiver.receive()) is not None:
            assert delta.error is None, delta.error
            if delta.request_id == request_id:
                if delta.token_ids:
                    first = first or time.perf_counter() - started
                tokens += delta.token_ids
                finished = finished or delta.finished
    return {
        "mode": mode, "ttft_ms": 1000 * first, "longest_step_ms": 1000 * max(steps), "median_step_ms": 1000 * statistics.median(steps),
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet bench pull", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--history", type=int, default=1024, help="tokens of the history the holder holds")
    parser.add_argument("--new", type=int, default=256, help="the turn's tokens past its history")
    parser.add_argument("--streams", type=int, default=8, help="sequences the holder decodes meanwhile")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both ways, the order turned each round")
    parser.add_argument("--json", help="also write every turn here")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the receiver's process reads it when it starts
    import torch

    torch.set_num_threads(args.threads)
    from duet.config import EngineArgs
    from duet.engine import LLMEngine
    from duet.engine_process import EngineProcess

    engine = dict(model=args.model, max_model_len=args.history + args.new + 512, kv_cache_memory_gib=1.0, max_num_batched_tokens=2048)
    receiver = EngineProcess(engine | {"kv_transfer_config": {"name": "pull-receiver"}})
    holder = LLMEngine(EngineArgs(**engine | {"kv_transfer_config": {"name": "pull-holder"}}))
    runs = []
    try:
        for round_index in range(args.rounds):
            for mode in MODES if round_index % 2 == 0 else reversed(MODES):
                run = serve_turn(mode, holder, receiver, len(runs), round_index, args) | {"round": round_index}
                runs.append(run)
                print(f"round {round_index} {mode}: turn TTFT {run['ttft_ms']:.1f} ms; the holder's longest step "
                      f"{run['longest_step_ms']:.1f} ms (median {run['median_step_ms']:.1f})", flush=True)
    finally:
        receiver.stop()
        holder.close()
    by_round: dict[int, list[list[int]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], []).append(run["tokens"])
    same = all(len(tokens) == TURN_TOKENS and tokens == turns[0] for turns in by_round.values() for tokens in turns)
    print(f"each round's turn gave the same {TURN_TOKENS} greedy tokens both ways: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0 if same else 1
