"""``duet plan``: the layout of a machine's cores that serves a load best, as ``duet simulate``
predicts it, written as a config ``duet up`` deploys.

    duet plan --profile profile.json --config configs/local-pd.yaml [--config configs/colocated.yaml]
              [--cores N] [--budgets 256,512,1024,2048] [duet bench serve's load options]
              [--top 10] [--json ranking.json] [--out plan.yaml]
    duet plan --devices N --profile tp1.json [--profile tp2.json ...] --config ... (a fleet: benchmarks/fleet.py)

The layouts are those of ``--cores`` (default: the profile's machine's) that the profile's
pools fill, each replica computing on the threads its pool was profiled with:

- colocated: k replicas of the colocated pool (a ``mode: colocated`` config profiled);
- PD: p prefill and d decode replicas, one of each at least (a ``mode: pd`` config profiled);

each at each token budget of ``--budgets`` (``max_num_batched_tokens``: the profile's fits give
a prompt chunk's time at any length). Every layout runs the same sessions and arrival times
(``duet bench serve``'s workloads, seeds and rates) through ``duet simulate``'s model of the
cluster, and they are ranked by goodput (summed over the rates), then fewer cores, then TTFT
p90. The winner is written as its mode's config (the first ``--config`` of that mode) with its
replica counts, its token budget and the SLO it was ranked on.

The ranking is as good as the simulation: what ``duet simulate`` leaves out (its docstring:
autoscaling, roles that move; the serving path's CPU unless the profile was measured
``--serving``) it leaves out too, and a profile says how this machine's engines step, not
another's. Its predictions against measured runs are in docs/benchmarks.md ("duet profile and
duet simulate").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from duet.benchmarks.serve import add_load_arguments, chosen_workloads, summarise
from duet.benchmarks.sim_model import ClusterModel, PoolModel, cluster_model
from duet.benchmarks.sim_run import Simulation
from duet.benchmarks.simulate import load_runs

DEFAULT_BUDGETS = "256,512,1024,2048"


@dataclass(frozen=True)
class Layout:
    """A cluster's pools on a machine: ``mode`` ``pd`` (``prefill`` and ``decode`` replicas) or
    ``colocated`` (``decode`` replicas of the colocated pool), their token budget and the cores
    their threads take."""

    mode: str
    prefill: int
    decode: int
    budget: int
    cores: int

    @property
    def name(self) -> str:
        pools = f"{self.prefill}P+{self.decode}D" if self.mode == "pd" else f"{self.decode} colocated"
        return f"{pools} b{self.budget}"


def layouts(profile: dict, modes: set[str], cores: int, budgets: list[int]) -> list[Layout]:
    """Every layout of ``modes`` whose replicas' threads fit in ``cores``, at each budget."""
    pools = profile["pools"]
    found = []
    if "colocated" in modes and "colocated" in pools:
        threads = pools["colocated"]["num_threads"]
        found += [Layout("colocated", 0, k, budget, k * threads) for k in range(1, cores // threads + 1) for budget in budgets]
    if "pd" in modes and {"prefill", "decode"} <= pools.keys():
        prefill_threads, decode_threads = pools["prefill"]["num_threads"], pools["decode"]["num_threads"]
        for p in range(1, cores // prefill_threads + 1):
            for d in range(1, (cores - p * prefill_threads) // decode_threads + 1):
                found += [Layout("pd", p, d, budget, p * prefill_threads + d * decode_threads) for budget in budgets]
    return found


def model_of(layout: Layout, template: ClusterModel, profile: dict) -> ClusterModel:
    """``template`` (a config of the layout's mode) with the layout's replicas and budget."""

    def pool(stage: str, count: int) -> list[PoolModel]:
        model = PoolModel.from_profile(profile["pools"][stage])
        model.settings = dict(model.settings, max_num_batched_tokens=layout.budget)
        return [model] * count

    if layout.mode == "colocated":
        return dataclasses.replace(template, prefill=[], decode=pool("colocated", layout.decode))
    return dataclasses.replace(template, prefill=pool("prefill", layout.prefill), decode=pool("decode", layout.decode))


def evaluate(layout: Layout, template: ClusterModel, profile: dict, runs: list, slo: tuple[float, float], think_time_s: float) -> dict:
    """The layout's simulated runs (``runs``: label, sessions, arrival times) summarised."""
    summaries = []
    for label, sessions, arrivals in runs:
        results, duration = Simulation(model_of(layout, template, profile), think_time_s).run(sessions, arrivals)
        summaries.append(summarise(layout.name, label, results, duration, *slo))
    return {
        "layout": dataclasses.asdict(layout),
        "name": layout.name,
        "goodput": sum(summary.goodput for summary in summaries),
        "ttft_p90_ms": max(summary.percentiles["ttft_ms"]["p90"] for summary in summaries),
        "tpot_p90_ms": max(summary.percentiles["tpot_ms"]["p90"] for summary in summaries),
        "failed": sum(summary.failed for summary in summaries),
        "runs": [
            {"workload": s.workload, "goodput": s.goodput, "slo_attainment": attainment(s, *slo), "percentiles": s.percentiles}
            for s in summaries
        ],
    }


def attainment(summary, slo_ttft_s: float, slo_tpot_s: float) -> float:
    """The share of a run's requests that finished within both SLOs (DistServe's measure)."""
    good = [r for r in summary.requests if r["ok"] and r["ttft_ms"] <= slo_ttft_s * 1e3 and r["tpot_ms"] <= slo_tpot_s * 1e3]
    return len(good) / max(1, len(summary.requests))


def ranked(evaluations: list[dict]) -> list[dict]:
    """Most goodput first; on a tie, fewer cores, then the lower TTFT p90."""
    return sorted(evaluations, key=lambda e: (-round(e["goodput"], 6), e["layout"]["cores"], e["ttft_p90_ms"]))


def write_config(template_path: str, layout: Layout, slo_ms: tuple[float, float], header: str, out: str) -> None:
    """The template config with the layout's replica counts (fixed: its autoscaling taken out),
    token budget and SLO."""
    import yaml

    raw = yaml.safe_load(Path(template_path).read_text())
    args = raw["applications"][0].setdefault("args", {})
    args.setdefault("engine", {})["max_num_batched_tokens"] = layout.budget
    args["slo"] = {"ttft_ms": slo_ms[0], "tpot_ms": slo_ms[1]}
    counts = {"prefill": layout.prefill, "decode": layout.decode} if layout.mode == "pd" else {"decode": layout.decode}
    for stage, count in counts.items():
        pool = args[stage] = args.get(stage) or {}
        pool.pop("autoscaling_config", None)
        pool["num_replicas"] = count
        if "max_num_batched_tokens" in (pool.get("engine") or {}):
            pool["engine"]["max_num_batched_tokens"] = layout.budget
    Path(out).write_text(header + yaml.safe_dump(raw, sort_keys=False))


def format_ranking(ranking: list[dict], top: int) -> str:
    lines = [f"{'rank':>4}  {'layout':<22} {'cores':>5} {'goodput':>8} {'TTFT p90 ms':>12} {'TPOT p90 ms':>12} {'failed':>6}"]
    for index, evaluation in enumerate(ranking[:top], 1):
        lines.append(
            f"{index:>4}  {evaluation['name']:<22} {evaluation['layout']['cores']:>5} {evaluation['goodput']:>8.2f} "
            f"{evaluation['ttft_p90_ms']:>12.0f} {evaluation['tpot_p90_ms']:>12.0f} {evaluation['failed']:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="duet plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="append", required=True,
                        help="a `duet profile` JSON of the configs (with --devices: one per TP size, repeated)")
    parser.add_argument("--devices", type=int, default=None,
                        help="plan a fleet of this many devices by the capacity arithmetic instead of simulating (benchmarks/fleet.py)")
    parser.add_argument("--kv-usage", type=float, default=0.7, help="with --devices: the share of a decode replica's KV blocks planned for")
    parser.add_argument("--config", action="append", default=[], required=True,
                        help="a profiled config: the template of its mode's layouts (repeat: pd and colocated)")
    parser.add_argument("--cores", type=int, default=None, help="cores to lay out (default: the profile's machine's)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help="token budgets (max_num_batched_tokens) to try, comma separated")
    add_load_arguments(parser)
    parser.add_argument("--top", type=int, default=10, help="layouts shown")
    parser.add_argument("--json", default=None, help="write the whole ranking here")
    parser.add_argument("--out", default="plan.yaml", help="the winner's config")
    args = parser.parse_args(argv)
    workloads = chosen_workloads(parser, args)
    if args.devices is not None:
        from duet.benchmarks import fleet

        return fleet.main(args, parser, load_runs(args, workloads))
    if len(args.profile) > 1:
        parser.error("one --profile (several, one per TP size, only with --devices)")
    args.profile = args.profile[0]
    profile = json.loads(Path(args.profile).read_text())
    cores = args.cores or profile["machine"]["cores"]
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    templates: dict[str, tuple[str, ClusterModel]] = {}
    for path in args.config:
        model = dataclasses.replace(cluster_model(path, profile), ttft_s=slo[0], tpot_s=slo[1], cores=cores)
        templates.setdefault("colocated" if model.colocated else "pd", (path, model))
    candidates = layouts(profile, set(templates), cores, [int(budget) for budget in args.budgets.split(",")])
    if not candidates:
        parser.error(f"no layout of {', '.join(templates)} fits {cores} cores with the profile's pools")
    runs = load_runs(args, workloads)
    evaluations = [
        evaluate(layout, templates[layout.mode][1], profile, runs, slo, args.think_time_s)
        for layout in tqdm(candidates, desc="duet plan: layouts simulated", unit="layout")
    ]
    ranking = ranked(evaluations)
    print(f"\n{len(candidates)} layouts of {cores} cores, {', '.join(label for label, _, _ in runs)}, "
          f"SLO TTFT {args.slo_ttft_ms:g} ms and TPOT {args.slo_tpot_ms:g} ms; on {args.profile} ({profile['machine']['cpu']})")
    print(format_ranking(ranking, args.top))
    best = Layout(**ranking[0]["layout"])
    header = (
        f"# duet plan: {best.name} on {best.cores} of {cores} cores ({profile['machine']['cpu']}), first of "
        f"{len(candidates)} layouts by simulated goodput\n# for {', '.join(label for label, _, _ in runs)} "
        f"({args.num_requests} requests a run); from {args.profile} and {templates[best.mode][0]}\n"
    )
    write_config(templates[best.mode][0], best, (args.slo_ttft_ms, args.slo_tpot_ms), header, args.out)
    print(f"\nthe first layout's config: {args.out} (`duet up {args.out}`)")
    if args.json:
        Path(args.json).write_text(json.dumps(ranking, indent=2))


if __name__ == "__main__":
    main()
