"""``duet bench autoscale``: a phased load against an autoscaled cluster, and what each pool did.

Three phases, each a Poisson arrival process of fresh random prompts: prompt-heavy (long
prompts, one output token: the prefill pool's load), decode-heavy (short prompts, long outputs:
the decode pool's), then idle. A phase's rate written ``cN`` is a closed loop instead: N clients,
each sending its next request when its last one ended. Twice a second it reads ``/duet/status``: the replicas running
and the target of each pool's policy. It prints per phase the goodput (requests that met the
TTFT and TPOT SLO, per second of the phase), the SLO attainment (their share of the phase's
requests), the replica-seconds the pools ran and the requests that failed (there should be
none), and plots a timeline PNG: replicas per pool, offered and completed requests per second,
and TTFT and TPOT p90 per window, above them each replica's role (the one it serves: its pool's,
or the other's, ``duet.router.roles``) and threads.

With ``--planned PROFILE`` it runs the phases twice, on the config as it is (the reactive
policies) and with each autoscaled pool sized ahead by the profile (``duet.cluster.capacity``),
the same seed and so the same arrivals, and prints the two runs' SLO attainment and
replica-seconds side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from pathlib import Path

from duet.benchmarks.plots import saved_figure
from duet.benchmarks.serve import WARM_UP_OUTPUT, WARM_UP_PROMPT, RequestResult, _one_request
from duet.benchmarks.workloads import SAFE_TOKEN_RANGE


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # requests per second
    input_len: int
    output_len: int
    concurrency: int = 0  # clients in a closed loop instead (rate 0)


@dataclasses.dataclass
class Sample:
    at: float
    running: dict[str, int]  # replicas reporting, per pool
    target: dict[str, int]  # the policy's latest target, per pool
    roles: dict[str, list] = dataclasses.field(default_factory=dict)  # replica id -> [pool, role it serves, threads]


@dataclasses.dataclass
class Sent:
    phase: str
    start: float  # seconds since the run began
    result: RequestResult


def poisson_arrivals(phase: Phase, rng: random.Random) -> list[tuple[float, list[int]]]:
    """A rate phase's requests: (seconds into the phase, a fresh random prompt), Poisson at its
    rate (``duet simulate --phases`` sends the same, from the same seed)."""
    requests, at = [], 0.0
    while phase.rate > 0:
        at += rng.expovariate(phase.rate)
        if at >= phase.duration_s:
            break
        requests.append((at, [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(phase.input_len)]))
    return requests


def parse_phases(text: str) -> list[Phase]:
    """``name:seconds:rate:input_len:output_len`` separated by commas; a rate ``cN``: N clients
    in a closed loop."""
    phases = []
    for item in text.split(","):
        name, duration, rate, input_len, output_len = item.split(":")
        concurrency = int(rate[1:]) if rate.startswith("c") else 0
        phases.append(Phase(name, float(duration), 0.0 if concurrency else float(rate), int(input_len), int(output_len), concurrency))
    return phases


async def _watch(client, url: str, origin: float, samples: list[Sample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            pools = (await client.get(f"{url}/duet/status", timeout=5)).json()["pools"]
            samples.append(Sample(
                time.perf_counter() - origin,
                {pool: len(info["stats"]) for pool, info in pools.items()},
                {pool: (info.get("autoscaler") or {}).get("target", len(info["stats"])) for pool, info in pools.items()},
                {
                    stats["replica_id"]: [pool, stats.get("stage", pool), stats.get("threads", 0)]
                    for pool, info in pools.items() for stats in info["stats"]
                },
            ))
        except Exception:  # noqa: BLE001 - a missed sample is a gap in the plot
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def run(url: str, model: str, phases: list[Phase], seed: int, api_key: str | None) -> tuple[list[Sent], list[Sample], dict]:
    import httpx

    rng = random.Random(seed)
    sent: list[Sent] = []
    samples: list[Sample] = []
    bounds: dict[str, tuple[float, float]] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        await _one_request(client, url, model, [SAFE_TOKEN_RANGE[0]] * WARM_UP_PROMPT, WARM_UP_OUTPUT, api_key)  # warm the path
        origin = time.perf_counter()
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(client, url, origin, samples, stop))
        tasks = []

        async def one(phase: Phase, prompt: list[int]) -> None:
            start = time.perf_counter() - origin
            result = await _one_request(client, url, model, prompt, phase.output_len, api_key)
            sent.append(Sent(phase.name, start, result))

        async def client_loop(phase: Phase, end: float) -> None:
            while time.perf_counter() - origin < end:
                await one(phase, [rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(phase.input_len)])

        for phase in phases:
            began = time.perf_counter() - origin
            load = f"{phase.concurrency} clients in a closed loop" if phase.concurrency else f"{phase.rate} req/s"
            print(f"[{began:6.1f} s] {phase.name}: {load} of {phase.input_len} + {phase.output_len} tokens "
                  f"for {phase.duration_s:.0f} s", flush=True)
            end = began + phase.duration_s
            tasks += [asyncio.create_task(client_loop(phase, end)) for _ in range(phase.concurrency)]
            for offset, prompt in poisson_arrivals(phase, rng):
                await asyncio.sleep(max(0.0, began + offset - (time.perf_counter() - origin)))
                tasks.append(asyncio.create_task(one(phase, prompt)))
            await asyncio.sleep(max(0.0, end - (time.perf_counter() - origin)))
            bounds[phase.name] = (began, end)
            done = sum(1 for item in sent if item.phase == phase.name)
            print(f"[{end:6.1f} s] {phase.name} over: {done} done so far; replicas {samples[-1].running if samples else '?'}", flush=True)
        await asyncio.gather(*tasks)
        stop.set()
        await watcher
    return sent, samples, bounds


def phase_figures(sent: list[Sent], samples: list[Sample], bounds: dict, slo_ttft: float, slo_tpot: float) -> dict[str, dict]:
    """Per phase: requests sent in it, failed, goodput, SLO attainment (the share of its requests
    within both targets), TTFT and TPOT p90, and the replica-seconds its pools ran."""
    figures = {}
    for name, (began, end) in bounds.items():
        mine = [item.result for item in sent if item.phase == name]
        ok = [result for result in mine if result.ok]
        good = [result for result in ok if result.ttft <= slo_ttft and result.tpot <= slo_tpot]
        figures[name] = {
            "requests": len(mine), "failed": len(mine) - len(ok), "goodput": len(good) / (end - began),
            "slo_attainment": len(good) / len(mine) if mine else 1.0,
            "ttft_p90_ms": _p90([result.ttft * 1e3 for result in ok]), "tpot_p90_ms": _p90([result.tpot * 1e3 for result in ok]),
            "replica_seconds": replica_seconds(samples, began, end),
        }
    return figures


def replica_seconds(samples: list[Sample], began: float, end: float) -> float:
    """The replicas running, all pools together, integrated over ``began``..``end``: each sample's
    count holds until the next sample."""
    total = 0.0
    for sample, following in zip(samples, samples[1:]):
        start, stop = max(sample.at, began), min(following.at, end)
        if stop > start:
            total += sum(sample.running.values()) * (stop - start)
    return total


def _p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.9 * len(values)))] if values else 0.0


ROLE_COLORS = {"prefill": "C0", "decode": "C1", "colocated": "C2"}


def role_segments(samples: list[Sample]) -> dict[str, list[tuple[float, float, str]]]:
    """Per replica (``pool threads replica``), the spans of time it served each role: from one
    sample that saw it to the next."""
    segments: dict[str, list[tuple[float, float, str]]] = {}
    for sample, following in zip(samples, samples[1:]):
        for replica_id, (pool, role, threads) in sample.roles.items():
            label = f"{pool} {replica_id[:8]} ({threads} thr)"
            spans = segments.setdefault(label, [])
            if spans and spans[-1][2] == role and abs(spans[-1][1] - sample.at) < 1e-9:
                spans[-1] = (spans[-1][0], following.at, role)
            else:
                spans.append((sample.at, following.at, role))
    return segments


def _plot_roles(axis, samples: list[Sample]) -> None:
    from matplotlib.patches import Patch

    segments = role_segments(samples)
    for row, (label, spans) in enumerate(sorted(segments.items())):
        for role in ROLE_COLORS:
            bars = [(start, end - start) for start, end, served in spans if served == role]
            if bars:
                axis.broken_barh(bars, (row - 0.35, 0.7), color=ROLE_COLORS[role])
    axis.set_yticks(range(len(segments)), sorted(segments), fontsize=7)
    axis.set_ylabel("role served")
    axis.legend(handles=[Patch(color=color, label=role) for role, color in ROLE_COLORS.items()], fontsize=8, loc="upper right")


def plot(sent: list[Sent], samples: list[Sample], bounds: dict, window_s: float, path: str) -> None:
    end = max([s.at for s in samples] + [item.start + item.result.e2e for item in sent] + [0.0])
    windows = [index * window_s for index in range(int(end // window_s) + 1)]
    with saved_figure(path, figsize=(11, 12), what="timeline", nrows=4, ncols=1, sharex=True) as (figure, every_axis):
        _plot_roles(every_axis[0], samples)
        axes = every_axis[1:]
        for axis in every_axis:
            for index, (name, (began, finish)) in enumerate(bounds.items()):
                axis.axvspan(began, finish, color=f"C{index}", alpha=0.08)
                if axis is every_axis[0]:
                    axis.text((began + finish) / 2, 0.05, name, ha="center", transform=axis.get_xaxis_transform())
        pools = sorted({pool for sample in samples for pool in sample.running})
        for index, pool in enumerate(pools):
            times = [s.at for s in samples]
            axes[0].step(times, [s.running.get(pool, 0) + 0.03 * index for s in samples], where="post", color=f"C{index}", label=f"{pool} running")
            axes[0].step(times, [s.target.get(pool, 0) + 0.03 * index for s in samples], where="post", color=f"C{index}", linestyle="--",
                         label=f"{pool} target")
        axes[0].set_ylabel("replicas")
        axes[0].legend(fontsize=8, loc="upper right")

        def per_window(values: list[tuple[float, float]], reduce) -> list[float]:
            return [reduce([v for at, v in values if start <= at < start + window_s]) for start in windows]

        offered = per_window([(item.start, 1.0) for item in sent], lambda v: len(v) / window_s)
        completed = per_window([(item.start + item.result.e2e, 1.0) for item in sent if item.result.ok], lambda v: len(v) / window_s)
        axes[1].step(windows, offered, where="post", label="offered req/s")
        axes[1].step(windows, completed, where="post", label="completed req/s")
        axes[1].set_ylabel("requests / s")
        axes[1].legend(fontsize=8, loc="upper right")
        done = [item for item in sent if item.result.ok]
        ttft = per_window([(item.start + item.result.e2e, item.result.ttft * 1e3) for item in done], _p90)
        tpot = per_window([(item.start + item.result.e2e, item.result.tpot * 1e3) for item in done if item.result.output_tokens > 1], _p90)
        axes[2].step(windows, ttft, where="post", label="TTFT p90 (ms)")
        axes[2].step(windows, tpot, where="post", label="TPOT p90 (ms)")
        axes[2].set_yscale("symlog", linthresh=100)
        axes[2].set_ylabel(f"ms (requests done per {window_s:.0f} s)")
        axes[2].set_xlabel("seconds")
        axes[2].legend(fontsize=8, loc="upper right")


# Past one replica of each pool on two cores (each pool grows in its phase); at 0.6 and 2 req/s
# the router's balancing kept both within their targets and neither pool grew.
DEFAULT_PHASES = "prompt-heavy:60:1.0:768:1,decode-heavy:60:3:32:256,idle:60:0:0:0"


def planned_config(config: str, profile: str, out: Path) -> str:
    """``config`` with each autoscaled pool sized ahead by ``profile`` (``duet.cluster.capacity``),
    written to ``out``."""
    import yaml

    serve_file = yaml.safe_load(Path(config).read_text())
    for app in serve_file["applications"]:
        for pool in ("prefill", "decode"):
            scaling = ((app.get("args") or {}).get(pool) or {}).get("autoscaling_config")
            if scaling is not None:
                scaling["profile"] = str(Path(profile).resolve())
    out.write_text(yaml.safe_dump(serve_file, sort_keys=False))
    return str(out)


def _drive(args: argparse.Namespace, phases: list[Phase], config: str | None) -> tuple[list[Sent], list[Sample], dict]:
    url = args.url
    if url is None:
        from duet.cluster.deploy import up

        print(f"bringing up {config} ...", flush=True)
        url = up(config).urls[0]
    try:
        return asyncio.run(run(url, args.model, phases, args.seed, args.api_key))
    finally:
        if args.url is None:
            from duet.cluster.deploy import down

            down()


def _print_phases(figures: dict[str, dict], samples: list[Sample], bounds: dict) -> None:
    print(f"{'phase':<14} {'requests':>8} {'failed':>6} {'goodput':>8} {'in SLO':>7} {'TTFT p90':>9} {'TPOT p90':>9} {'replica-s':>9}"
          "  replicas (min-max per pool)")
    for name, (began, end) in bounds.items():
        f = figures[name]
        seen = [s for s in samples if began <= s.at < end]
        pools = seen[0].running if seen else {}
        ranges = ", ".join(f"{pool} {min(s.running.get(pool, 0) for s in seen)}-{max(s.running.get(pool, 0) for s in seen)}" for pool in pools)
        print(f"{name:<14} {f['requests']:>8} {f['failed']:>6} {f['goodput']:>8.2f} {f['slo_attainment']:>7.0%} {f['ttft_p90_ms']:>7.0f}ms "
              f"{f['tpot_p90_ms']:>7.0f}ms {f['replica_seconds']:>9.0f}  {ranges}")


def totals(figures: dict[str, dict]) -> dict[str, float]:
    """A run's phases together: requests, failed, SLO attainment and replica-seconds."""
    requests = sum(f["requests"] for f in figures.values())
    good = sum(f["slo_attainment"] * f["requests"] for f in figures.values())
    return {
        "requests": requests, "failed": sum(f["failed"] for f in figures.values()),
        "slo_attainment": good / requests if requests else 1.0, "replica_seconds": sum(f["replica_seconds"] for f in figures.values()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench autoscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/autoscale.yaml", help="brought up with `duet up` and taken down after")
    parser.add_argument("--url", default=None, help="drive a running cluster instead of --config")
    parser.add_argument(
        "--planned", default=None, metavar="PROFILE",
        help="run the phases again with each autoscaled pool sized ahead by this `duet profile` JSON (the planning policy), "
        "and compare the two runs' SLO attainment and replica-seconds",
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--phases", default=DEFAULT_PHASES, help="name:seconds:rate:input_len:output_len, comma separated")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--plot", default="autoscale.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    phases = parse_phases(args.phases)
    if args.planned and args.url:
        parser.error("--planned brings up --config twice (reactive, then planned): it cannot drive --url")
    runs = [("reactive" if args.planned else Path(args.config).stem, args.config, args.plot)]
    if args.planned:
        planned = planned_config(args.config, args.planned, Path(args.plot).with_name(Path(args.plot).stem + "-planned.yaml"))
        runs.append(("planned", planned, str(Path(args.plot).with_name(Path(args.plot).stem + "-planned.png"))))
    report = {}
    for label, config, plot_path in runs:
        sent, samples, bounds = _drive(args, phases, config)
        figures = phase_figures(sent, samples, bounds, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        print(f"\n{label}: SLO TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms")
        _print_phases(figures, samples, bounds)
        errors = sorted({item.result.error for item in sent if not item.result.ok})
        print(f"failed requests: {totals(figures)['failed']}" + (f" ({errors[:3]})" if errors else ""))
        plot(sent, samples, bounds, args.window_s, plot_path)
        report[label] = {
            "config": config, "phases": figures, "totals": totals(figures),
            "samples": [dataclasses.asdict(sample) for sample in samples],
            "requests": [{"phase": item.phase, "start": item.start} | dataclasses.asdict(item.result) for item in sent],
        }
    if len(report) > 1:
        print(f"\n{'run':<10} {'requests':>8} {'failed':>6} {'in SLO':>7} {'replica-s':>9}")
        for label, run_report in report.items():
            t = run_report["totals"]
            print(f"{label:<10} {t['requests']:>8} {t['failed']:>6} {t['slo_attainment']:>7.1%} {t['replica_seconds']:>9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report if len(report) > 1 else next(iter(report.values())), indent=1))
