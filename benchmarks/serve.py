"""``duet bench serve``: a serving benchmark in the spirit of ``vllm bench serve``.

Sessions arrive as a Poisson process at ``--rate`` (a trace's at its own times, scaled to that
mean), each of one request or, in the ``multiturn`` workload, of several sent one after another
(``duet.benchmarks.workloads``): random token ids of ``--input-len`` tokens (``--shared-prefix``
of them common to all requests in the shared-prefix workload), ShareGPT's conversations through
the model's chat template, or a trace's requests; each request generates exactly its output
tokens (``--output-len``, the recorded reply's length capped at ``--sharegpt-output-cap``, or
the trace's, scaled; EOS ignored).
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
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from duet.benchmarks.serve_plots import queue_balance, watch_kv
from duet.benchmarks.workloads import SAFE_TOKEN_RANGE, WORKLOADS, TurnSpec, make_sessions, session_arrivals


WARM_UP_PROMPT, WARM_UP_OUTPUT = 8, 4  # the request run_load sends before its load, outside the measurement


@dataclass
class RequestResult:
    ok: bool
    turn: int = 0  # its place in its session (0: the first)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the server's prefix cache (as its usage reports)
    sent_s: float = 0.0  # seconds after the run's first request
    ttft: float = 0.0
    tt2t: float = 0.0  # time to the second token
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # what it generated

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
    # First turns and later turns apart: TTFT p50 (ms) and the share of prompt tokens found cached.
    turns: dict[str, dict[str, float]] = field(default_factory=dict)
    # The server's KV blocks in use and in its second tier, per stage, sampled once a second.
    kv_timeline: list[dict] = field(default_factory=list)


async def _one_request(client, url: str, model: str, prompt: list[int], output_len: int, api_key: str | None) -> RequestResult:
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True},
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
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if not chunk.get("choices"):
                    continue
                result.token_ids += chunk["choices"][0].get("token_ids") or []
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


async def run_load(
    url: str, model: str, sessions: list[list[TurnSpec]], rate: float, think_time_s: float, seed: int, api_key: str | None, label: str,
    kv_samples: list[dict] | None = None, generated_history: bool = False,
):
    """Sessions arriving at ``rate`` a second (Poisson, or a trace's own times scaled to that
    mean; 0: all at once), each turn sent once the one before it ended and ``think_time_s``
    passed (``generated_history``: with the replies the server generated in its history, where
    the template allows, ``TurnSpec.sent_prompt``); the results of every request, in sending order.
    ``kv_samples`` (if given) gets the server's KV blocks, in its pools and its second tier, once a second."""
    import httpx

    arrivals = session_arrivals(sessions, rate, seed)
    progress = tqdm(total=sum(map(len, sessions)), desc=label, unit="req", leave=False)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:

        async def session(turns: list[TurnSpec]) -> None:
            last = None  # the last turn's prompt and reply, where the history is the generated one
            for index, turn in enumerate(turns):
                if index:
                    await asyncio.sleep(think_time_s)
                sent_s = time.perf_counter() - start
                prompt = turn.sent_prompt(last)
                result = await _one_request(client, url, model, prompt, turn.output_len, api_key)
                result.sent_s, result.turn = sent_s, index
                last = (prompt, result.token_ids) if generated_history else None
                results.append(result)
                progress.update(1)
                if not result.ok:
                    break  # a session whose turn failed goes no further

        # Warm up the path (and the prefix cache's bookkeeping) with one request outside the measurement.
        await _one_request(client, url, model, [SAFE_TOKEN_RANGE[0]] * WARM_UP_PROMPT, WARM_UP_OUTPUT, api_key)
        tasks = []
        start = time.perf_counter()
        stop = asyncio.Event()
        watch = None if kv_samples is None else asyncio.create_task(watch_kv(client, url, start, kv_samples, stop))
        for turns, at_s in zip(sessions, arrivals):
            await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(session(turns)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        if watch is not None:
            await watch
    progress.close()
    return sorted(results, key=lambda result: result.sent_s), duration


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
            {"sent_s": r.sent_s, "ok": r.ok, "turn": r.turn, "ttft_ms": r.ttft * 1e3, "tpot_ms": r.tpot * 1e3, "e2e_ms": r.e2e * 1e3,
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}
            for r in results
        ],
        turns={
            name: {
                "requests": len(group),
                "ttft_p50_ms": _percentiles([r.ttft * 1e3 for r in group])["p50"],
                "prefix_hit_rate": ratio(sum(r.cached_tokens for r in group), sum(r.prompt_tokens for r in group)),
            }
            for name, group in (("first", [r for r in ok if r.turn == 0]), ("later", [r for r in ok if r.turn > 0]))
            if group
        },
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


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load's options, shared with ``duet simulate`` (which runs the same load on a model of the cluster)."""
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--rate", default="0.5", help="mean arrivals per second (Poisson; 0 = all at once); several, comma separated, run one after another"
    )
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shared-prefix", type=int, default=192, help="common prefix tokens in the shared-prefix workload")
    parser.add_argument("--workloads", default="random,shared-prefix", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--tokenizer", default="smollm2", help="the model (alias or directory) whose chat template renders ShareGPT")
    parser.add_argument("--sharegpt-output-cap", type=int, default=128, help="most output tokens of a ShareGPT turn")
    parser.add_argument("--turns", type=int, default=4, help="most turns of a multiturn session (--num-requests sessions)")
    parser.add_argument("--think-time-s", type=float, default=0.0, help="pause before each later turn of a session")
    parser.add_argument("--max-context", type=int, default=2048, help="a ShareGPT turn's (a trace request's) prompt and output fit in this")
    parser.add_argument("--trace", default=None, help="the trace workload's file (JSONL, Mooncake's format)")
    parser.add_argument("--trace-scale", type=float, default=None, help="its lengths' factor (default: its p90 fits --max-context)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)


def chosen_workloads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    chosen = [name.strip() for name in args.workloads.split(",") if name.strip()]
    if unknown := [name for name in chosen if name not in WORKLOADS]:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    if "trace" in chosen and not args.trace:
        parser.error("the trace workload replays --trace FILE (JSONL: timestamp, input_length, output_length, hash_ids)")
    return chosen


def run_seed(args: argparse.Namespace, index: int, workload: str) -> int:
    """Fresh prompts at each rate: none finds the last rate's in the prefix cache (nor, for
    multiturn sessions, the sharegpt workload's first turns)."""
    return args.seed + 1000 * index + (500 if workload == "multiturn" else 0)


def run_label(workload: str, rate: float, rates: list[float]) -> str:
    return workload if len(rates) == 1 else f"{workload}@{rate:g}/s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], help="a config to bring up and measure (repeat to compare)")
    parser.add_argument("--url", default=None, help="measure a running server instead of --config")
    parser.add_argument("--name", default="server", help="what to call the server of --url in the results")
    parser.add_argument("--peer-url", default=None, help="another OpenAI server given the same schedule after the rest (vLLM's, say)")
    parser.add_argument("--peer-name", default="peer", help="what to call it in the results")
    parser.add_argument("--peer-model", default=None, help="its model name (default: --model)")
    add_load_arguments(parser)
    parser.add_argument(
        "--history", choices=("recorded", "generated"), default="recorded",
        help="a multiturn session's replies in its history: ShareGPT's, or those the server generated (as a chat client sends)",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    args = parser.parse_args(argv)
    if bool(args.config) == bool(args.url):
        parser.error("give one or more --config files, or --url of a running server")

    chosen = chosen_workloads(parser, args)

    rates = [float(rate) for rate in args.rate.split(",")]
    summaries = []
    # (name, config to bring up, or the URL and model of a running server)
    targets = [(Path(config).stem, config, None, args.model) for config in args.config] or [(args.name, None, args.url, args.model)]
    if args.peer_url:
        targets.append((args.peer_name, None, args.peer_url, args.peer_model or args.model))
    for name, config, url, model in targets:
        if config is not None:
            from duet.cluster.deploy import down, up

            print(f"bringing up {config} ...", flush=True)
            url = up(config).urls[0]
        try:
            for (index, rate), workload in itertools.product(enumerate(rates), chosen):
                seed, label = run_seed(args, index, workload), run_label(workload, rate, rates)
                kv_samples: list[dict] = []
                results, duration = asyncio.run(
                    run_load(
                        url, model, make_sessions(args, workload, seed), rate, args.think_time_s, seed, args.api_key, f"{name}/{label}",
                        kv_samples, args.history == "generated",
                    )
                )
                summary = summarise(name, label, results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
                summary.kv_timeline = kv_samples
                summaries.append(summary)
                errors = {r.error for r in results if not r.ok}
                print(f"{name}/{label}: {summary.num_requests - summary.failed}/{summary.num_requests} ok" + (f", errors: {sorted(errors)[:3]}" if errors else ""), flush=True)
        finally:
            if config is not None:
                down()
    print()
    generated = {"random", "shared-prefix"} & set(chosen)
    lengths = f"{args.input_len} prompt + {args.output_len} output tokens" if generated else "lengths as recorded (a trace's scaled)"
    history = f" ({args.history} replies in the history)" if "multiturn" in chosen else ""
    print(f"{args.num_requests} requests (sessions) at {args.rate}/s of {', '.join(chosen)}{history}, {lengths}; "
          f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms")
    print(format_table(summaries))
    for summary in summaries:
        if "later" in summary.turns or summary.turns.get("first", {}).get("prefix_hit_rate", 0) > 0:
            print(f"{summary.config} {summary.workload}: " + "; ".join(
                f"{name} turns: {turn['requests']} ok, TTFT p50 {turn['ttft_p50_ms']:.0f} ms, prefix hit rate {turn['prefix_hit_rate']:.2f}"
                for name, turn in summary.turns.items()
            ))
    for summary in summaries:
        balance = queue_balance(summary.kv_timeline)
        if balance:
            print(f"{summary.config} {summary.workload}: prompt tokens queued per replica, the largest mean against the mean: "
                  + ", ".join(f"{pool} {ratio:.2f}" for pool, ratio in sorted(balance.items())))
    ratios = format_ratios(summaries)
    if ratios:
        print(ratios)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in summaries], indent=2))
    if args.plot:
        from duet.benchmarks.serve_plots import plot, plot_kv, plot_turns

        plot(summaries, args.plot)
        stem = str(Path(args.plot).with_suffix(""))
        if any(len({r["turn"] for r in s.requests}) > 1 for s in summaries):
            plot_turns(summaries, stem + "-turns.png")
        plot_kv(summaries, stem + "-kv.png")
