"""The pools' autoscaling policies on synthetic metric histories: what each pool's load asks for,
the P:D decision (a TTFT breach that a saturated decode pool causes does not grow prefill),
hysteresis, cooldowns, bounds, pins, and Serve's own calls of the policy class."""

from __future__ import annotations

import dataclasses

import pytest

from duet.cluster.autoscale import LOW_LOAD, VIEW_TTL_S, PoolPolicy, PoolView, Targets, decide
from duet.cluster.board import LocalBoard

PREFILL = Targets(prompt_tokens_per_replica=1000, cooldown_s=10)
DECODE = Targets(kv_usage=0.5, tpot_s=0.2, cooldown_s=10)
TARGETS = {"prefill": PREFILL, "decode": DECODE}
BLOCKS = 1000  # per decode replica


def prefill_view(target: int, pending: list[float], ttft_s: float = 0.0, last_change: float = 0.0, bounds=(1, 4)) -> PoolView:
    replicas = [{"prompt_tokens_pending": tokens, "ttft_s": ttft_s, "prefill_tokens_per_s": 2000.0} for tokens in pending]
    return PoolView("prefill", target, *bounds, replicas, last_change)


def decode_view(
    target: int, used: list[float], tpot_s: float = 0.02, waiting: float = 0, last_change: float = 0.0, bounds=(1, 4)
) -> PoolView:
    replicas = [
        {"num_decoding_blocks": blocks, "num_blocks": BLOCKS, "tpot_s": tpot_s, "num_decode_waiting": waiting}
        for blocks in used
    ]
    return PoolView("decode", target, *bounds, replicas, last_change)


NOW = 1000.0


def test_a_prompt_backlog_grows_the_prefill_pool_to_what_it_needs_and_no_further_than_max():
    decision = decide({"prefill": prefill_view(1, [2500]), "decode": decode_view(1, [0])}, TARGETS, NOW)["prefill"]
    assert (decision.target, decision.reason) == (3, "prompt_backlog")
    assert decision.numbers["prompt_backlog"] == 2500

    capped = decide({"prefill": prefill_view(1, [9000], bounds=(1, 2)), "decode": decode_view(1, [0])}, TARGETS, NOW)["prefill"]
    assert (capped.target, capped.reason) == (2, "prompt_backlog, bounded")


def test_prompts_computed_on_decode_count_toward_the_prefill_pools_backlog():
    """The balancer keeps prompts local while prefill is short: they are its load all the same."""
    decode = decode_view(1, [0])
    decode.replicas[0] |= {"prompt_tokens_pending": 1800, "new_prompt_tokens_pending": 1800}
    decision = decide({"prefill": prefill_view(1, [500]), "decode": decode}, TARGETS, NOW)["prefill"]
    assert (decision.target, decision.reason) == (3, "prompt_backlog")


def test_sequences_decode_computes_again_do_not_grow_the_prefill_pool():
    """Guards the wrong pool growing: decode short of KV preempts sequences and computes their
    prompts again; counted as prefill's backlog, an idle prefill pool grew while decode was short."""
    decode = decode_view(2, [900, 900], bounds=(1, 2))
    decode.replicas[0] |= {"prompt_tokens_pending": 3000, "new_prompt_tokens_pending": 0}
    decisions = decide({"prefill": prefill_view(1, [0]), "decode": decode}, TARGETS, NOW)
    assert (decisions["prefill"].target, decisions["prefill"].reason) == (1, "steady")
    assert decisions["decode"].reason == "kv_usage, bounded"


def test_long_outputs_grow_decode_and_leave_prefill_alone():
    # 1800 blocks in use at 50% of 1000 per replica: 4 replicas' worth.
    decisions = decide({"prefill": prefill_view(1, [0]), "decode": decode_view(2, [900, 900])}, TARGETS, NOW)
    assert (decisions["decode"].target, decisions["decode"].reason) == (4, "kv_usage")
    assert (decisions["prefill"].target, decisions["prefill"].reason) == (1, "steady")


@pytest.mark.parametrize(
    ("view", "reason"),
    [(decode_view(1, [100], waiting=2), "waiting"), (decode_view(1, [100], tpot_s=0.3), "tpot")],
)
def test_decode_grows_by_one_while_sequences_wait_or_tokens_miss_the_tpot_target(view, reason):
    decision = decide({"decode": view, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (decision.target, decision.reason) == (2, reason)


def test_a_ttft_breach_grows_prefill_unless_the_decode_pool_is_what_is_short():
    slow_first_tokens = prefill_view(1, [0], ttft_s=3.0)
    decode_fine = decide({"prefill": slow_first_tokens, "decode": decode_view(1, [100])}, TARGETS, NOW)
    assert (decode_fine["prefill"].target, decode_fine["prefill"].reason) == (2, "ttft")

    decode_full = decide({"prefill": slow_first_tokens, "decode": decode_view(1, [100], waiting=4)}, TARGETS, NOW)
    assert (decode_full["decode"].target, decode_full["decode"].reason) == (2, "waiting")
    assert (decode_full["prefill"].target, decode_full["prefill"].reason) == (1, "ttft_decode_bound")


def _run(history: list[dict], stage: str, targets=TARGETS, start_target: int = 1) -> list[tuple[int, str]]:
    """Tick the policy over a history of loads, ten seconds apart, Serve-like: the pool's target
    follows each decision, and its last change is when it moved. (target, reason) per tick."""
    target, last_change, out = start_target, 0.0, []
    for tick, loads in enumerate(history):
        now = NOW + 10.0 * tick
        if stage == "prefill":
            views = {"prefill": prefill_view(target, loads["pending"][:target], last_change=last_change), "decode": decode_view(1, [0])}
        else:
            views = {"decode": decode_view(target, loads["used"][:target], last_change=last_change), "prefill": prefill_view(1, [0])}
        decision = decide(views, targets, now)[stage]
        if decision.target != target:
            target, last_change = decision.target, now
        out.append((target, decision.reason))
    return out


def test_hysteresis_a_pool_shrinks_only_once_one_replica_fewer_would_run_at_half_its_target():
    # Decode at 2 replicas, capacity 500 blocks each at kv_usage 0.5: one replica fewer holds 500.
    threshold = LOW_LOAD * BLOCKS * DECODE.kv_usage  # 250 blocks in all
    loads = [{"used": [200, 200]}, {"used": [150, 150]}, {"used": [threshold / 2, threshold / 2]}, {"used": [100, 100]}]
    steps = _run(loads, "decode", start_target=2)
    assert steps == [(2, "steady"), (2, "steady"), (1, "low_load"), (1, "steady")]


def test_cooldown_holds_a_change_right_after_the_last_one_and_bounds_hold_min_replicas():
    view = decode_view(2, [0, 0], last_change=NOW - 3)
    held = decide({"decode": view, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (held.target, held.reason) == (2, "cooldown (low_load)")

    at_min = decode_view(2, [0, 0], bounds=(2, 4))
    kept = decide({"decode": at_min, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (kept.target, kept.reason) == (2, "low_load, bounded")


def test_a_burst_then_quiet_scales_up_at_once_and_down_one_by_one_after_cooldowns():
    burst = [{"pending": [3000] * 4}] + [{"pending": [0] * 4}] * 6
    steps = _run(burst, "prefill", {"prefill": Targets(prompt_tokens_per_replica=1000, cooldown_s=15), "decode": DECODE})
    targets = [target for target, _ in steps]
    assert targets[0] == 3  # 3000 tokens, 1000 per replica: three replicas at once
    # then down by one at a time, never twice within 15 s (ticks are 10 s apart)
    assert targets[1:] == [3, 2, 2, 1, 1, 1]
    assert [reason for _, reason in steps][1] == "cooldown (low_load)"


def test_no_scale_down_while_replicas_have_yet_to_report():
    view = decode_view(2, [0])  # two replicas targeted, one reporting
    decision = decide({"decode": view, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (decision.target, decision.reason) == (2, "awaiting_metrics (low_load)")


def test_a_replica_that_never_starts_does_not_hold_a_scale_down():
    """Guards an idle pool kept at its peak for good: one replica of the target could not be
    placed, so fewer replicas reported than the target, and that read as "yet to report"."""
    view = dataclasses.replace(decode_view(3, [0, 0]), num_running=2)
    decision = decide({"decode": view, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (decision.target, decision.reason) == (2, "low_load")
    # None running at all (all starting, or restarting) is not an idle pool.
    starting = dataclasses.replace(decode_view(3, []), num_running=0)
    decision = decide({"decode": starting, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (decision.target, decision.reason) == (3, "awaiting_metrics (low_load)")


def test_a_pool_does_not_shrink_while_the_replicas_it_just_asked_for_start():
    """Guards a scale-up undone before it served (seen on a busy 2-core machine, where a replica
    took over 25 s to start): a bursty decode load dipped after its cooldown, the policy shrank
    the pool by the replica still starting, and it never ran; the next burst asked for it again."""
    starting = dataclasses.replace(decode_view(2, [0]), num_running=1, last_change=NOW - 30)
    decision = decide({"decode": starting, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (decision.target, decision.reason) == (2, "awaiting_start (low_load)")
    never_started = dataclasses.replace(starting, last_change=NOW - 61)
    decision = decide({"decode": never_started, "prefill": prefill_view(1, [0])}, TARGETS, NOW)["decode"]
    assert (decision.target, decision.reason) == (1, "low_load")


def test_a_pin_wins_at_once_within_the_bounds():
    view = decode_view(1, [900], last_change=NOW - 1)  # within cooldown, and loaded
    pinned = decide({"decode": view, "prefill": prefill_view(1, [0])}, TARGETS, NOW, pins={"decode": 3})["decode"]
    assert (pinned.target, pinned.reason) == (3, "pinned")
    over = decide({"decode": view, "prefill": prefill_view(1, [0])}, TARGETS, NOW, pins={"decode": 9})["decode"]
    assert over.target == 4


def test_targets_reject_values_out_of_range():
    for bad in ({"kv_usage": 0}, {"kv_usage": 1.5}, {"ttft_s": -1}, {"prompt_tokens_per_replica": 0}, {"cooldown_s": float("nan")}):
        with pytest.raises(ValueError):
            Targets(**bad)


def _context(app: str, stage: str, replicas: dict[str, dict[str, float]], target: int, now: float):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingContext

    deployment = DeploymentID(stage, app)
    ids = {name: ReplicaID(name, deployment) for name in replicas}
    metrics: dict[str, dict] = {}
    for name, values in replicas.items():
        for metric, value in values.items():
            metrics.setdefault(metric, {})[ids[name]] = value
    return AutoscalingContext(
        deployment_id=deployment, deployment_name=stage, app_name=app, current_num_replicas=len(replicas),
        target_num_replicas=target, running_replicas=list(ids.values()), total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None,
    )


def test_serve_ticks_each_pools_policy_and_they_decide_together_through_the_board():
    """Two policy instances of one application (as Serve's controller holds them): the prefill
    pool's decision reads the decode pool's latest view, posted by the decode policy's tick."""
    targets = {name: vars(values) for name, values in TARGETS.items()}
    board = LocalBoard()
    prefill, decode = PoolPolicy("prefill", targets, board), PoolPolicy("decode", targets, board)
    app = "board-test"
    full = {"num_decoding_blocks": 400.0, "num_blocks": float(BLOCKS), "num_decode_waiting": 3.0, "tpot_s": 0.05}
    slow = {"prompt_tokens_pending": 0.0, "ttft_s": 5.0, "prefill_tokens_per_s": 2000.0}

    decode_target, _ = decode(_context(app, "decode", {"d1": full}, 1, NOW))
    prefill_target, _ = prefill(_context(app, "prefill", {"p1": slow}, 1, NOW))
    assert (decode_target, prefill_target) == (2, 1)
    assert prefill._last.reason == "ttft_decode_bound"

    calm = full | {"num_decode_waiting": 0.0, "num_decoding_blocks": 100.0}
    decode(_context(app + "-2", "decode", {"d1": calm}, 1, NOW))
    assert prefill(_context(app + "-2", "prefill", {"p1": slow}, 1, NOW))[0] == 2


def test_a_pool_of_an_earlier_deployment_is_left_out_of_the_decision():
    """Guards Serve's controller: an application redeployed colocated (or the other way round)
    on a controller that stayed up found the earlier deployment's decode view on the board and
    failed with KeyError on every tick, holding up every application's updates; a view its
    policy stopped posting also weighed on the other pool's decisions for good."""
    app = "redeployed"
    pd_targets = {name: vars(values) for name, values in TARGETS.items()}
    loaded = {"num_decoding_blocks": 900.0, "num_blocks": float(BLOCKS), "num_decode_waiting": 3.0, "tpot_s": 0.05,
              "prompt_tokens_pending": 5000.0, "new_prompt_tokens_pending": 5000.0}
    board = LocalBoard()
    PoolPolicy("decode", pd_targets, board)(_context(app, "decode", {"d1": loaded}, 1, NOW))
    colocated = PoolPolicy("colocated", {"colocated": vars(DECODE)}, board)
    calm = {"num_decoding_blocks": 10.0, "num_blocks": float(BLOCKS), "num_decode_waiting": 0.0, "tpot_s": 0.05}
    assert colocated(_context(app, "colocated", {"c1": calm}, 1, NOW))[0] == 1
    # Prefill's policy alone ticks on (decode went fixed): the old decode view's backlog counts only until it is stale.
    prefill = PoolPolicy("prefill", pd_targets, board)
    idle = {"prompt_tokens_pending": 0.0, "ttft_s": 0.1, "prefill_tokens_per_s": 2000.0}
    assert prefill(_context(app, "prefill", {"p1": idle}, 1, NOW + 1))[0] == 4  # 5000 tokens queued on decode, 1000 each
    assert prefill(_context(app, "prefill", {"p1": idle}, 1, NOW + 1 + VIEW_TTL_S + 1))[0] == 1


def test_a_pin_set_on_the_board_holds_the_pool_until_unpinned_but_not_one_set_before_its_deployment():
    board = LocalBoard()
    targets = {name: vars(values) for name, values in TARGETS.items()}
    calm = {"num_decoding_blocks": 10.0, "num_blocks": float(BLOCKS), "num_decode_waiting": 0.0, "tpot_s": 0.05}
    board.pin("pinned", "decode", 3, at=0.0)  # an earlier deployment's
    decode = PoolPolicy("decode", targets, board)
    assert decode(_context("pinned", "decode", {"d1": calm}, 1, NOW))[0] == 1
    board.pin("pinned", "decode", 3, at=decode._created_at)
    assert decode(_context("pinned", "decode", {"d1": calm}, 1, NOW))[0] == 3
    assert board.published("pinned", ["decode", "prefill"])["decode"]["reason"] == "pinned"
    board.pin("pinned", "decode", None, at=decode._created_at)
    assert decode(_context("pinned", "decode", {"d1": calm}, 1, NOW))[0] == 1


def test_contexts_waiting_in_the_routers_grow_the_prefill_pool_until_their_reports_age_out():
    """Guards the case the router's waiting room hid: six long prompts in a closed loop kept one
    replica's queue below a replica's worth (a prompt at a time) while five contexts waited in the
    router, and the pool stayed at one replica for minutes."""
    targets = {name: vars(values) for name, values in TARGETS.items()}
    board = LocalBoard()
    prefill = PoolPolicy("prefill", targets, board)
    one_prompt = {"prompt_tokens_pending": 700.0, "ttft_s": 1.5, "prefill_tokens_per_s": 2000.0}
    assert prefill(_context("waiting", "prefill", {"p1": one_prompt}, 1, NOW))[0] == 1
    board.report_waiting("waiting", "router-a", 5 * 1430, at=NOW)
    board.report_waiting("waiting", "router-b", 1430, at=NOW)
    assert prefill(_context("waiting", "prefill", {"p1": one_prompt}, 1, NOW + 1))[0] == 4  # 9280 tokens, bounded at 4
    assert prefill._last.numbers["router_waiting"] == 6 * 1430
    # A router that stops reporting (its replica gone) stops counting.
    decision = decide({"prefill": prefill_view(1, [700])}, TARGETS, NOW, waiting_tokens=0.0)["prefill"]
    assert decision.target == 1
    later = NOW + 1 + VIEW_TTL_S + 1
    quiet = one_prompt | {"ttft_s": 0.5}
    assert prefill(_context("waiting", "prefill", {"p1": quiet}, 4, later))[0] == 3  # down, one step at a time
    assert prefill._last.numbers["router_waiting"] == 0


def test_a_replica_away_from_home_counts_for_the_role_it_serves():
    """A prefill replica serving decode (``duet.router.roles``): its decoding KV, its TPOT and its
    blocks are decode's, not prefill's. The prefill pool, with one replica left on prompts,
    keeps the one it lent rather than shrinking by it; decode's need is met by the lent replica
    first, and only a need past it asks for a new decode replica."""
    away = {"num_decoding_blocks": 500.0, "num_blocks": BLOCKS, "tpot_s": 0.02, "num_decode_waiting": 0.0, "away": 1.0}
    prefill = prefill_view(2, [100])
    prefill = dataclasses.replace(prefill, replicas=[prefill.replicas[0], away])
    decisions = decide({"prefill": prefill, "decode": decode_view(1, [500])}, TARGETS, NOW)
    assert (decisions["prefill"].current, decisions["prefill"].target, decisions["prefill"].reason) == (2, 2, "steady")
    # 1000 blocks on the two replicas serving decode, at 50% of 1000 each: what they serve now.
    assert (decisions["decode"].current, decisions["decode"].target, decisions["decode"].reason) == (1, 1, "steady")
    assert decisions["decode"].numbers["kv_used_blocks"] == 1000
    # Counted as home, the idle-looking prefill pool would shrink, by the replica serving decode, say.
    home = dataclasses.replace(prefill, replicas=[prefill.replicas[0], away | {"away": 0.0}])
    assert decide({"prefill": home, "decode": decode_view(1, [500])}, TARGETS, NOW)["prefill"].reason == "low_load"
    # The lent replica's TPOT past the target is decode's breach: one more decode replica.
    slow = dataclasses.replace(prefill, replicas=[prefill.replicas[0], away | {"tpot_s": 0.5}])
    grown = decide({"prefill": slow, "decode": decode_view(1, [500])}, TARGETS, NOW)["decode"]
    assert (grown.current, grown.target, grown.reason) == (1, 2, "tpot")
    # A replica away for under half of Serve's look-back window still counts as home.
    brief = dataclasses.replace(prefill, replicas=[prefill.replicas[0], away | {"away": 0.3}])
    assert decide({"prefill": brief, "decode": decode_view(1, [500])}, TARGETS, NOW)["decode"].numbers["kv_used_blocks"] == 500
