"""``duet simulate``'s autoscaling: each autoscaled pool's policy run in simulated time as Serve's
controller runs it, with the code's own decisions (``duet.cluster.autoscale.decide``).

- Each running replica records its ``autoscaling_metrics`` every ``min(metrics_interval_s, 0.2 *
  look_back_period_s)`` and pushes every ``metrics_interval_s`` from its start; the policy sees
  each replica's mean over the look-back window of what it pushed (a replica that has not pushed
  yet is running but not reporting).
- The routers report the context tokens waiting in them and their ``ArrivalMeter``'s windows
  every ``WAITING_REPORT_S`` (a pool sized ahead by a profile plans from those).
- Every ``CONTROL_LOOP_S`` both pools decide together; Serve holds a change until the policy has
  asked for it that long in the same direction (``upscale_delay_s``, ``downscale_delay_s``:
  ``serve_delayed``), and bounds it.
- A pool's new replica serves once it has had ``start_s`` of a core since its target rose (what
  ``duet bench autoscale`` shows between a pool's target and its running replicas on an idle
  machine): a starting replica is one more thread computing, which slows it and the engines
  beside it as ``cpu_stretch`` says (on two cores, a start beside two busy engines and the
  serving path took twice as long). A pool that shrinks stops a starting replica first, else its
  newest (Serve's order on one node), which takes nothing new; the sequences it decodes move
  away (``sim_moves``), its prompts in flight finish there.

Not modelled: an operator's pins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from duet.benchmarks.autoscale import Sample
from duet.benchmarks.sim_model import Replica
from duet.cluster import capacity
from duet.cluster.autoscale import PoolView, Targets, autoscaling_metrics, decide

CONTROL_LOOP_S = 0.1  # Serve's controller loop (RAY_SERVE_CONTROL_LOOP_INTERVAL_S)
SAMPLE_S = 0.5  # the replicas over time, as often as `duet bench autoscale` reads /duet/status
DEFAULT_START_S = 15.0  # a new replica's time to serve on an idle machine (2 cores, AMD EPYC Zen 4, SmolLM2: 13-21 s)
NEVER = -1e9  # a pool that never changed


@dataclass(frozen=True)
class PoolScaling:
    """An autoscaled pool's bounds, Serve's timings and duet's targets (a config's ``autoscaling_config``)."""

    min_replicas: int
    max_replicas: int
    initial_replicas: int
    upscale_delay_s: float
    downscale_delay_s: float
    metrics_interval_s: float
    look_back_period_s: float
    targets: Targets

    @classmethod
    def of(cls, pool, stage: str, slo) -> PoolScaling | None:
        """``pool`` (``PoolSettings``) of ``stage``'s scaling; None for a fixed pool."""
        from ray.serve.config import AutoscalingConfig

        serve = pool.serve_autoscaling(stage)
        if serve is None:
            return None
        config = AutoscalingConfig(**serve)
        if config.min_replicas < 1:
            raise SystemExit(f"{stage}: min_replicas {config.min_replicas}: the simulation keeps a replica in every pool")
        return cls(
            config.min_replicas, config.max_replicas, pool.starting_replicas(stage), config.upscale_delay_s,
            config.downscale_delay_s, config.metrics_interval_s, config.look_back_period_s,
            Targets(**pool.policy_targets(stage, slo)),
        )

    @property
    def record_s(self) -> float:
        return min(self.metrics_interval_s, 0.2 * self.look_back_period_s)


@dataclass
class Hold:
    """A change Serve holds: its direction (+1 up, -1 down, 0 none) and since when it is asked."""

    direction: int = 0
    since: float = 0.0


def serve_delayed(desired: int, target: int, scaling: PoolScaling, hold: Hold, now: float) -> int:
    """The pool's new target: ``desired`` once the policy has asked for a change in its
    direction for ``upscale_delay_s`` (``downscale_delay_s`` down) without a break, else
    ``target`` (Ray's ``_apply_delay_logic``)."""
    direction = (desired > target) - (desired < target)
    if direction != hold.direction:
        hold.direction, hold.since = direction, now
    if direction == 0:
        return target
    delay = scaling.upscale_delay_s if direction > 0 else scaling.downscale_delay_s
    if now - hold.since + 1e-6 >= delay:
        hold.direction = 0
        return desired
    return target


@dataclass
class _Pool:
    stage: str  # the policy's: prefill, decode or colocated
    name: str  # the pool's: prefill or decode
    scaling: PoolScaling
    running: list  # the simulation's list of this pool's serving replicas (shared with it)
    started: int  # replicas made so far (their names)
    last_change: float = NEVER
    hold: Hold = field(default_factory=Hold)
    starting: list = field(default_factory=list)  # replicas not serving yet

    @property
    def target(self) -> int:
        """Serve's target for the pool: its replicas serving and starting."""
        return len(self.running) + len(self.starting)


class Autoscaling:
    """The autoscaled pools of ``simulation`` (a ``sim_run.Simulation``), deciding every
    ``CONTROL_LOOP_S`` (``Simulation.every``); ``samples``: the replicas
    running and targeted per pool every ``SAMPLE_S`` (``duet bench autoscale``'s ``Sample``)."""

    def __init__(self, simulation, scaling: dict[str, PoolScaling], start_s: float = DEFAULT_START_S) -> None:
        self.simulation, self.start_s = simulation, start_s
        self.pools: dict[str, _Pool] = {}
        for stage, spec in scaling.items():
            name, replicas = ("prefill", simulation.prefill) if stage == "prefill" else ("decode", simulation.decode)
            self.pools[stage] = _Pool(stage, name, spec, replicas, started=len(replicas))
        self.targets = {stage: pool.scaling.targets for stage, pool in self.pools.items()}
        self.models = {
            stage: capacity.load_models(target.profile)[stage] for stage, target in self.targets.items() if target.profile is not None
        }
        self.samples: list = []
        self.changes: list[tuple[float, str, int, int, str]] = []  # (when, stage, from, to, the policy's reason)
        self.served: dict[str, float] = {}  # replica name -> when it began serving (those a pool added)
        self._records: dict[str, list[tuple[float, dict[str, float]]]] = {}  # replica name -> (when, metrics)
        self._born: dict[str, float] = {}  # replica name -> when it began serving
        self._waiting: tuple[float, list] = (0.0, [])  # the routers' last report: tokens waiting, arrivals
        self._start_left: dict[str, float] = {}  # a starting replica -> the seconds of a core its start still needs

    def start(self) -> None:
        from duet.cluster.admin import WAITING_REPORT_S

        simulation = self.simulation
        for pool in self.pools.values():
            for replica in pool.running:
                self._born[replica.name] = simulation.now
            simulation.every(pool.scaling.record_s, lambda pool=pool: self._record(pool))
        simulation.every(WAITING_REPORT_S, self._report_waiting)
        simulation.every(CONTROL_LOOP_S, self._tick)
        simulation.every(SAMPLE_S, self._sample)

    def _record(self, pool: _Pool) -> None:
        now = self.simulation.now
        for replica in pool.running:
            records = self._records.setdefault(replica.name, [])
            records.append((now, autoscaling_metrics(replica.engine_stats(), away=replica.stage != replica.home)))
            while records and records[0][0] < now - 2 * pool.scaling.look_back_period_s - pool.scaling.metrics_interval_s:
                records.pop(0)

    def _report_waiting(self) -> None:
        simulation = self.simulation
        self._waiting = (simulation.waiting_tokens(), simulation.arrivals.summary())

    def _pushed(self, pool: _Pool, replica) -> dict[str, float]:
        """A replica's metrics as the policy sees them: the mean of what it pushed (every
        ``metrics_interval_s`` from its start) over the look-back window; {} before its first push."""
        now, interval = self.simulation.now, pool.scaling.metrics_interval_s
        age = now - self._born[replica.name]
        if age < interval:
            return {}
        pushed = self._born[replica.name] + math.floor(age / interval + 1e-9) * interval
        window = [metrics for when, metrics in self._records.get(replica.name, []) if now - pool.scaling.look_back_period_s <= when <= pushed]
        if not window:
            return {}
        return {name: sum(metrics[name] for metrics in window) / len(window) for name in window[0]}

    def num_starting(self) -> int:
        return sum(len(pool.starting) for pool in self.pools.values())

    def _advance_starts(self, seconds: float) -> None:
        """The starting replicas' last ``seconds``, at the pace the cores allow them now."""
        if not self.num_starting():
            return
        pace = 1.0 / self.simulation.stretch(self.simulation.busy_threads())
        for pool in self.pools.values():
            for replica in list(pool.starting):
                self._start_left[replica.name] -= seconds * pace
                if self._start_left[replica.name] <= 1e-9:
                    self._serve(pool, replica)

    def _tick(self) -> None:
        self._advance_starts(CONTROL_LOOP_S)
        now = self.simulation.now
        views = {}
        for stage, pool in self.pools.items():
            reports = [self._pushed(pool, replica) for replica in pool.running]
            views[stage] = PoolView(
                stage, pool.target, pool.scaling.min_replicas, pool.scaling.max_replicas, [report for report in reports if report],
                pool.last_change, len(pool.running), now,
            )
        tokens, arrivals = self._waiting
        demands = capacity.Demand.from_reports([arrivals]) if self.models and arrivals else None
        for stage, decision in decide(views, self.targets, now, None, tokens, demands, self.models).items():
            pool = self.pools[stage]
            target = serve_delayed(decision.target, pool.target, pool.scaling, pool.hold, now)
            if target != pool.target:
                self.changes.append((now, stage, pool.target, target, decision.reason))
                self._resize(pool, target)

    def _resize(self, pool: _Pool, target: int) -> None:
        simulation = self.simulation
        pool.last_change = simulation.now
        while pool.target < target:
            model = (simulation.cluster.prefill if pool.name == "prefill" else simulation.cluster.decode)[0]
            replica = Replica(f"{pool.stage}-{pool.started}", pool.stage, model, simulation.clock)
            pool.started += 1
            pool.starting.append(replica)
            self._start_left[replica.name] = self.start_s
        while pool.target > target:
            if pool.starting:
                del self._start_left[pool.starting.pop().name]
            else:
                simulation.retire(pool.running[-1])

    def _serve(self, pool: _Pool, replica) -> None:
        del self._start_left[replica.name]
        pool.starting.remove(replica)
        pool.running.append(replica)
        self._born[replica.name] = self.served[replica.name] = self.simulation.now
        self.simulation.admit()  # contexts waiting may go

    def _sample(self) -> None:
        simulation = self.simulation
        running = {"prefill": len(simulation.prefill)} if simulation.prefill else {}
        running["decode"] = len(simulation.decode)
        targets = running | {pool.name: pool.target for pool in self.pools.values()}
        self.samples.append(Sample(simulation.now, running, targets))
