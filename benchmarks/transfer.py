"""KV transfer throughput against a raw send/recv of one tensor of the same size.

    python -m duet.benchmarks.transfer [--json out.json] [--plot out.png]

Two processes on this machine (gloo on CPU, NCCL between GPUs), SmolLM2's KV layout
(30 layers, 3 KV heads of 64, fp32, blocks of 16). For each prompt length the KV path
moves the blocks of one request (per layer: gather, send, scatter into other block ids,
then an acknowledgement); the raw path sends one contiguous tensor of the same size on
the same kind of pairwise group and waits for the same acknowledgement.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch

from duet.kv_transfer.group import Endpoint, PairGroup, RECEIVER_RANK, SENDER_RANK, connect_store
from duet.kv_transfer.spec import KVSpec
from duet.kv_transfer.transfer import KVReceiver, KVSender

TOKENS = [128, 256, 512, 1024, 2048, 4096]
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
SPEC = KVSpec("smollm2", LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "float32")
NUM_BLOCKS = max(TOKENS) // BLOCK + 8
REPEATS = 3


def _cache() -> torch.Tensor:
    return torch.randn(LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)


def _receiver(conn) -> None:
    receiver = KVReceiver(_cache(), SPEC, timeout_s=60)
    conn.send(receiver.endpoint)
    raw = PairGroup(receiver.store, "raw", RECEIVER_RANK, SPEC, False, 60)
    while (command := conn.recv()) is not None:
        kind, transfer_id, num_blocks = command
        if kind == "kv":
            receiver.expect(transfer_id, list(range(NUM_BLOCKS - num_blocks, NUM_BLOCKS)), "kv")
            while not (results := receiver.poll()):
                time.sleep(0.0005)
            conn.send(results[0].ok)
        else:
            buffer = torch.empty(LAYERS * 2 * KV_HEADS * num_blocks * BLOCK * HEAD_DIM)
            raw.recv(buffer, 0).wait()
            raw.send(torch.zeros(2, dtype=torch.int64), 1).wait()
    receiver.close()


def measure(progress) -> list[dict]:
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=_receiver, args=(child,))
    process.start()
    endpoint: Endpoint = conn.recv()
    sender = KVSender(_cache(), SPEC, timeout_s=60)
    raw = PairGroup(connect_store(endpoint, 60), "raw", SENDER_RANK, SPEC, False, 60)
    records, transfer_id = [], 0
    for tokens in TOKENS:
        num_blocks = tokens // BLOCK
        kv_bytes = LAYERS * 2 * KV_HEADS * num_blocks * BLOCK * HEAD_DIM * 4
        kv_times, raw_times = [], []
        for _ in range(REPEATS + 1):  # the first round builds the groups and warms up
            transfer_id += 1
            conn.send(("kv", transfer_id, num_blocks))
            start = time.perf_counter()
            sender.send(transfer_id, list(range(num_blocks)), endpoint, "kv")
            assert conn.recv(), "KV transfer failed"
            kv_times.append(time.perf_counter() - start)
            payload = torch.randn(kv_bytes // 4)
            conn.send(("raw", 0, num_blocks))
            start = time.perf_counter()
            raw.send(payload, 0).wait()
            raw.recv(torch.zeros(2, dtype=torch.int64), 1).wait()
            raw_times.append(time.perf_counter() - start)
        kv_s, raw_s = min(kv_times[1:]), min(raw_times[1:])
        records.append(
            {
                "tokens": tokens,
                "kv_bytes": kv_bytes,
                "seconds": kv_s,
                "gbps": kv_bytes / kv_s / 1e9,
                "raw_gbps": kv_bytes / raw_s / 1e9,
                "ratio_vs_raw": raw_s / kv_s,
                "overlap_hidden_frac": None,  # filled in by measure_overlap for its prompt length
            }
        )
        progress(tokens)
    conn.send(None)
    process.join(60)
    sender.close()
    return records


OVERLAP_TOKENS = 1024


def measure_overlap(repeats: int = 2) -> dict:
    """Share of the KV transfer hidden behind prefill compute by layer-wise streaming.

    Real SmolLM2 nodes, prefill in a child process: the time from submitting a 1024-token
    prompt until its KV is on the decode replica, when the KV is pulled after the first
    token (``after``) and when it streams during the prefill (``streamed``); the transfer
    alone is the pull's duration. hidden = (after - streamed) / transfer alone, not clipped:
    above 1 means the pull path also paid for its extra round trip to the router's stand-in
    (here, this process) or for noise between the two runs.
    """
    from duet import SamplingParams
    from duet.config import EngineArgs
    from duet.decode_node.node import DecodeNode
    from duet.prefill_node.process import PrefillProcess

    engine_kwargs = dict(model="smollm2", max_model_len=2048)
    prefill = PrefillProcess(engine_kwargs)
    decode = DecodeNode(EngineArgs(**engine_kwargs), "decode-bench")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    timings = {"after": [], "streamed": [], "transfer": []}
    try:
        for run in range(repeats + 1):  # the first round warms up and builds the pair group
            for streamed in (False, True):
                # A different prompt every time: a prefix-cache hit would skip the compute.
                prompt = [(run * 7919 + streamed * 104729 + i * 31) % 40000 + 100 for i in range(OVERLAP_TOKENS)]
                total, transfer = _time_one(prefill, decode, f"o{run}{streamed}", prompt, params, streamed)
                if run:
                    timings["streamed" if streamed else "after"].append(total)
                    if not streamed:
                        timings["transfer"].append(transfer)
    finally:
        prefill.stop()
        decode.close()
    after, streamed, transfer = (min(timings[k]) for k in ("after", "streamed", "transfer"))
    return {"tokens": OVERLAP_TOKENS, "after_s": after, "streamed_s": streamed, "transfer_s": transfer,
            "overlap_hidden_frac": (after - streamed) / transfer}


def _time_one(prefill, decode, request_id, prompt, params, streamed) -> tuple[float, float]:
    """(submit to KV admitted on decode, pull duration) for one request."""
    start = time.perf_counter()
    deadline = start + 120
    destination = decode.reserve(request_id, prompt, params, prefill.node_id) if streamed else None
    prefill.submit(request_id, prompt, params, destination)
    pulled_at, transfer_started = None, streamed
    while not (transfer_started and decode.pending_transfers == 0):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"request {request_id} did not reach the decode node in 120 s")
        result = prefill.receive()
        if result is not None and streamed:
            decode.set_first_token(request_id, result.first_token_id)
        elif result is not None:
            pair_key = decode.accept(result.handle, params)
            pulled_at, transfer_started = time.perf_counter(), True
            prefill.send_kv(result.handle.transfer_id, decode.endpoint, pair_key)
        decode.step()
    end = time.perf_counter()
    while decode.engine.has_unfinished_requests():
        decode.step()
    return end - start, (end - pulled_at) if pulled_at is not None else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the records to this JSON file")
    parser.add_argument("--plot", help="also plot GB/s against prompt length to this PNG file")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    with tqdm(total=len(TOKENS) + 1, desc="transfer benchmark", unit="stage") as bar:
        records = measure(lambda _: bar.update())
        overlap = measure_overlap()
        bar.update()
    for record in records:
        if record["tokens"] == overlap["tokens"]:
            record["overlap_hidden_frac"] = overlap["overlap_hidden_frac"]
    print(f"\nKV transfer vs raw send/recv, gloo, SmolLM2 layout ({LAYERS} layers), best of {REPEATS}")
    print(f"{'tokens':>7} {'KV MB':>8} {'KV GB/s':>8} {'raw GB/s':>9} {'ratio':>6}")
    for r in records:
        print(f"{r['tokens']:7d} {r['kv_bytes'] / 1e6:8.1f} {r['gbps']:8.2f} {r['raw_gbps']:9.2f} {r['ratio_vs_raw']:6.2f}")
    print(
        f"layer-wise streaming, SmolLM2 {overlap['tokens']}-token prompt: submit to KV on decode "
        f"{overlap['after_s'] * 1e3:.0f} ms pulled after prefill vs {overlap['streamed_s'] * 1e3:.0f} ms streamed; "
        f"transfer alone {overlap['transfer_s'] * 1e3:.0f} ms, {overlap['overlap_hidden_frac']:.0%} of it hidden"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    if args.plot:
        _plot(records, args.plot)
        print(f"plot written to {args.plot}")


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    tokens = [r["tokens"] for r in records]
    ax.plot(tokens, [r["gbps"] for r in records], marker="o", label="KV transfer (per layer, scattered)")
    ax.plot(tokens, [r["raw_gbps"] for r in records], marker="s", label="raw send/recv, one tensor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s")
    ax.set_title("duet KV transfer over gloo, SmolLM2 layout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
