"""KV transfer throughput against a raw send/recv of one tensor of the same size; and what the
second KV tier (``kv_offload``) takes to restore a prompt's blocks.

    python -m duet.benchmarks.transfer [--json out.json] [--plot out.png] [--tier-only]

Two processes on this machine (gloo on CPU, NCCL between GPUs), SmolLM2's KV layout
(30 layers, 3 KV heads of 64, fp32, blocks of 16), each computing on half of the machine's
cores, as a prefill and a decode replica sharing it do. For each prompt length the KV path
moves the blocks of one request (per run of layers: gather, send, scatter into other block
ids, then an acknowledgement), through shared memory as two processes on one machine do by
default (``kv_transfer/shm.py``) and over the socket (``shared_memory: false``, as between
machines); the raw path sends one contiguous tensor of the same size on the same kind of
pairwise group and waits for the same acknowledgement, received into a buffer the receiver
already holds (warm: the floor a socket transfer is held to) and into one it allocates for the
message (fresh: its pages are first written as the bytes arrive).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

from duet.benchmarks.plots import saved_figure
from duet.engine_loop import BUSY_POLL_S
from duet.kv_transfer.group import RECEIVER_RANK, SENDER_RANK, PairGroup, connect_store
from duet.kv_transfer.progress import LayerProgress
from duet.kv_transfer.receiver import KVReceiver
from duet.kv_transfer.sender import KVSender
from duet.kv_transfer.spec import KVSpec
from duet.messages import KVEndpoint

TOKENS = [128, 256, 512, 1024, 2048, 4096]
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
SPEC = KVSpec("smollm2", LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "float32")
NUM_BLOCKS = max(TOKENS) // BLOCK + 8
REPEATS = 3
THREADS = max(1, (os.cpu_count() or 2) // 2)  # each side's compute threads: half the machine
# A short transfer takes a few ms, and with best of three its figure (and raw's) moved by up to
# 3x between runs on a 2-core Xeon: more rounds for the shorter ones, about the same time each.
REPEATS_TOKENS = 1024


def repeats(tokens: int) -> int:
    """Rounds of each kind of transfer of ``tokens`` (the best one counts)."""
    return max(REPEATS, REPEATS * REPEATS_TOKENS // tokens)


def _cache() -> torch.Tensor:
    return torch.randn(LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)


def _receiver(conn) -> None:
    torch.set_num_threads(THREADS)
    cache = _cache()
    receivers = {kind: KVReceiver(cache, SPEC, timeout_s=60, shared_memory=kind == "kv") for kind in ("kv", "kv-wire")}
    conn.send({kind: receiver.endpoint for kind, receiver in receivers.items()})
    raw = PairGroup(receivers["kv"].store, "raw", RECEIVER_RANK, SPEC, False, 60)
    warm: dict[int, torch.Tensor] = {}
    while (command := conn.recv()) is not None:
        kind, transfer_id, num_blocks = command
        if kind in receivers:
            receiver = receivers[kind]
            receiver.expect(transfer_id, list(range(NUM_BLOCKS - num_blocks, NUM_BLOCKS)))
            while not (results := receiver.poll()):
                time.sleep(0.0005)
            conn.send(results[0].ok)
        else:
            size = LAYERS * 2 * KV_HEADS * num_blocks * BLOCK * HEAD_DIM
            if kind == "warm" and size not in warm:
                warm[size] = torch.zeros(size)
            buffer = torch.empty(size) if kind == "fresh" else warm[size]
            raw.recv(buffer, 0).wait()
            raw.send(torch.zeros(2, dtype=torch.int64), 1).wait()
    for receiver in receivers.values():
        receiver.close()


def measure(progress) -> list[dict]:
    torch.set_num_threads(THREADS)
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=_receiver, args=(child,))
    process.start()
    endpoints: dict[str, KVEndpoint] = conn.recv()
    cache = _cache()
    senders = {kind: KVSender(cache, SPEC, timeout_s=60, shared_memory=kind == "kv") for kind in endpoints}
    raw = PairGroup(connect_store(endpoints["kv"], 60), "raw", SENDER_RANK, SPEC, False, 60)
    records, transfer_id = [], 0
    for tokens in TOKENS:
        num_blocks = tokens // BLOCK
        kv_bytes = LAYERS * 2 * KV_HEADS * num_blocks * BLOCK * HEAD_DIM * 4
        times: dict[str, list[float]] = {"kv": [], "kv-wire": [], "warm": [], "fresh": []}
        payload = torch.randn(kv_bytes // 4)
        for _ in range(repeats(tokens) + 1):  # the first round builds the groups and warms up
            for kind, sender in senders.items():
                transfer_id += 1
                conn.send((kind, transfer_id, num_blocks))
                start = time.perf_counter()
                sender.send(transfer_id, endpoints[kind], LayerProgress.complete(LAYERS, list(range(num_blocks)), 0), num_blocks)
                assert conn.recv(), "KV transfer failed"
                times[kind].append(time.perf_counter() - start)
            for kind in ("warm", "fresh"):
                conn.send((kind, 0, num_blocks))
                start = time.perf_counter()
                raw.send(payload, 0).wait()
                raw.recv(torch.zeros(2, dtype=torch.int64), 1).wait()
                times[kind].append(time.perf_counter() - start)
        kv_s, wire_s, raw_s, fresh_s = (min(times[kind][1:]) for kind in ("kv", "kv-wire", "warm", "fresh"))
        records.append(
            {
                "tokens": tokens,
                "kv_bytes": kv_bytes,
                "seconds": kv_s,
                "gbps": kv_bytes / kv_s / 1e9,
                "raw_gbps": kv_bytes / raw_s / 1e9,
                "ratio_vs_raw": raw_s / kv_s,
                "wire_gbps": kv_bytes / wire_s / 1e9,  # the KV path over the socket (shared_memory: false)
                "wire_ratio_vs_raw": raw_s / wire_s,
                "fresh_raw_gbps": kv_bytes / fresh_s / 1e9,
                "ratio_vs_fresh_raw": fresh_s / kv_s,
                "threads": THREADS,
                "overlap_hidden_frac": None,  # filled in by measure_overlap for its prompt length
            }
        )
        progress(tokens)
    conn.send(None)
    process.join(60)
    for sender in senders.values():
        sender.close()
    return records


OVERLAP_TOKENS = 1024


def measure_overlap(repeats: int = 2) -> dict:
    """Share of the KV transfer hidden behind prefill compute by layer-wise streaming.

    Real SmolLM2 engines, prefill in a child process, decode here, as the cluster runs them:
    the decode engine reserves the blocks first, the prefill engine streams each run of layers
    as its forward writes it. Each computes on half the machine's cores (``THREADS``), as a
    prefill and a decode replica sharing it do. ``streamed``: from submitting a 1024-token
    prompt until the decode engine has its KV and first token; ``prefill``: the same prompt's
    prefill alone (no transfer); ``transfer``: the KV alone, from the throughput measurement.
    hidden = (prefill + transfer - streamed) / transfer, not clipped (noise can push it past 1).
    """
    from duet import SamplingParams
    from duet.config import EngineArgs
    from duet.engine import LLMEngine
    from duet.engine_process import EngineProcess

    engine_kwargs = dict(model="smollm2", max_model_len=2048)
    prefill = EngineProcess(engine_kwargs | {"kv_transfer_config": {"name": "prefill-bench"}}, setup=_half_the_cores)
    torch.set_num_threads(THREADS)
    decode = LLMEngine(EngineArgs(**engine_kwargs, kv_transfer_config={"name": "decode-bench"}))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    timings = {"prefill": [], "streamed": []}
    try:
        for run in range(repeats + 1):  # the first round warms up and builds the pair group
            for streamed in (False, True):
                # A different prompt every time: a prefix-cache hit would skip the compute.
                prompt = [(run * 7919 + streamed * 104729 + i * 31) % 40000 + 100 for i in range(OVERLAP_TOKENS)]
                seconds = _time_one(prefill, decode, f"o{run}{streamed}", prompt, params, streamed)
                if run:
                    timings["streamed" if streamed else "prefill"].append(seconds)
    finally:
        prefill.stop()
        decode.close()
    return {"tokens": OVERLAP_TOKENS, "prefill_s": min(timings["prefill"]), "streamed_s": min(timings["streamed"])}


def _half_the_cores(engine) -> None:
    torch.set_num_threads(THREADS)


def measure_tier(path: str | None = None) -> list[dict]:
    """Milliseconds to restore each prompt length's blocks from a ``KVTierStore`` (host memory,
    or a file under ``path``) into the pool, on ``THREADS`` threads: into consecutive blocks
    (one copy per run, as a prompt's blocks mostly are) and into scattered ones (one per block);
    best of ``REPEATS``."""
    from duet.kv_tier import KVTierStore
    from duet.outputs import KVTierOps

    torch.set_num_threads(THREADS)
    cache = _cache()
    store = KVTierStore(cache, NUM_BLOCKS, path)
    store.apply(KVTierOps(saves=[(block, block) for block in range(NUM_BLOCKS)]))
    records = []
    for tokens in TOKENS:
        num_blocks = tokens // BLOCK
        layouts = {"runs": list(range(num_blocks)), "scattered": list(range(num_blocks))[::-1]}
        record = {"tokens": tokens, "kv_bytes": num_blocks * cache[:, :, :, 0].numel() * cache.element_size()}
        for name, blocks in layouts.items():
            ops = KVTierOps(loads=list(zip(range(NUM_BLOCKS - num_blocks, NUM_BLOCKS), blocks)))
            best = float("inf")
            for _ in range(REPEATS):
                start = time.perf_counter()
                store.apply(ops)
                best = min(best, time.perf_counter() - start)
            record[f"{name}_ms"] = best * 1e3
        records.append(record)
    return records


def _time_one(prefill, decode, request_id, prompt, params, streamed) -> float:
    """Submit to KV (and first token) on the decode engine; without ``streamed``, submit to the
    prefill engine's first token."""
    import dataclasses

    from duet.messages import EngineRequest
    from duet.request import RequestStatus

    request = EngineRequest(request_id, prompt, params)
    start = time.perf_counter()
    deadline = start + 120
    if not streamed:
        prefill.add_request(dataclasses.replace(request, params=dataclasses.replace(params, max_tokens=1)))
        while prefill.receive(0.001) is None:  # waiting, not spinning: a spinning loop takes a core from the prefill
            if time.perf_counter() > deadline:
                raise TimeoutError(f"request {request_id} got no first token in 120 s")
        return time.perf_counter() - start
    destination = decode.add_request(dataclasses.replace(request, kv_receive=True))
    prefill.add_request(dataclasses.replace(request, kv_send=destination))
    waiting = decode.scheduler.requests[request_id]
    while waiting.status == RequestStatus.WAITING_FOR_REMOTE_KV:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"request {request_id} did not reach the decode engine in 120 s")
        if not decode.step():  # nothing to step while the KV comes: poll as a replica's engine loop does, not spin
            time.sleep(BUSY_POLL_S)
    end = time.perf_counter()
    while prefill.receive() is not None or decode.has_unfinished_requests():
        decode.step()
    return end - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench transfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the records to this JSON file")
    parser.add_argument("--plot", help="also plot GB/s against prompt length to this PNG file")
    parser.add_argument("--tier-only", action="store_true", help="only the second KV tier's restore times")
    parser.add_argument("--tier-path", help="a folder: time a disk tier there, beside the host-memory one")
    args = parser.parse_args(argv)
    tiers = {"host memory": measure_tier()} | ({f"disk ({args.tier_path})": measure_tier(args.tier_path)} if args.tier_path else {})
    print(f"\nsecond KV tier: restoring a prompt's blocks, SmolLM2 layout, {THREADS} thread(s), best of {REPEATS}")
    print(f"{'tier':>24} {'tokens':>7} {'KV MB':>8} {'runs ms':>8} {'scattered ms':>13}")
    for name, rows in tiers.items():
        for r in rows:
            print(f"{name:>24} {r['tokens']:7d} {r['kv_bytes'] / 1e6:8.1f} {r['runs_ms']:8.1f} {r['scattered_ms']:13.1f}")
    if args.tier_only:
        return
    from tqdm import tqdm

    with tqdm(total=len(TOKENS) + 1, desc="transfer benchmark", unit="stage") as bar:
        records = measure(lambda _: bar.update())
        overlap = measure_overlap()
        bar.update()
    for record in records:
        if record["tokens"] == overlap["tokens"]:
            overlap["transfer_s"] = record["seconds"]
            overlap["overlap_hidden_frac"] = (overlap["prefill_s"] + record["seconds"] - overlap["streamed_s"]) / record["seconds"]
            record["overlap_hidden_frac"] = overlap["overlap_hidden_frac"]
    rounds = f"best of {repeats(max(TOKENS))}-{repeats(min(TOKENS))} (more for fewer tokens)"
    print(f"\nKV transfer vs raw send/recv over gloo, SmolLM2 layout ({LAYERS} layers), {THREADS} thread(s) a side, {rounds}")
    print("(KV: through shared memory, the default on one machine; KV wire: over the socket; ratios against raw warm)")
    print(f"{'tokens':>7} {'KV MB':>8} {'KV GB/s':>8} {'ratio':>6} {'KV wire':>8} {'ratio':>6} {'raw warm':>9} {'raw fresh':>10}")
    for r in records:
        print(
            f"{r['tokens']:7d} {r['kv_bytes'] / 1e6:8.1f} {r['gbps']:8.2f} {r['ratio_vs_raw']:6.2f} {r['wire_gbps']:8.2f} "
            f"{r['wire_ratio_vs_raw']:6.2f} {r['raw_gbps']:9.2f} {r['fresh_raw_gbps']:10.2f}"
        )
    print(
        f"layer-wise streaming, SmolLM2 {overlap['tokens']}-token prompt: prefill alone {overlap['prefill_s'] * 1e3:.0f} ms, "
        f"transfer alone {overlap['transfer_s'] * 1e3:.0f} ms, submit to KV on decode {overlap['streamed_s'] * 1e3:.0f} ms: "
        f"{overlap['overlap_hidden_frac']:.0%} of the transfer hidden"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    if args.plot:
        _plot(records, args.plot)


def _plot(records: list[dict], path: str) -> None:
    with saved_figure(path, figsize=(7, 3.5)) as (fig, ax):
        tokens = [r["tokens"] for r in records]
        ax.plot(tokens, [r["gbps"] for r in records], marker="o", label="KV transfer, shared memory (one machine)")
        ax.plot(tokens, [r["wire_gbps"] for r in records], marker="x", label="KV transfer over the socket")
        ax.plot(tokens, [r["raw_gbps"] for r in records], marker="s", label="raw send/recv, one tensor, warm buffer")
        ax.plot(tokens, [r["fresh_raw_gbps"] for r in records], marker="^", label="raw send/recv, one tensor, fresh buffer")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("GB/s")
        ax.set_title("duet KV transfer between two processes, SmolLM2 layout")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)


if __name__ == "__main__":
    main()
