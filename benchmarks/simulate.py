"""``duet simulate``: ``duet bench serve``'s load run on a model of a config's cluster, in
simulated time, from a profile (``duet profile``) of its engines' steps.

    duet simulate --profile profile.json --config configs/local-pd.yaml [--config ...] --rate 1,2
                  [duet bench serve's load options] [--json out.json] [--measured real.json] [--plot out.png]

What runs is the code's own decision logic, with simulated time for a clock:

- each replica is a real ``Scheduler`` and ``KVCacheManager`` (continuous batching, chunked
  prefill under the token budget, the prefix cache, preemption, the blocks a transfer reserves
  and holds) and ``LoadTracker``; its steps take the time the profile's fits give for the tokens
  and contexts each step computes, instead of running a model;
- the router admits up to ``max_running_sequences``, and its waiting room asks the stage
  balancer (``duet.router.balance``, on the replicas' reports every ``ROUTING_STATS_PERIOD_S``)
  where each context is computed, or the threshold rule alone without ``adaptive_local_prefill``;
  a prompt through PD goes to the prefill replica with the fewest prompt tokens pending, its KV
  reserved on the decode replica with the fewest sequences and sent when its first token is out
  (the profile's transfer fit; free without one).

Its output is ``duet bench serve``'s table and JSON, from the same sessions and arrival times
(same seeds); ``--measured`` takes a ``duet bench serve --json`` of the same runs and prints each
figure's error (``--plot``: predicted against measured).

Replicas on one machine slow each other's steps (cores, caches, memory bandwidth): a step is
slowed by the profile's ratio beside busy engines (``duet profile``'s neighbours), in proportion
to how many of the other replicas are stepping when it starts. The serving path (the router,
Serve's proxy and controller, Ray, the replicas' threads beside their engines) takes cores from
them: with a profile measured ``--serving``, a step starting while the engines' threads stepping
do not fit in the cores the serving path leaves (its idle base, and its CPU per request, prompt
token and streamed token over the last second; through PD a context's prompt tokens count when
its KV moves, the transfer being most of that CPU) takes longer in proportion
(``sim_model.cpu_stretch``), and a request reaches the router's admission after the path's
latency measured alone (its calls to the pools, the first token's way back).

A pool that drafts decodes by its profile's two figures (``duet profile``'s speculation: its
engine decoding random prompts with its drafts, at each of several batches): each decoding
sequence verifies drafts through the engine's own scheduler (they take the step's token budget),
a step of ``B`` of them gives each the tokens a step gave there at that batch, the fraction
carried to its next step, and each drafting row costs what verifying them cost, in steps with
prompt chunks too; the drafts' text is not modelled, and the figures hold for text like the
profile's.

An autoscaled pool's policy decides in simulated time as Serve's controller runs it
(``sim_scale``: the code's own ``decide``, Serve's delays and bounds, a new replica serving
once it has had ``--replica-start-s`` of a core); ``--phases`` runs ``duet bench autoscale``'s
phased load instead of ``--rate`` and prints its per-phase figures (``sim_phases``). Roles
move with load as the router's keeper moves them (``sim_roles``: its own ``plan``), and
sequences move by KV as they do (``sim_moves``: off a replica leaving its pool, the keeper's
shedding).

Not modelled yet: prefix-affinity routing (least pending prompt tokens instead); calls on their
way in the decode pool's routing (Serve counts a call from when its router sends it to when it
ends; the simulation ranks on the replicas' own counts); the serving path's latency under
load, and a later token's way to the client (it arrives when its step ends); each ``--rate``
run starts from the pools' starting sizes (``duet bench serve`` runs the rates one after
another on one cluster: ``--phases`` does too).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
from pathlib import Path

from duet.benchmarks.serve import add_load_arguments, chosen_workloads, format_table, run_label, run_seed, summarise
from duet.benchmarks.sim_model import cluster_model
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.sim_scale import DEFAULT_START_S
from duet.benchmarks.workloads import make_sessions, session_arrivals


def main(argv: list[str] | None = None) -> None:
    import time

    parser = argparse.ArgumentParser(prog="duet simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="a `duet profile` JSON of the same config")
    parser.add_argument("--config", action="append", default=[], required=True, help="a config to simulate (repeat to compare)")
    add_load_arguments(parser)
    parser.add_argument("--json", default=None, help="write the summaries here (duet bench serve's format)")
    parser.add_argument("--measured", default=None, help="a `duet bench serve --json` of the same runs: the errors, run by run")
    parser.add_argument("--plot", default=None, help="write a PNG here (with --measured: predicted against measured)")
    parser.add_argument(
        "--phases", default=None,
        help="`duet bench autoscale`'s phases (name:seconds:rate:input_len:output_len, comma separated) instead of --rate: "
        "its per-phase figures and timeline; --measured then takes a `duet bench autoscale --json`",
    )
    parser.add_argument(
        "--replica-start-s", type=float, default=DEFAULT_START_S,
        help="an autoscaled pool's new replica serves this long after its target rose (`duet bench autoscale` shows it)",
    )
    args = parser.parse_args(argv)
    profile = json.loads(Path(args.profile).read_text())
    if args.phases:
        from duet.benchmarks import sim_phases

        sim_phases.run(args, profile)
        return
    chosen = chosen_workloads(parser, args)
    summaries = []
    for config in args.config:
        for label, sessions, arrivals in load_runs(args, chosen):
            started = time.perf_counter()
            simulation = Simulation(cluster_model(config, profile), args.think_time_s, args.replica_start_s)
            results, duration = simulation.run(sessions, arrivals)
            wall = time.perf_counter() - started
            summaries.append(summarise(Path(config).stem, label, results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
            print(f"{Path(config).stem}/{label}: {duration:.1f} s simulated in {wall:.2f} s ({duration / max(wall, 1e-9):.0f}x real time)"
                  + replicas_line(simulation))
    print(f"\nsimulated on {args.profile} ({profile['machine']['cpu']})")
    if "transfer" not in profile:
        print("KV transfers taken as free: the profile has no transfer fit (`duet profile --transfer`)")
    if not profile.get("serving"):
        print("the engines keep every core: the profile has no serving path's CPU (`duet profile --serving`)")
    print(format_table(summaries))
    predicted = [asdict(summary) for summary in summaries]
    if args.json:
        Path(args.json).write_text(json.dumps(predicted, indent=2))
    pairs = []
    if args.measured:
        pairs = matched(predicted, json.loads(Path(args.measured).read_text()))
        print(format_errors(pairs))
    if args.plot and pairs:
        plot_errors(pairs, args.plot)
    elif args.plot:
        from duet.benchmarks.serve_plots import plot

        plot(summaries, args.plot)


def replicas_line(simulation: Simulation) -> str:
    """The autoscaled pools' replicas over the run: each pool's least and most, and the
    replica-seconds of all pools (empty for fixed pools)."""
    from duet.benchmarks.autoscale import replica_seconds

    samples = simulation.autoscaling.samples if simulation.autoscaling is not None else []
    if not samples:
        return ""
    pools = ", ".join(f"{pool} {min(s.running[pool] for s in samples)}-{max(s.running[pool] for s in samples)}" for pool in samples[0].running)
    return f"; replicas {pools}, {replica_seconds(samples, 0.0, samples[-1].at):.0f} replica-s"


def load_runs(args: argparse.Namespace, workloads: list[str]) -> list[tuple[str, list, list[float]]]:
    """``duet bench serve``'s runs for ``add_load_arguments``' options: each rate's and workload's
    label, sessions and arrival times, from the seeds ``duet bench serve`` uses."""
    rates = [float(rate) for rate in args.rate.split(",")]
    runs = []
    for (index, rate), workload in itertools.product(enumerate(rates), workloads):
        seed = run_seed(args, index, workload)
        sessions = make_sessions(args, workload, seed)
        runs.append((run_label(workload, rate, rates), sessions, session_arrivals(sessions, rate, seed)))
    return runs


# What a prediction is checked on: (label, where in a summary).
COMPARED = (
    ("TTFT p50", ("percentiles", "ttft_ms", "p50")), ("TTFT p90", ("percentiles", "ttft_ms", "p90")),
    ("TPOT p50", ("percentiles", "tpot_ms", "p50")), ("TPOT p90", ("percentiles", "tpot_ms", "p90")),
    ("E2E p50", ("percentiles", "e2e_ms", "p50")), ("goodput", ("goodput",)), ("req/s", ("request_throughput",)),
)


def _value(summary: dict, path: tuple[str, ...]) -> float:
    for key in path:
        summary = summary[key]
    return float(summary)


def matched(predicted: list[dict], measured: list[dict]) -> list[tuple[dict, dict]]:
    """Predicted and measured summaries of the same config and workload (label), in order."""
    by_run = {(summary["config"], summary["workload"]): summary for summary in measured}
    return [(summary, by_run[key]) for summary in predicted if (key := (summary["config"], summary["workload"])) in by_run]


def errors(pairs: list[tuple[dict, dict]]) -> list[tuple[str, str, list[float | None]]]:
    """Per run: each compared figure's relative error, predicted over measured less one (None where measured is 0)."""
    rows = []
    for predicted, measured in pairs:
        row = []
        for _, path in COMPARED:
            truth = _value(measured, path)
            row.append(None if truth == 0 else _value(predicted, path) / truth - 1)
        rows.append((predicted["config"], predicted["workload"], row))
    return rows


def format_errors(pairs: list[tuple[dict, dict]]) -> str:
    header = f"{'config':<22} {'workload':<20}" + "".join(f" {label:>9}" for label, _ in COMPARED)
    lines = ["predicted against measured (+: the simulation says more):", header]
    for config, workload, row in errors(pairs):
        lines.append(f"{config:<22} {workload:<20}" + "".join(f" {'-' if error is None else f'{error:+.0%}':>9}" for error in row))
    return "\n".join(lines)


def plot_errors(pairs: list[tuple[dict, dict]], path: str) -> None:
    """One panel a figure: each run's predicted value against its measured one, the diagonal and a 10% band."""
    from duet.benchmarks.plots import saved_figure

    columns = 4
    rows = -(-len(COMPARED) // columns)
    with saved_figure(path, figsize=(3.2 * columns, 3.2 * rows), nrows=rows, ncols=columns, squeeze=False) as (figure, grid):
        axes = list(grid.flat)
        for axis in axes[len(COMPARED):]:
            axis.set_visible(False)
        for axis, (label, where) in zip(axes, COMPARED):
            points = [(_value(measured, where), _value(predicted, where), predicted["config"]) for predicted, measured in pairs]
            top = max([max(x, y) for x, y, _ in points] + [1e-9]) * 1.1
            axis.plot([0, top], [0, top], color="gray", linewidth=0.8)
            axis.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="gray", alpha=0.15)
            for config in dict.fromkeys(config for _, _, config in points):
                axis.scatter(*zip(*[(x, y) for x, y, name in points if name == config]), label=config, s=18)
            axis.set(title=label, xlabel="measured", ylabel="predicted", xlim=(0, top), ylim=(0, top))
        axes[0].legend(fontsize=7)
        figure.suptitle("duet simulate against duet bench serve (band: 10%)")
