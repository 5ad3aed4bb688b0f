"""``duet plan --devices N``: a fleet's layout, by the autoscaler's capacity arithmetic rather than
a simulation, for device counts no simulation searches in time.

    duet plan --devices 1000 --profile h100-tp1.json --profile h100-tp2.json [--profile ...]
              --config configs/local-pd.yaml [--config configs/colocated.yaml]
              [--budgets 512,2048,8192] [duet bench serve's load options: the lengths] [--out plan.yaml]

Each profile is one TP size (``duet profile --roofline ... --tp N``, or a measured one: its pools'
``num_threads`` are the devices a replica takes). The workload's mean prompt and output lengths
(``duet bench serve``'s workloads, as ``duet simulate`` would send them) give, for each pool at
each profile and token budget, the arrivals per second one replica takes within the SLO
(``duet.cluster.capacity``: M/D/1 prefill queues, Little's law for decode batches, both on
colocated replicas, each within 80% of its target). Replicas of a pool are independent queues, so
``k`` of them take ``k`` times that. A PD layout of ``p`` prefill replicas of TP ``a`` and ``d``
decode replicas of TP ``b`` takes ``min(p r_prefill, d r_decode)``; for each pair of TP sizes and
each budget, the best split of the devices is searched in full (one pass over ``p``), and
colocated layouts take ``N`` over the TP size replicas. The layouts are ranked by the rate they
take within the SLO, then fewer devices; the first is written as a config (its mode's
``--config``) with its replica counts, TP sizes and token budget.

What it leaves out (``duet simulate`` does not): the spread of lengths about their means, prompts
batched together (its prefill is one prompt at a time, so it is pessimistic there), chunked
prompts slowing colocated decoding beyond their share of the time, the router's balancing
and the time a step waits for a core. A PD prompt's TTFT counts its KV transfer where the
profile has a transfer fit (a roofline profile's: the link). Its rates are the planning
autoscaler's, the same arithmetic.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from duet.cluster import capacity


@dataclass(frozen=True)
class FleetLayout:
    mode: str  # pd or colocated
    prefill: int  # replicas
    prefill_tp: int
    decode: int  # replicas (colocated: the colocated pool's)
    decode_tp: int
    budget: int
    rate: float  # arrivals per second taken within the SLO
    devices: int

    @property
    def name(self) -> str:
        if self.mode == "colocated":
            return f"{self.decode}x colocated TP{self.decode_tp} b{self.budget}"
        return f"{self.prefill}P TP{self.prefill_tp} + {self.decode}D TP{self.decode_tp} b{self.budget}"


@dataclass(frozen=True)
class PoolRates:
    """One pool of one profile at one budget: its replicas' devices and one replica's rate."""

    devices: int
    rate: float


def pool_rates(profile: dict, budget: int, lengths: tuple[float, float], slo: tuple[float, float], kv_usage: float) -> dict[str, PoolRates]:
    """Each pool of the profile: a replica's devices and the rate it takes at ``budget``."""
    prompt, output = lengths
    ttft_s, tpot_s = slo
    rates = {}
    for stage, pool in profile["pools"].items():
        model = replace(capacity.StageModel.from_profile(profile, stage), budget=budget)
        devices = pool.get("num_threads", 1)
        if stage == "prefill":  # its first token waits for the prompt's KV to reach decode too
            transfer = (profile.get("transfer") or {}).get("fit") or {"base_s": 0.0, "per_token_s": 0.0}
            rate = capacity.prefill_rate(model, prompt, ttft_s - transfer["base_s"] - transfer["per_token_s"] * prompt)
        elif stage == "decode":
            rate = capacity.decode_rate(model, prompt, output, tpot_s, kv_usage)
        else:
            rate = capacity.colocated_rate(model, prompt, output, ttft_s, tpot_s, kv_usage)
        rates[stage] = PoolRates(devices, rate)
    return rates


def best_split(devices: int, prefill: PoolRates, decode: PoolRates) -> tuple[int, int, float]:
    """The PD split of at most ``devices`` that takes the highest rate, fewer devices on a tie:
    ``(prefill replicas, decode replicas, rate)``; ``(0, 0, 0.0)`` when none takes any."""
    best, best_used = (0, 0, 0.0), 0
    if prefill.rate <= 0 or decode.rate <= 0:
        return best
    for p in range(1, devices // prefill.devices + 1):
        room = (devices - p * prefill.devices) // decode.devices
        if room < 1:
            break
        # decode replicas past those that take what p prefill replicas pass on add nothing
        d = min(room, max(1, math.ceil(p * prefill.rate / decode.rate - 1e-9)))
        rate, used = min(p * prefill.rate, d * decode.rate), p * prefill.devices + d * decode.devices
        if rate > best[2] * (1 + 1e-9) or (rate >= best[2] * (1 - 1e-9) and used < best_used):
            best, best_used = (p, d, rate), used
    return best


def fleet_layouts(profiles: list[dict], devices: int, budgets: list[int], lengths, slo, kv_usage: float) -> list[FleetLayout]:
    """The best layout of each mode, pair of TP sizes and budget."""
    found = []
    for budget in budgets:
        rates = [pool_rates(profile, budget, lengths, slo, kv_usage) for profile in profiles]
        for prefill_rates in rates:
            for decode_rates in rates:
                if "prefill" in prefill_rates and "decode" in decode_rates:
                    p_rates, d_rates = prefill_rates["prefill"], decode_rates["decode"]
                    p, d, rate = best_split(devices, p_rates, d_rates)
                    if p:
                        found.append(FleetLayout("pd", p, p_rates.devices, d, d_rates.devices, budget, rate,
                                                 p * p_rates.devices + d * d_rates.devices))
        for colocated in (stage_rates.get("colocated") for stage_rates in rates):
            if colocated is not None and colocated.rate > 0 and devices >= colocated.devices:
                k = devices // colocated.devices
                found.append(FleetLayout("colocated", 0, 0, k, colocated.devices, budget, k * colocated.rate, k * colocated.devices))
    return sorted(found, key=lambda layout: (-round(layout.rate, 9), layout.devices))


def mean_lengths(runs: list) -> tuple[float, float]:
    """The mean prompt and output tokens of the runs' requests (``load_runs``' sessions)."""
    turns = [turn for _, sessions, _ in runs for session in sessions for turn in session]
    return sum(len(turn.prompt) for turn in turns) / len(turns), sum(turn.output_len for turn in turns) / len(turns)


def write_fleet_config(template_path: str, layout: FleetLayout, slo_ms: tuple[float, float], header: str, out: str) -> None:
    """The template with the layout's replica counts (fixed), TP sizes, token budget and SLO."""
    import yaml

    raw = yaml.safe_load(Path(template_path).read_text())
    args = raw["applications"][0].setdefault("args", {})
    args.setdefault("engine", {})["max_num_batched_tokens"] = layout.budget
    args["slo"] = {"ttft_ms": slo_ms[0], "tpot_ms": slo_ms[1]}
    pools = {"decode": (layout.decode, layout.decode_tp)} | ({"prefill": (layout.prefill, layout.prefill_tp)} if layout.mode == "pd" else {})
    for stage, (count, tp) in pools.items():
        pool = args[stage] = args.get(stage) or {}
        pool.pop("autoscaling_config", None)
        pool["num_replicas"] = count
        engine = pool.setdefault("engine", {})
        engine["tensor_parallel_size"] = tp
        engine.pop("max_num_batched_tokens", None)
    Path(out).write_text(header + yaml.safe_dump(raw, sort_keys=False))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser, runs: list) -> None:
    """``duet plan``'s fleet path (``--devices``): ``runs`` are its load's (``load_runs``)."""
    started = time.perf_counter()
    profiles = [json.loads(Path(path).read_text()) for path in args.profile]
    templates = {}
    for path in args.config:
        templates.setdefault(config_mode(path), path)
    lengths = mean_lengths(runs)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    layouts = [
        layout for layout in fleet_layouts(profiles, args.devices, [int(b) for b in args.budgets.split(",")], lengths, slo, args.kv_usage)
        if layout.mode in templates
    ]
    if not layouts:
        parser.error(f"no layout of {', '.join(templates)} takes any rate within the SLO on {args.devices} devices with these profiles")
    seconds = time.perf_counter() - started
    print(f"{len(layouts)} best layouts (one per mode, TP pair and budget) of {args.devices} devices for prompts of "
          f"{lengths[0]:.0f} and outputs of {lengths[1]:.0f} tokens on average, SLO TTFT {args.slo_ttft_ms:g} ms and TPOT "
          f"{args.slo_tpot_ms:g} ms; planned in {seconds:.2f} s")
    print(f"{'rank':>4}  {'layout':<36} {'devices':>7} {'req/s':>9} {'req/s/device':>12}")
    for index, layout in enumerate(layouts[: args.top], 1):
        print(f"{index:>4}  {layout.name:<36} {layout.devices:>7} {layout.rate:>9.2f} {layout.rate / layout.devices:>12.4f}")
    best = layouts[0]
    header = (f"# duet plan --devices {args.devices}: {best.name}, {best.rate:.2f} req/s within the SLO on {best.devices} devices "
              f"(the capacity arithmetic, duet.cluster.capacity)\n# from {', '.join(args.profile)} and {templates[best.mode]}\n")
    write_fleet_config(templates[best.mode], best, (args.slo_ttft_ms, args.slo_tpot_ms), header, args.out)
    print(f"\nthe first layout's config: {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(layout) | {"name": layout.name} for layout in layouts], indent=2))


def config_mode(path: str) -> str:
    """The mode (``pd`` or ``colocated``) of a config's first application, as duet reads it."""
    import yaml

    from duet.cluster.config import parse_args

    return parse_args(yaml.safe_load(Path(path).read_text())["applications"][0].get("args") or {}).mode
