"""``duet bench serve``: a serving benchmark in the spirit of ``vllm bench serve``.

Requests arrive as a Poisson process at ``--rate``; prompts are random token ids of
``--input-len`` tokens (``--shared-prefix`` of them common to all requests in the
shared-prefix workload) and each generates exactly ``--output-len`` tokens (EOS ignored).
Per request it measures TTFT, the time to the second token (in PD mode, when the decode
replica's first decode step is out: the prompt's KV had to arrive first), TPOT (time per
output token after the first), ITL (gaps between streamed tokens) and end-to-end latency, and prints p50/p90/p99 with throughput
and goodput: requests per second that met both the TTFT and the TPOT SLO (vLLM's
definition; DistServe's goodput is the highest rate at which 90% of requests do). Both
divide by the whole run, which ends with the last completion: near capacity, how long a
layout takes to finish what is left after the last arrival (the drain, printed beside them)
decides a few percent of both, however the requests before it fared. ``--json`` keeps each
request's send time, TTFT, TPOT and end-to-end latency too.

Each ``--config`` is brought up with ``duet up``, measured, and taken down, so a PD and a
colocated config run in one invocation on the same machine, and the ratios to the first
config are printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from duet.benchmarks.plots import saved_figure

SAFE_TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of SmolLM2's tokenizer, no special tokens


@dataclass
class RequestResult:
    ok: bool
    sent_s: float = 0.0  # seconds after the run's first request
    ttft: float = 0.0
    tt2t: float = 0.0  # time to the second token
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class Summary:
    config: str
    workload: str
    num_requests: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float
    drain_s: float  # from the last request's sending to the run's end (the last completion)
    percentiles: dict[str, dict[str, float]]
    requests: list[dict[str, float | bool]]  # each one's send time (s), whether it completed, TTFT, TPOT, end to end (ms), in sending order


def make_prompts(num: int, input_len: int, shared_prefix: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(input_len - shared_prefix)] for _ in range(num)]


async def _one_request(client, url: str, model: str, prompt: list[int], output_len: int, api_key: str | None) -> RequestResult:
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "return_token_ids": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                tokens = len(chunk["choices"][0].get("token_ids") or [])
                if not tokens:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.extend([(now - last) / tokens] * tokens)
                if result.output_tokens < 2 <= result.output_tokens + tokens:
                    result.tt2t = now - start
                last = now
                result.output_tokens += tokens
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens == output_len
        if not result.ok:
            result.error = f"{result.output_tokens} tokens instead of {output_len}"
    except Exception as error:  # noqa: BLE001 - one failed request is a data point
        result.error = repr(error)
    return result


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int, api_key: str | None, label: str):
    import httpx

    rng = random.Random(seed)
    progress = tqdm(total=len(prompts), desc=label, unit="req", leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:

        async def tracked(prompt):
            sent_s = time.perf_counter() - start
            result = await _one_request(client, url, model, prompt, output_len, api_key)
            result.sent_s = sent_s
            progress.update(1)
            return result

        # Warm up the path (and the prefix cache's bookkeeping) with one request outside the measurement.
        await _one_request(client, url, model, [SAFE_TOKEN_RANGE[0]] * 8, 4, api_key)
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(tracked(prompt)))
            await asyncio.sleep(rng.expovariate(rate) if rate > 0 else 0)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return results, duration


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


def summarise(config: str, workload: str, results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float) -> Summary:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and r.tpot <= slo_tpot]
    return Summary(
        config=config,
        workload=workload,
        num_requests=len(results),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        goodput=len(good) / duration,
        drain_s=duration - max((r.sent_s for r in results), default=0.0),
        percentiles={
            "ttft_ms": _percentiles([r.ttft * 1e3 for r in ok]),
            "tt2t_ms": _percentiles([r.tt2t * 1e3 for r in ok]),
            "tpot_ms": _percentiles([r.tpot * 1e3 for r in ok]),
            "itl_ms": _percentiles([gap * 1e3 for r in ok for gap in r.itls]),
            "e2e_ms": _percentiles([r.e2e * 1e3 for r in ok]),
        },
        requests=[
            {"sent_s": r.sent_s, "ok": r.ok, "ttft_ms": r.ttft * 1e3, "tpot_ms": r.tpot * 1e3, "e2e_ms": r.e2e * 1e3} for r in results
        ],
    )


def format_table(summaries: list[Summary]) -> str:
    lines = []
    header = f"{'config':<22} {'workload':<20} {'ok/all':>7} {'req/s':>6} {'tok/s':>7} {'goodput':>7} {'drain s':>7}"
    for metric in ("ttft_ms", "tt2t_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        header += f" {metric[:-3] + ' p50/p90/p99 ms':>24}"
    lines.append(header)
    for s in summaries:
        row = (
            f"{s.config:<22} {s.workload:<20} {s.num_requests - s.failed:>3}/{s.num_requests:<3} "
            f"{s.request_throughput:>6.2f} {s.output_throughput:>7.1f} {s.goodput:>7.2f} {s.drain_s:>7.2f}"
        )
        for metric in ("ttft_ms", "tt2t_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            p = s.percentiles[metric]
            row += f" {p['p50']:>7.0f}/{p['p90']:>7.0f}/{p['p99']:>7.0f}"
        lines.append(row)
    return "\n".join(lines)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def format_ratios(summaries: list[Summary]) -> str:
    """Each config against the first, per workload: >1 means better for throughput and goodput,
    and for latencies (baseline / this)."""
    lines = []
    baseline = {s.workload: s for s in summaries if s.config == summaries[0].config}
    for s in summaries:
        base = baseline.get(s.workload)
        if base is None or s is base:
            continue
        lines.append(
            f"{s.config} vs {base.config} ({s.workload}): throughput x{ratio(s.output_throughput, base.output_throughput):.2f}, "
            f"goodput x{ratio(s.goodput, base.goodput):.2f}, "
            f"TTFT p50 x{ratio(base.percentiles['ttft_ms']['p50'], s.percentiles['ttft_ms']['p50']):.2f}, "
            f"TT2T p50 x{ratio(base.percentiles['tt2t_ms']['p50'], s.percentiles['tt2t_ms']['p50']):.2f}, "
            f"TPOT p50 x{ratio(base.percentiles['tpot_ms']['p50'], s.percentiles['tpot_ms']['p50']):.2f}, "
            f"ITL p90 x{ratio(base.percentiles['itl_ms']['p90'], s.percentiles['itl_ms']['p90']):.2f}, "
            f"E2E p50 x{ratio(base.percentiles['e2e_ms']['p50'], s.percentiles['e2e_ms']['p50']):.2f}  (>1 = better)"
        )
    return "\n".join(lines)


def plot(summaries: list[Summary], path: str) -> None:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], help="a config to bring up and measure (repeat to compare)")
    parser.add_argument("--url", default=None, help="measure a running server instead of --config")
    parser.add_argument("--name", default="server", help="what to call the server of --url in the results")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--rate", default="0.5", help="mean arrivals per second (Poisson; 0 = all at once); several, comma separated, run one after another"
    )
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shared-prefix", type=int, default=192, help="common prefix tokens in the shared-prefix workload")
    parser.add_argument("--workloads", default="random,shared-prefix")
    parser.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    args = parser.parse_args(argv)
    if bool(args.config) == bool(args.url):
        parser.error("give one or more --config files, or --url of a running server")

    workloads = {
        "random": 0,
        "shared-prefix": args.shared_prefix,
    }
    chosen = [name.strip() for name in args.workloads.split(",") if name.strip()]
    rates = [float(rate) for rate in args.rate.split(",")]
    summaries = []
    targets = [(Path(config).stem, config) for config in args.config] or [(args.name, None)]
    for name, config in targets:
        url = args.url
        if config is not None:
            from duet.cluster.deploy import down, up

            print(f"bringing up {config} ...", flush=True)
            url = up(config).urls[0]
        try:
            for (index, rate), workload in itertools.product(enumerate(rates), chosen):
                # Fresh prompts at each rate: none finds the last rate's in the prefix cache.
                seed = args.seed + 1000 * index
                prompts = make_prompts(args.num_requests, args.input_len, workloads[workload], seed)
                label = workload if len(rates) == 1 else f"{workload}@{rate:g}/s"
                results, duration = asyncio.run(
                    run_load(url, args.model, prompts, args.output_len, rate, seed, args.api_key, f"{name}/{label}")
                )
                summary = summarise(name, label, results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
                summaries.append(summary)
                errors = {r.error for r in results if not r.ok}
                print(f"{name}/{label}: {summary.num_requests - summary.failed}/{summary.num_requests} ok" + (f", errors: {sorted(errors)[:3]}" if errors else ""), flush=True)
        finally:
            if config is not None:
                down()
    print()
    print(f"{args.num_requests} requests at {args.rate}/s, {args.input_len} prompt + {args.output_len} output tokens; "
          f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms")
    print(format_table(summaries))
    ratios = format_ratios(summaries)
    if ratios:
        print(ratios)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in summaries], indent=2))
    if args.plot:
        plot(summaries, args.plot)
