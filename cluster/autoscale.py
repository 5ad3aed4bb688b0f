"""Each pool scales on its own load, in one decision over both: Serve autoscaling policies.

Replicas report their stage's load through Serve's ``record_autoscaling_stats``
(``autoscaling_metrics``): prompt tokens queued or in their prefill and the prompt tokens per
second the replica measured it can do, first-token waits, the KV blocks of decoding sequences
(not of prompts being computed, nor reserved for prompts on their way: those are prefill's
load), running sequences and decoding ones waiting for room, TPOT (a step's time over the
tokens each decoding sequence got from it) and output tokens per second. Serve averages each
over ``look_back_period_s`` per replica and hands them to the pool's policy, every
control-loop tick (0.1 s); replicas record every ``min(metrics_interval_s, 0.2 *
look_back_period_s)`` and push every ``metrics_interval_s``.

``PoolPolicy`` is a deployment-level policy, one per pool, referenced by import path (so
``serve deploy`` runs it as ``duet up`` does). Both pools' policies run in the Serve controller,
one after the other in each tick; each posts its pool's view on the board
(``duet.cluster.board``, a named actor) and decides with the other pool's latest view:
``decide`` is one function of both pools, so the P:D balance is one decision. A view its policy
stopped posting (its pool deleted, or redeployed without autoscaling or in another mode) counts
for ``VIEW_TTL_S`` at most.
Ray 2.60's application-level ``autoscaling_policy`` would see both pools natively, but it is
registered only by a declarative deploy (``serve deploy``, the REST API): ``serve.run``, which
``duet up`` uses, has no way to set it.

The rules (``decide``), per pool, from its target (not its running count: replicas starting
are counted). A replica away from home (``duet.router.roles``) counts for the role it serves,
load and capacity: each role is sized from the replicas serving it, and its pool's target is
that less the replicas it borrowed, plus those it lent (``_by_role``).

- prefill: replicas for the prompt backlog, at ``prompt_tokens_per_replica`` each (default: what
  one replica computes in half the TTFT target, at its measured speed); the backlog counts the
  prompts the router computes on decode replicas because the prefill pool was busy (not
  sequences they compute again after a preemption: more prefill replicas would not help
  those), and the contexts waiting in the routers for a pool with room (each router replica
  reports them on the board: no replica's queue shows them). One more when first tokens come later than the TTFT target, unless the decode pool
  is short of room or time: then prefill is not what delays them, and it holds.
- decode (and colocated): replicas for the decoding sequences' KV at ``kv_usage`` of each
  replica's blocks; one more while decoding sequences wait for room or their TPOT exceeds the
  target (a colocated pool: also while first tokens exceed the TTFT target).
- down by one only when the load fits in one replica fewer at half the targets (hysteresis),
  and some replica runs and every running one has reported, and no replica of the last change is
  still starting (for ``START_GRACE_S`` at most: one that never starts, short of resources, does
  not hold the pool up), never within ``cooldown_s`` of the pool's last change
  (new replicas need time to start and to be measured). Serve then holds each change for its
  ``upscale_delay_s``/``downscale_delay_s`` and keeps the target within
  ``min_replicas``..``max_replicas``.

A pool whose settings name a ``profile`` (a ``duet profile`` JSON of its config) is sized
ahead instead (``_planned``, ``duet.cluster.capacity``): for the routers' arrivals and lengths,
by the profile's times corrected by the replicas' measure; never below what the load present
needs (the backlog, router-held contexts counted, or the decoding KV); the reactive rules
still add a replica where that load asks for more than the plan.

An operator may pin an autoscaled pool at a size (``duet scale POOL N``, ``POST /duet/scale``;
``auto`` unpins, and so does deploying the application again): the policy then decides the pin,
within the bounds, without cooldown.

Each change of a pool's decision is logged in one line with the numbers behind it, and
published on the board for the router's ``/metrics``
(``duet:autoscaler_target_replicas{stage}``, decisions counted by reason) and ``duet status``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from duet.cluster import capacity
from duet.cluster.board import ActorBoard
from duet.messages import EngineStats

logger = logging.getLogger("ray.serve")

# What a replica reports to its pool's policy (Serve keeps float series per name).
METRICS = (
    "prompt_tokens_pending", "new_prompt_tokens_pending", "prefill_tokens_per_s", "ttft_s", "num_running", "num_decode_waiting",
    "num_decoding_blocks", "num_blocks", "tpot_s", "output_tokens_per_s", "away",
)
LOW_LOAD = 0.5  # a pool shrinks when one replica fewer would run below this fraction of each target
DEFAULT_PROMPT_TOKENS_PER_REPLICA = 2048  # before any replica measured its prompt speed
PUBLISH_EVERY_S = 1.0
START_GRACE_S = 60.0  # a pool does not shrink while the replicas of its last change start, this long at most
VIEW_TTL_S = 10.0  # a pool's view (or a router's waiting report) not posted for this long is left out of decisions


def autoscaling_metrics(stats: EngineStats, away: bool = False) -> dict[str, float]:
    """A replica's ``METRICS``, from its engine's stats; ``away``: it serves the other pool's role
    (``duet.router.roles``)."""
    scheduler, load = stats.scheduler, stats.load
    metrics = {
        "prompt_tokens_pending": scheduler.prompt_tokens_pending,
        "new_prompt_tokens_pending": scheduler.new_prompt_tokens_pending,
        "prefill_tokens_per_s": load.prefill_tokens_per_s,
        "ttft_s": load.ttft_s,
        "num_running": scheduler.num_running,
        "num_decode_waiting": scheduler.num_decode_waiting,
        "num_decoding_blocks": scheduler.num_decoding_blocks,
        "num_blocks": stats.kv.num_blocks,
        "tpot_s": load.tpot_s,
        "output_tokens_per_s": load.output_tokens_per_s,
        "away": away,
    }
    return {name: float(metrics[name]) for name in METRICS}


@dataclasses.dataclass(frozen=True)
class Targets:
    """A pool's policy settings: the SLO and the capacity it is sized for."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2
    prompt_tokens_per_replica: int | None = None
    kv_usage: float = 0.7
    cooldown_s: float = 10.0
    profile: str | None = None  # a `duet profile` JSON: the pool is sized ahead by it (``capacity``)

    def __post_init__(self) -> None:
        checks = {
            "ttft_s": _number(self.ttft_s) and self.ttft_s > 0,
            "tpot_s": _number(self.tpot_s) and self.tpot_s > 0,
            "prompt_tokens_per_replica": self.prompt_tokens_per_replica is None
            or (isinstance(self.prompt_tokens_per_replica, int) and self.prompt_tokens_per_replica >= 1),
            "kv_usage": _number(self.kv_usage) and 0 < self.kv_usage <= 1,
            "cooldown_s": _number(self.cooldown_s) and self.cooldown_s >= 0,
            "profile": self.profile is None or (isinstance(self.profile, str) and bool(self.profile)),
        }
        wrong = [name for name, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(
                f"{wrong[0]}={getattr(self, wrong[0])!r} is out of range (kv_usage in (0, 1], prompt_tokens_per_replica a "
                "positive integer, times positive, profile a path)"
            )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class PoolView:
    """One pool at one tick: its target and bounds, and each running replica's metrics."""

    stage: str
    target: int
    min_replicas: int
    max_replicas: int
    replicas: list[dict[str, float]]  # the running replicas that reported
    last_change: float = 0.0  # when its target last moved (epoch seconds; 0: never)
    num_running: int | None = None  # running replicas, reported or not (None: as many as the target)
    at: float = 0.0  # when it was seen (epoch seconds)

    def total(self, name: str) -> float:
        return sum(replica.get(name, 0.0) for replica in self.replicas)

    def peak(self, name: str) -> float:
        return max((replica.get(name, 0.0) for replica in self.replicas), default=0.0)

    def mean_nonzero(self, name: str) -> float:
        values = [replica[name] for replica in self.replicas if replica.get(name, 0.0) > 0]
        return sum(values) / len(values) if values else 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    stage: str
    current: int  # the pool's target when deciding
    target: int
    reason: str
    numbers: dict[str, float]

    def line(self) -> str:
        figures = ", ".join(f"{name}={value:.3g}" for name, value in self.numbers.items())
        return f"autoscaler {self.stage}: {self.current} -> {self.target} replicas ({self.reason}; {figures})"


def decide(
    views: dict[str, PoolView], targets: dict[str, Targets], now: float, pins: dict[str, int] | None = None, waiting_tokens: float = 0.0,
    demands: list[capacity.Demand] | None = None, models: dict[str, capacity.StageModel] | None = None,
) -> dict[str, Decision]:
    """Both pools' decisions from their views (``prefill`` absent when colocated), the context
    tokens waiting in the routers and, for the pools with a profile's ``models``, the routers'
    ``demands`` (one per window of their meters). A pool an operator pinned (``duet scale``) gets its pin, within its bounds, at
    once. Views of stages without targets (another deployment's pools) are left out."""
    views = {stage: view for stage, view in views.items() if stage in targets}
    roles, moved = _by_role(views)
    decisions = {}
    for stage in ("decode", "colocated"):
        if stage in views:
            decisions[stage] = _decode(roles[stage], targets[stage])
    if "prefill" in views:
        decode = decisions.get("decode")
        decode_short = decode is not None and decode.target > decode.current
        decisions["prefill"] = _prefill(roles["prefill"], targets["prefill"], roles.get("decode"), decode_short, waiting_tokens)
    for stage in decisions:
        if stage in (models or {}) and demands:
            decisions[stage] = _planned(decisions[stage], roles[stage], targets[stage], models[stage], demands)
    for stage, shift in moved.items():  # back from the role's replicas to the pool's own
        decision = decisions[stage]
        decisions[stage] = dataclasses.replace(decision, current=decision.current - shift, target=max(0, decision.target - shift))
    for stage, decision in decisions.items():
        pin = (pins or {}).get(stage)
        if pin is not None:
            decision = dataclasses.replace(decision, target=pin, reason="pinned")
        decisions[stage] = _bounded(decision, views[stage], targets[stage], now)
    return decisions


def _by_role(views: dict[str, PoolView]) -> tuple[dict[str, PoolView], dict[str, int]]:
    """Each PD role's view: the replicas serving it, whichever pool is their home (a replica
    away from home reports ``away``: its load is the other role's, its capacity too), with the
    target counting them; and, per pool, how many more replicas serve its role than it owns.
    A pool's decision is made for its role, then less that difference: a role short of capacity
    is first answered by the replica it borrowed (a flip before a new replica), and the pool
    that lent one keeps room for it."""
    if "prefill" not in views or "decode" not in views:
        return views, {}
    prefill, decode = views["prefill"], views["decode"]
    # Serve averages each metric over its look-back window: away for most of it counts as away.
    lent = {stage: [replica for replica in view.replicas if replica.get("away", 0.0) >= 0.5] for stage, view in views.items()}
    kept = {stage: [replica for replica in view.replicas if replica.get("away", 0.0) < 0.5] for stage, view in views.items()}
    moved = {"prefill": len(lent["decode"]) - len(lent["prefill"]), "decode": len(lent["prefill"]) - len(lent["decode"])}
    roles = dict(views)
    for stage, other, view in (("prefill", "decode", prefill), ("decode", "prefill", decode)):
        num_running = None if view.num_running is None else view.num_running + moved[stage]
        roles[stage] = dataclasses.replace(
            view, target=view.target + moved[stage], replicas=kept[stage] + lent[other], num_running=num_running,
        )
    return roles, moved


def _prefill(view: PoolView, targets: Targets, decode: PoolView | None, decode_short: bool, waiting_tokens: float) -> Decision:
    speed = view.mean_nonzero("prefill_tokens_per_s")
    per_replica = targets.prompt_tokens_per_replica or (speed * targets.ttft_s / 2 if speed else DEFAULT_PROMPT_TOKENS_PER_REPLICA)
    # Decode replicas' new prompts (kept local while prefill was busy) are its kind of work; their
    # recomputes (preempted sequences, or moved by recompute) are not: prefill could not take them.
    backlog = view.total("prompt_tokens_pending") + (decode.total("new_prompt_tokens_pending") if decode else 0.0) + waiting_tokens
    ttft = view.peak("ttft_s")
    numbers = {"prompt_backlog": backlog, "router_waiting": waiting_tokens, "per_replica": per_replica, "ttft_s": ttft,
               "ttft_target_s": targets.ttft_s}
    current = view.target
    needed = math.ceil(backlog / per_replica)
    numbers["needed"] = needed

    def decision(target: int, reason: str) -> Decision:
        return Decision(view.stage, current, target, reason, numbers)

    if needed > current:
        return decision(needed, "prompt_backlog")
    if ttft > targets.ttft_s:
        return decision(current, "ttft_decode_bound") if decode_short else decision(current + 1, "ttft")
    if current > 1 and backlog <= LOW_LOAD * per_replica * (current - 1) and ttft <= LOW_LOAD * targets.ttft_s:
        return decision(current - 1, "low_load")
    return decision(current, "steady")


def _decode(view: PoolView, targets: Targets) -> Decision:
    blocks_per_replica = view.mean_nonzero("num_blocks")
    used = view.total("num_decoding_blocks")
    waiting = view.total("num_decode_waiting")
    tpot = view.peak("tpot_s")
    ttft = view.peak("ttft_s") if view.stage == "colocated" else 0.0
    numbers = {"kv_used_blocks": used, "blocks_per_replica": blocks_per_replica, "kv_target": targets.kv_usage,
               "waiting": waiting, "tpot_s": tpot, "tpot_target_s": targets.tpot_s}
    if view.stage == "colocated":
        numbers |= {"ttft_s": ttft, "ttft_target_s": targets.ttft_s}
    current = view.target
    per_replica = blocks_per_replica * targets.kv_usage
    needed = math.ceil(used / per_replica) if per_replica else current
    numbers["needed"] = needed

    def decision(target: int, reason: str) -> Decision:
        return Decision(view.stage, current, target, reason, numbers)

    if needed > current:
        return decision(needed, "kv_usage")
    if waiting > 0:
        return decision(current + 1, "waiting")
    if tpot > targets.tpot_s:
        return decision(current + 1, "tpot")
    if ttft > targets.ttft_s:
        return decision(current + 1, "ttft")
    fits_in_fewer = used <= LOW_LOAD * per_replica * (current - 1)
    if current > 1 and fits_in_fewer and tpot <= LOW_LOAD * targets.tpot_s and ttft <= LOW_LOAD * targets.ttft_s:
        return decision(current - 1, "low_load")
    return decision(current, "steady")


def _planned(reactive: Decision, view: PoolView, targets: Targets, model: capacity.StageModel, demands: list[capacity.Demand]) -> Decision:
    """A pool sized ahead: the replicas ``capacity.plan`` gives, by the profile's times corrected by
    those its replicas measured; at least those the load present needs (``needed``); more where a
    reactive rule asks for more than that."""
    measured = capacity.Measured(view.mean_nonzero("prefill_tokens_per_s"), view.mean_nonzero("tpot_s"), view.mean_nonzero("num_running"))
    planned, factor, demand = capacity.plan(view.stage, model, demands, measured, targets.ttft_s, targets.tpot_s, targets.kv_usage, reactive.current)
    numbers = reactive.numbers | {
        "planned": planned, "rate": demand.rate, "prompt_tokens": demand.prompt_tokens, "output_tokens": demand.output_tokens,
        "correction": factor,
    }
    if reactive.target > reactive.current and reactive.target > planned:
        return dataclasses.replace(reactive, numbers=numbers)  # the load present asks for more
    target = max(planned, int(reactive.numbers["needed"]))
    return dataclasses.replace(reactive, target=target, reason="planned" if target != reactive.current else "steady", numbers=numbers)


def _bounded(decision: Decision, view: PoolView, targets: Targets, now: float) -> Decision:
    target = min(max(decision.target, view.min_replicas), view.max_replicas)
    if decision.reason == "pinned":
        return dataclasses.replace(decision, target=target)
    num_running = decision.current if view.num_running is None else view.num_running
    if target < decision.current and (num_running == 0 or len(view.replicas) < num_running):
        # None running yet (starting, or restarting), or running ones not reporting: the load is not known.
        return dataclasses.replace(decision, target=decision.current, reason=f"awaiting_metrics ({decision.reason})")
    if target < decision.current and num_running < decision.current and now - view.last_change < START_GRACE_S:
        # Replicas of the last scale-up are still starting: their load is not seen yet, and
        # stopping them before they ever served would undo every scale-up on a slow machine.
        return dataclasses.replace(decision, target=decision.current, reason=f"awaiting_start ({decision.reason})")
    if target != decision.current and now - view.last_change < targets.cooldown_s:
        return dataclasses.replace(decision, target=decision.current, reason=f"cooldown ({decision.reason})")
    if target != decision.target:
        return dataclasses.replace(decision, target=target, reason=f"{decision.reason}, bounded")
    return decision


class PoolPolicy:
    """Serve's deployment-level policy of one pool (``policy_kwargs``: ``stage``, and ``targets``:
    a dict of ``Targets`` per stage of the application). ``board``: where the pools meet
    (default: the cluster's board actor; tests pass a ``LocalBoard``)."""

    def __init__(self, stage: str, targets: dict[str, dict], board=None) -> None:
        self.stage = stage
        self.targets = {name: Targets(**values) for name, values in targets.items()}
        # the pools sized ahead, by their profiles (read once: a deploy checked they read)
        self.models = {
            name: capacity.load_models(target.profile)[name] for name, target in self.targets.items() if target.profile is not None
        }
        self.board = board if board is not None else ActorBoard()
        self._last: Decision | None = None
        self._published_at = 0.0
        self._counts: dict[str, int] = {}
        self._created_at = time.time()  # pins set before this deployment of the pool do not hold

    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        metrics = ctx.aggregated_metrics or {}
        replicas = [
            {name: float(metrics[name][replica_id]) for name in METRICS if replica_id in metrics.get(name, {})}
            for replica_id in ctx.running_replicas
        ]
        last_change = max(ctx.last_scale_up_time or 0.0, ctx.last_scale_down_time or 0.0)
        view = PoolView(
            self.stage, ctx.target_num_replicas, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas,
            [replica for replica in replicas if replica], last_change, len(ctx.running_replicas), now,
        )
        try:
            posted, pin_records, waiting = self.board.exchange(ctx.app_name or "", self.stage, dataclasses.asdict(view))
        except Exception as error:  # noqa: BLE001 - decide from this pool's view alone meanwhile
            logger.warning("the autoscaler board is out of reach (%r): the %s pool decides alone", error, self.stage)
            posted, pin_records, waiting = {}, {}, {}
        seen = {stage: PoolView(**fields) for stage, fields in posted.items()} | {self.stage: view}
        views = {stage: other for stage, other in seen.items() if now - other.at <= VIEW_TTL_S}
        pins = {stage: record["replicas"] for stage, record in pin_records.items() if record["at"] >= self._created_at}
        routers = [record for record in waiting.values() if now - record["at"] <= VIEW_TTL_S]
        waiting_tokens = sum(record["tokens"] for record in routers)
        demands = capacity.Demand.from_reports([record["arrivals"] for record in routers if record.get("arrivals")])
        decision = decide(views, self.targets, now, pins, waiting_tokens, demands, self.models)[self.stage]
        self._report(ctx.app_name or "", decision, ctx.current_num_replicas, now)
        return decision.target, {}

    def _report(self, app_name: str, decision: Decision, running: int, now: float) -> None:
        changed = self._last is None or (decision.target, decision.reason) != (self._last.target, self._last.reason)
        if changed:
            self._counts[decision.reason] = self._counts.get(decision.reason, 0) + 1
            if decision.target != decision.current or (self._last is not None and self._last.target != self._last.current):
                logger.info("%s (app %s)", decision.line(), app_name)
        self._last = decision
        if changed or now - self._published_at >= PUBLISH_EVERY_S:
            self._published_at = now
            record = dataclasses.asdict(decision) | {"running": running, "decisions": dict(self._counts), "at": now}
            try:
                self.board.publish(app_name, self.stage, record)
            except Exception as error:  # noqa: BLE001 - the decision stands; only its report is lost
                logger.warning("could not publish the %s autoscaler decision: %r", self.stage, error)
