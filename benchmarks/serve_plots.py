"""The plots of ``duet bench serve``, and the KV sampling its runs record for them."""

from __future__ import annotations

import asyncio
import time

from duet.benchmarks.plots import saved_figure
from duet.benchmarks.soak import metric_values

# Per stage: KV blocks in the pool, the share in use, blocks in the second tier.
_KV_METRICS = ("duet:kv_cache_blocks", "vllm:kv_cache_usage_perc", "duet:kv_offload_blocks")


async def watch_kv(client, url: str, origin: float, samples: list[dict], stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Until ``stop``: every ``interval_s``, the server's KV blocks in use and in its second tier,
    summed per stage, and each replica's prompt tokens queued or in their prefill, by pool
    (``{"t": seconds since origin, "pool": {stage: blocks}, "tier": {stage: blocks}, "queued":
    {pool: {replica: tokens}}}``, from ``/duet/status``). A server without duet's metrics
    (another OpenAI server) gives empty samples."""
    while not stop.is_set():
        try:
            text = (await client.get(f"{url}/metrics", timeout=5)).text
            blocks, usage, tier = (metric_values(text, name) for name in _KV_METRICS)
            sample = {"t": time.perf_counter() - origin, "pool": {}, "tier": {}, "queued": {}}
            for labels, total in blocks.items():
                stage = _stage(labels)
                sample["pool"][stage] = sample["pool"].get(stage, 0) + total * usage.get(labels, 0.0)
                sample["tier"][stage] = sample["tier"].get(stage, 0) + tier.get(labels, 0.0)
            if blocks:
                status = await client.get(f"{url}/duet/status", timeout=5)
                if status.status_code == 200:
                    for pool, view in status.json()["pools"].items():
                        sample["queued"][pool] = {stats["replica_id"]: stats["prompt_tokens_pending"] for stats in view["stats"]}
            samples.append(sample)
        except Exception:  # noqa: BLE001 - a missed sample is only a gap in the plot
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


def queue_balance(samples: list[dict]) -> dict[str, float]:
    """Per pool of two replicas or more, the largest replica's mean prompt tokens queued over the
    samples against the mean of all of them (1.0: even; #40 asks at most 1.3 of the prefill
    pool); pools that queued nothing are left out."""
    totals: dict[str, dict[str, float]] = {}
    for sample in samples:
        for pool, replicas in sample.get("queued", {}).items():
            for replica, tokens in replicas.items():
                totals.setdefault(pool, {}).setdefault(replica, 0.0)
                totals[pool][replica] += tokens
    balance = {}
    for pool, per_replica in totals.items():
        mean = sum(per_replica.values()) / len(per_replica)
        if len(per_replica) > 1 and mean > 0:
            balance[pool] = max(per_replica.values()) / mean
    return balance


def _stage(labels: str) -> str:
    for part in labels.split(","):
        key, _, value = part.partition("=")
        if key == "stage":
            return value.strip('"')
    return "all"


def plot(summaries: list, path: str) -> None:
    labels = [f"{s.config}\n{s.workload}" for s in summaries]
    # Wider with more bars; labels slanted so that neighbours' never overlap.
    with saved_figure(path, figsize=(max(18, 2 * len(summaries)), 5), ncols=4) as (figure, axes):
        for axis, metric, title in zip(axes[:3], ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT (ms)", "TPOT (ms)", "end-to-end (ms)")):
            width = 0.27
            for offset, quantile in enumerate(("p50", "p90", "p99")):
                xs = [i + (offset - 1) * width for i in range(len(summaries))]
                axis.bar(xs, [s.percentiles[metric][quantile] for s in summaries], width, label=quantile)
            axis.set_xticks(range(len(summaries)), labels, fontsize=7, rotation=45, ha="right")
            axis.set_title(title)
            axis.legend(fontsize=7)
        xs = range(len(summaries))
        axes[3].bar([x - 0.2 for x in xs], [s.request_throughput for s in summaries], 0.4, label="throughput (req/s)")
        axes[3].bar([x + 0.2 for x in xs], [s.goodput for s in summaries], 0.4, label="goodput (req/s)")
        axes[3].set_xticks(list(xs), labels, fontsize=7, rotation=45, ha="right")
        axes[3].set_title("throughput and goodput")
        axes[3].legend(fontsize=7)


def plot_turns(summaries: list, path: str) -> None:
    """Sessions' runs by turn: TTFT p50 and the share of prompt tokens found cached, a line per
    config and workload (a conversation's later turns are where a prefix cache, and a second KV
    tier behind it, pay)."""
    from duet.benchmarks.serve import _percentiles, ratio

    with saved_figure(path, figsize=(11, 4), ncols=2, what="turns plot") as (figure, (ttft_axis, hit_axis)):
        for s in summaries:
            ok = [r for r in s.requests if r["ok"]]
            turns = sorted({r["turn"] for r in ok})
            by_turn = [[r for r in ok if r["turn"] == turn] for turn in turns]
            label = f"{s.config} {s.workload}"
            ttft_axis.plot([t + 1 for t in turns], [_percentiles([r["ttft_ms"] for r in group])["p50"] for group in by_turn], marker="o", label=label)
            hit_axis.plot(
                [t + 1 for t in turns],
                [ratio(sum(r["cached_tokens"] for r in group), sum(r["prompt_tokens"] for r in group)) for group in by_turn],
                marker="o", label=label,
            )
        turns = sorted({r["turn"] + 1 for s in summaries for r in s.requests})
        for axis, title in ((ttft_axis, "TTFT p50 (ms) by turn"), (hit_axis, "prompt tokens found cached, by turn")):
            axis.set_xticks(turns)
            axis.set_xlabel("turn")
            axis.set_title(title)
            axis.legend(fontsize=7)


def plot_kv(summaries: list, path: str) -> None:
    """Each run's KV blocks in use in the pools and held in the second tier over time, per stage."""
    runs = [s for s in summaries if any(sample["pool"] for sample in s.kv_timeline)]  # another server reports none
    if not runs:
        return
    with saved_figure(path, figsize=(5 * len(runs), 3.5), ncols=len(runs), squeeze=False, what="KV plot") as (figure, axes):
        for axis, s in zip(axes[0], runs):
            stages = sorted({stage for sample in s.kv_timeline for stage in sample["pool"]})
            for stage in stages:
                times = [sample["t"] for sample in s.kv_timeline]
                axis.plot(times, [sample["pool"].get(stage, 0) for sample in s.kv_timeline], label=f"{stage}: pool, in use")
                if any(sample["tier"].get(stage, 0) for sample in s.kv_timeline):
                    axis.plot(times, [sample["tier"].get(stage, 0) for sample in s.kv_timeline], linestyle="--", label=f"{stage}: tier")
            axis.set_xlabel("seconds")
            axis.set_ylabel("KV blocks")
            axis.set_title(f"{s.config} {s.workload}", fontsize=9)
            axis.legend(fontsize=7)
