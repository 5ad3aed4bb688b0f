"""``duet simulate --phases``: ``duet bench autoscale``'s phased load on a model of a config's
cluster, its autoscaled pools deciding in simulated time (``sim_scale``): the same arrivals and
prompts from the same seed, the same per-phase figures (SLO attainment, replica-seconds, TTFT
and TPOT p90) and timeline plot; ``--measured`` takes a ``duet bench autoscale --json`` of the
same phases and prints each phase's errors."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

from duet.benchmarks.autoscale import Sent, _print_phases, parse_phases, phase_figures, plot, poisson_arrivals, totals
from duet.benchmarks.sim_model import cluster_model
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.workloads import TurnSpec

# What a phase's prediction is checked on: (label, its figure, absolute: a difference, not a ratio).
COMPARED = (
    ("in SLO", "slo_attainment", True), ("replica-s", "replica_seconds", False), ("TTFT p90", "ttft_p90_ms", False),
    ("TPOT p90", "tpot_p90_ms", False), ("failed", "failed", True),
)


def simulate_phases(config: str, profile: dict, phases_text: str, seed: int, start_s: float):
    """``config`` under the phases; the requests sent (``Sent``), the replicas over time and each
    phase's bounds, as ``duet bench autoscale``'s run gives them, and the simulation's wall time."""
    phases = parse_phases(phases_text)
    if any(phase.concurrency for phase in phases):
        raise SystemExit("--phases: closed-loop phases (cN) are not simulated; give each phase a rate")
    rng = random.Random(seed)
    bounds, sessions, arrivals, tags = {}, [], [], []
    began = 0.0
    for phase in phases:
        for offset, prompt in poisson_arrivals(phase, rng):
            sessions.append([TurnSpec(prompt, phase.output_len)])
            arrivals.append(began + offset)
            tags.append(phase.name)
        bounds[phase.name] = (began, began + phase.duration_s)
        began += phase.duration_s
    simulation = Simulation(cluster_model(config, profile), 0.0, start_s)
    started = time.perf_counter()
    results, _ = simulation.run(sessions, arrivals, until=began)
    wall = time.perf_counter() - started
    sent = [Sent(tag, result.sent_s, result) for tag, result in zip(tags, results)]  # both in the order sent
    if simulation.autoscaling is not None:
        for stage in simulation.autoscaling.pools:
            moves = [f"{after} at {at:.1f} s ({reason})" for at, name, _, after, reason in simulation.autoscaling.changes if name == stage]
            print(f"{Path(config).stem}: the {stage} pool's target went to " + (", ".join(moves) if moves else "nothing new"))
    samples = simulation.autoscaling.samples if simulation.autoscaling is not None else []
    return sent, samples, bounds, wall


def run(args, profile: dict) -> None:
    """Each ``--config`` under ``--phases``: the per-phase table, the timeline plot (``--plot``,
    one a config), the JSON (``--json``) and, with ``--measured``, the errors (and ``--plot``: the
    replicas over time, predicted against measured)."""
    report = {}
    for config in args.config:
        sent, samples, bounds, wall = simulate_phases(config, profile, args.phases, args.seed, args.replica_start_s)
        end = max(end for _, end in bounds.values())
        figures = phase_figures(sent, samples, bounds, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        label = Path(config).stem
        print(f"\n{label}: {end:.0f} s simulated in {wall:.2f} s ({end / max(wall, 1e-9):.0f}x real time); "
              f"SLO TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms")
        _print_phases(figures, samples, bounds)
        if args.plot and not args.measured:
            path = args.plot if len(args.config) == 1 else str(Path(args.plot).with_name(f"{Path(args.plot).stem}-{label}.png"))
            plot(sent, samples, bounds, 5.0, path)
        report[label] = {
            "config": config, "phases": figures, "totals": totals(figures), "samples": [dataclasses.asdict(sample) for sample in samples],
        }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())
        print(format_errors(report, measured))
        if args.plot:
            plot_replicas(pairs(report, measured), args.plot)


def plot_replicas(found: list[tuple[str, dict, str, dict]], path: str) -> None:
    """One panel a predicted run: each pool's running replicas over time, measured (solid) and
    predicted (dashed)."""
    from duet.benchmarks.plots import saved_figure

    with saved_figure(path, figsize=(10, 2.8 * len(found)), nrows=len(found), ncols=1, squeeze=False, what="replicas") as (_, grid):
        for axis, (label, run, name, truth) in zip(grid[:, 0], found):
            for index, pool in enumerate(sorted({pool for sample in truth["samples"] for pool in sample["running"]})):
                for samples, style, kind in ((truth["samples"], "-", "measured"), (run["samples"], "--", "simulated")):
                    times = [sample["at"] for sample in samples]
                    counts = [sample["running"].get(pool, 0) + 0.04 * index for sample in samples]
                    axis.step(times, counts, where="post", linestyle=style, color=f"C{index}", label=f"{pool} {kind}")
            axis.set(title=f"{label} against {name}", ylabel="replicas running", xlabel="seconds")
            axis.legend(fontsize=8, loc="upper left")


def pairs(predicted: dict[str, dict], measured: dict) -> list[tuple[str, dict, str, dict]]:
    """Each predicted run beside the measured run of the same config (``duet bench autoscale
    --json``: one run's report, or ``--planned``'s two, each naming its config); a single measured
    run goes beside every predicted one."""
    runs = {"the measured run": measured} if "phases" in measured else measured
    found = []
    for label, run in predicted.items():
        same = {name: truth for name, truth in runs.items() if Path(truth.get("config", "")).stem == Path(run["config"]).stem}
        found += [(label, run, name, truth) for name, truth in (same or (runs if len(runs) == 1 else {})).items()]
    return found


def format_errors(predicted: dict[str, dict], measured: dict) -> str:
    """Per predicted run, beside its measured run, each phase's figures: predicted / measured and
    the error (relative; attainment and failures as a difference)."""
    lines = ["predicted against measured, per phase (predicted / measured, error):"]
    for label, run, name, truth in pairs(predicted, measured):
        lines.append(f"{label} against {name}:")
        lines.append(f"{'phase':<14}" + "".join(f" {title:>22}" for title, _, _ in COMPARED))
        for phase, figures in run["phases"].items():
            real = truth["phases"].get(phase)
            if real is None:
                continue
            cells = []
            for _, key, absolute in COMPARED:
                ours, theirs = figures[key], real[key]
                scale = 100 if key == "slo_attainment" else 1
                if absolute:
                    error = f"{(ours - theirs) * scale:+.0f}"
                else:
                    error = "-" if theirs == 0 else f"{ours / theirs - 1:+.0%}"
                cells.append(f"{ours * scale:.0f} / {theirs * scale:.0f} ({error})")
            lines.append(f"{phase:<14}" + "".join(f" {cell:>22}" for cell in cells))
    return "\n".join(lines)
