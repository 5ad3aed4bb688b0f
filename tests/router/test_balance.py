"""Adaptive selective PD: where the balancer sends each context, from the replicas' measured
speeds and loads, from what it sent that has no first token yet, and from the share of the
decode pool's time its local prompts took."""

from __future__ import annotations

import dataclasses
import time

import pytest

from duet.messages import ReplicaStats
from duet.router.balance import StageBalancer
from tests.router.fake_serve import make_stats

TTFT_S = 2.0
TPOT_S = 0.2


def stats(stage: str, name: str, **fields) -> ReplicaStats:
    return make_stats(stage, name, **{"num_free_blocks": 1000, "num_blocks": 1000} | fields)


def balancer(prefill: list[ReplicaStats] | None, decode: list[ReplicaStats] | None, prefill_replicas: int | None = 1, threshold=64):
    pools = {"prefill": prefill, "decode": decode}
    sizes = {"prefill": prefill_replicas, "decode": len(decode or [])}
    return StageBalancer(pools.get, sizes.get, threshold, TTFT_S, TPOT_S, block_size=16)


def test_before_any_measurement_the_static_threshold_decides():
    unmeasured = balancer([stats("prefill", "p")], [stats("decode", "d")])
    assert unmeasured.choose(10).local and not unmeasured.choose(500).local
    unknown = balancer(None, None, prefill_replicas=None)
    assert unknown.choose(63).local and not unknown.choose(64).local


def test_before_any_measurement_a_held_context_counts_short_only_where_decode_holds_more():
    """A 40-token prompt sent again: its first 32 tokens held by both sides (this router's
    records), it is judged by its whole length, past the threshold of 24: through the prefill pool,
    as before held prefixes counted. Held by decode alone, its 8 tokens there are short: local."""
    from duet.block_pool import routing_block_hashes
    from duet.router.held import HeldContexts

    prompt = list(range(100, 140))
    hashes = routing_block_hashes(prompt, 16)
    for prefilled, local in ((True, False), (False, True)):
        chooser = balancer([stats("prefill", "p")], [stats("decode", "d")], threshold=24)
        chooser.held, chooser.prefilled = HeldContexts(16), HeldContexts(16)
        chooser.held.add("d", "decode", prompt)
        if prefilled:
            chooser.prefilled.add(None, "prefill", prompt)
        assert chooser.choose(len(prompt), prefix_hashes=hashes).local == local


def test_with_no_prefill_replica_running_every_context_stays_local(monkeypatch):
    alone = balancer([], [stats("decode", "d", decode_only_tpot_s=0.5, num_decode_waiting=3)], prefill_replicas=0)
    assert alone.choose(5000).local
    # What it remembers of local prompts stays within the window, whichever rule chose them.
    later = time.monotonic() + 60
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert alone.choose(10).local and [tokens for _, tokens in alone._local_sent] == [10]


def test_a_long_prompt_stays_local_when_the_prefill_pool_is_the_bottleneck():
    # Prefill has 20 s of prompts queued; an idle decode replica computes 2000 tokens in 2 s.
    busy_prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=20_000)]
    idle_decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02)]
    assert balancer(busy_prefill, idle_decode).choose(2000).local


def test_a_short_prompt_goes_through_an_idle_prefill_pool_when_decode_is_busy_computing_prompts():
    idle_prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    # Local prompts queued on decode: 5 s of them.
    loaded_decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, prompt_tokens_pending=5000, decode_only_tpot_s=0.02)]
    assert not balancer(idle_prefill, loaded_decode).choose(32).local


def test_no_local_prompt_while_decode_lacks_room():
    busy_prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=1500)]  # 1.65 s there, 0.1 s here
    for loaded in (
        {"decode_only_tpot_s": TPOT_S},  # decoding alone takes the whole TPOT target
        {"num_decode_waiting": 1},  # a sequence waits for room
        {"num_free_blocks": 100},  # KV 90% used
    ):
        decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, **({"decode_only_tpot_s": 0.02} | loaded))]
        assert not balancer(busy_prefill, decode).choose(100).local, loaded


def test_local_prompts_take_at_most_the_share_of_decode_time_that_keeps_tpot_in_target():
    """Decoding alone at half of 75% of the target leaves half of each 5 s to prompts: 2.5 s,
    priced at what a token costs there (a prompt step also decodes: its prompt speed is lower)."""
    busy_prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=20_000)]
    decode = [stats("decode", "d", prefill_tokens_per_s=900.0, tokens_per_s=1000.0, decode_only_tpot_s=0.075)]
    chooser = balancer(busy_prefill, decode)
    # The third would be done sooner here (3.3 s against 21 s) but would make 3.0 s of the window,
    # and it misses its TTFT target either way: no rescue; past the target on both sides, it waits.
    first, second, third = (chooser.choose(1000) for _ in range(3))
    assert first.local and second.local and third is None


def test_past_the_comfortable_share_a_prompt_that_would_miss_its_ttft_goes_local_up_to_the_target():
    decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, tokens_per_s=1000.0, decode_only_tpot_s=0.16)]
    # Decoding alone at 80% of the TPOT target: no share is comfortable (75%), 1 s in 5 is left to the target.
    long_queue = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=5000)]
    rescuer = balancer(long_queue, decode)
    assert rescuer.choose(500).local  # 5.55 s through prefill, 0.5 s here: within 1 s of decode time
    assert rescuer.choose(600) is None  # 1.1 s of decode time: past the target; 5 s queued there: it waits
    short_queue = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=1000)]
    assert not balancer(short_queue, decode).choose(500).local  # 1.55 s through prefill: in time


def test_the_prefill_pool_takes_a_prompt_while_idle_or_in_time_even_where_decode_would_be_sooner():
    """Guards against the decode replica computing half the prompts at 1 req/s (each one
    stalling its decoding sequences) while the prefill core idled: the sooner way decides only
    once the prefill pool's first token would come past a quarter of the TTFT target."""
    decode = [stats("decode", "d", prefill_tokens_per_s=2000.0, decode_only_tpot_s=0.02)]
    idle = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    assert not balancer(idle, decode).choose(1800).local  # 1.85 s there, 0.9 s here: idle goes first
    in_time = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=100)]
    assert not balancer(in_time, decode).choose(300).local  # 0.45 s there: within 0.5 s
    late = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=200)]
    assert balancer(late, decode).choose(300).local  # 0.55 s there, 0.15 s here


def test_a_turn_whose_history_a_decode_replica_holds_is_computed_there_past_it():
    """A conversation's next turn (1,200 tokens): the decode replica holds its last prompt and
    reply (1,024 tokens, 64 blocks), the prefill replica the last prompt (960, 60 blocks). An idle
    prefill pool does not come first: it would compute 240 tokens and send all 1,200, the decode
    replica computes 176; it is priced so (what a side computes is what it counts as sent).
    Where the prefill side holds as much, or nothing is held, the idle prefill pool takes it."""
    from duet.block_pool import routing_block_hashes

    history = list(range(1000, 2024))
    turn = history + list(range(5000, 5176))
    hashes = routing_block_hashes(turn, 16)
    last_prompt = routing_block_hashes(history[:960], 16)
    decode = [
        stats("decode", "empty", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02),
        stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02, prefix_hashes=routing_block_hashes(history, 16)),
    ]
    idle = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prefix_hashes=last_prompt)]
    chooser = balancer(idle, decode)
    choice = chooser.choose(len(turn), prefix_hashes=hashes)
    assert choice.local and choice.num_tokens == 176 and chooser._local_sent[-1][1] == 176
    assert not balancer(idle, decode).choose(len(turn)).local  # its history not named: the whole context
    holds_it_too = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prefix_hashes=routing_block_hashes(history, 16))]
    choice = balancer(holds_it_too, decode).choose(len(turn), prefix_hashes=hashes)
    assert not choice.local and choice.num_tokens == 176
    no_room = [dataclasses.replace(decode[1], scheduler=dataclasses.replace(decode[1].scheduler, num_decode_waiting=1))]
    assert not balancer(idle, no_room).choose(len(turn), prefix_hashes=hashes).local  # no TPOT room: through prefill
    assert balancer(idle, decode).in_time(len(turn), 1.7, hashes) and not balancer(idle, decode).in_time(len(turn), 1.7)


def test_a_history_this_router_just_saw_end_counts_before_the_replica_reports_it():
    """The next turn comes the moment the last ended, before the decode replica's report names
    that history: the router's own record (``HeldContexts``) counts it, and the choice names the
    replica, by its record where that holds more than the reports, else by the reports; a record
    expires after its TTL. Its record of what the prefill pool computed counts for that pool
    likewise."""
    from duet.block_pool import routing_block_hashes
    from duet.router.held import HeldContexts, Holder

    now = [100.0]
    prompt, reply = list(range(1000, 2024)), list(range(3000, 3128))
    turn = routing_block_hashes(prompt + reply + list(range(5000, 5176)), 16)  # 1,328 tokens
    unreported = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02)]
    reported = [dataclasses.replace(unreported[0], prefix_hashes=routing_block_hashes(prompt + reply, 16))]
    idle = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prefix_hashes=routing_block_hashes(prompt, 16))]

    def chooser(decode, recorded: bool):
        made = balancer(idle, decode)
        made.held = HeldContexts(16, ttl_s=30.0, clock=lambda: now[0])
        if recorded:  # a sequence ended on "d": its KV all but its last token's (71 blocks: depth 68)
            made.held.add("d", "decode", prompt + reply[:-1])
        return made

    assert not chooser(unreported, recorded=False).choose(1328, prefix_hashes=turn).local  # the prefill pool first
    choice = chooser(unreported, recorded=True).choose(1328, prefix_hashes=turn)
    assert choice.local and choice.num_tokens == 1328 - 68 * 16 and choice.holder == Holder("d", "decode", 68)
    choice = chooser(reported, recorded=True).choose(1328, prefix_hashes=turn)  # the report holds more (72)
    assert choice.local and choice.holder == Holder("d", "decode", 72)
    assert chooser(reported, recorded=False).choose(1328, prefix_hashes=turn).holder == Holder("d", "decode", 72)
    later = chooser(unreported, recorded=True)
    now[0] += 31.0
    assert later.held.holder(turn) is None and not later.choose(1328, prefix_hashes=turn).local  # the record expired
    # The same prompt again (a retry): the prefill pool computed it, which this router recorded
    # before that replica's report names it; both sides hold as much, and the prefill pool goes first.
    again = routing_block_hashes(prompt + reply, 16)
    assert chooser(unreported, recorded=True).choose(1152, prefix_hashes=again).local  # the prefill pool's report: the prompt only
    recorded = chooser(unreported, recorded=True)
    recorded.prefilled = HeldContexts(16, clock=lambda: now[0])
    recorded.prefilled.add(None, "prefill", prompt + reply)
    assert not recorded.choose(1152, prefix_hashes=again).local


def test_what_it_sent_without_a_first_token_yet_counts_until_done():
    """Reports lag; the balancer's own outstanding tokens are fresher. Both stages equal: the
    idle prefill pool takes the first prompt, the second would wait for it there and goes local,
    and a finished one frees its side."""
    prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02)]
    chooser = balancer(prefill, decode)
    first = chooser.choose(1000)
    assert not first.local
    second = chooser.choose(1000)
    assert second.local  # 2.05 s through prefill now, past 0.5 s; 1.0 s here
    assert chooser._outstanding == {True: 1000, False: 1000}
    first.done()
    first.done()  # once only
    assert chooser._outstanding == {True: 1000, False: 0}
    assert not chooser.choose(1000).local
    assert chooser.decisions == {True: 1, False: 2}


def test_a_context_in_progress_on_the_prefill_pool_counts_for_what_is_left_of_it(monkeypatch):
    """Counting the whole of a prompt already half computed sent the next one to decode that the
    prefill pool would have had done in time."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02)]
    chooser = balancer(prefill, decode)
    assert not chooser.choose(300).local
    now[0] += 0.2
    assert not chooser.choose(300).local  # 0.1 s left of the first, 0.3 s of its own: 0.45 s in all
    assert chooser.choose(300).local  # behind both: 0.75 s there, 0.3 s here


def test_a_context_neither_pool_can_take_in_time_waits_instead_of_reserving_decode_kv():
    """Guards the decode replica whose KV filled with blocks reserved for prompts queued on the
    prefill core (6 req/s on two cores): it ran 2-20 sequences and computed no prompt itself while
    the prefill queue grew to 38. A context that would give its first token past the TTFT target
    through the prefill pool, where the decode pool has no room for it, waits; it goes through the
    prefill pool once that queue leaves it in time, and stays local where decode has room."""
    full_decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02, num_free_blocks=100)]
    long_queue = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=1700)]
    assert balancer(long_queue, full_decode).choose(300) is None  # 1.7 + 0.3 + 0.05 s: past the 2 s target
    within = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=1600)]
    assert not balancer(within, full_decode).choose(300).local  # 1.95 s: it joins the queue
    assert balancer(within, full_decode).choose(300, waited_s=0.1) is None  # waited: 2.05 s
    room = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02)]
    assert balancer(long_queue, room).choose(300).local


def test_a_late_context_feeds_the_prefill_pool_only_when_its_queue_runs_low():
    """A context that will be late whichever way still goes through the prefill pool once its
    queue is below ``PREFILL_FEED_S``: that pool's time has no other use. Above it, the pool's
    time is kept for contexts still in time."""
    full_decode = [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=0.02, num_free_blocks=100)]
    low = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=400)]
    assert not balancer(low, full_decode).choose(300, waited_s=5.0).local  # 0.4 s queued: it goes
    fed = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=600)]
    assert balancer(fed, full_decode).choose(300, waited_s=5.0) is None  # 0.6 s queued: it waits
    assert not balancer(fed, full_decode).choose(300, waited_s=1.0).local  # 1.0 + 0.95 s: in time


def test_in_time_asks_whether_the_fastest_way_with_nothing_queued_could_still_make_the_target():
    prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=5000)]
    decode = [stats("decode", "d", prefill_tokens_per_s=500.0)]
    chooser = balancer(prefill, decode)
    assert chooser.in_time(1000, waited_s=0.9)  # 1.05 s through an empty prefill pool: 1.95 s
    assert not chooser.in_time(1000, waited_s=1.0)
    assert balancer(None, None).in_time(1000, waited_s=10.0)  # nothing measured: nothing is late


def test_first_tokens_that_come_later_than_predicted_make_the_next_predictions_later(monkeypatch):
    """Placement waits for the decode replica's current step (up to a prompt chunk: ~0.5 s on one
    core), which no report shows; at 4 req/s on two cores contexts predicted in time missed their
    TTFT target by 0.1-0.5 s until each side's measured lateness entered its prediction."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    decode = [stats("decode", "d", prefill_tokens_per_s=200.0, decode_only_tpot_s=0.02, num_free_blocks=100)]
    chooser = balancer(prefill, decode)
    first = chooser.choose(300)
    assert first.predicted_s == pytest.approx(0.35)
    now[0] += 0.35 + 1.0  # a second late
    first.done(first_token=True)
    assert chooser.lateness[False] == pytest.approx(0.2)  # a fifth of the way there
    for _ in range(20):
        choice = chooser.choose(300)
        now[0] += 0.35 + 1.0
        choice.done(first_token=True)
    assert chooser.lateness[False] == pytest.approx(1.0, abs=0.02)
    failed = chooser.choose(300)
    now[0] += 5.0
    failed.done()  # no first token: its time says nothing of the next ones
    assert chooser.lateness[False] == pytest.approx(1.0, abs=0.02)
    assert not chooser.in_time(300, waited_s=0.7)  # 0.35 + 1.0 + 0.7 s, or 1.5 + 0.7 s on decode: past 2 s
    chooser.choose(1000)  # 1.0 s queued from now
    assert chooser.choose(300, waited_s=0.0) is None  # 1.0 + 0.35 + 1.0 s: past 2 s, and no room on decode


def test_waiting_contexts_are_asked_for_the_most_urgent_first():
    """Those still in time go first, in the order they came; a late one goes only where the
    prefill pool would otherwise run low. Asked first come first served, the late context would
    have taken the room that the one still in time needed."""
    prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    full_decode = [stats("decode", "d", prefill_tokens_per_s=200.0, decode_only_tpot_s=0.02, num_free_blocks=100)]
    chooser = balancer(prefill, full_decode)
    assert not chooser.choose(400).local  # 0.4 s queued on the prefill pool from now
    late, in_time, later = chooser.admit([(300, 1.7), (300, 1.2), (300, 1.3)])
    assert late is None and later is None  # 0.7 s queued: past PREFILL_FEED_S; 2.35 s for the third
    assert not in_time.local  # 1.2 + 0.4 + 0.35 s: within 2 s
    assert chooser._snapshot is None
    first_come = balancer(prefill, full_decode)
    first_come.choose(400)
    assert not first_come.choose(300, waited_s=1.7).local  # alone it feeds the pool (0.4 s queued)
    assert first_come.choose(300, waited_s=1.2) is None  # ...and the one in time is then late


def test_a_late_context_is_not_passed_over_for_good(monkeypatch):
    """A closed loop of six long prompts on one prefill replica: each first token brings a fresh
    context, which is in time. Asked in-time-first only, the oldest context was passed over at
    every turn until its wait ran out; once it has waited ``LATE_TURN_TTFTS`` targets it goes
    first, and no context waits much longer than the loop's own round."""
    from duet.router import balance

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]
    full_decode = [stats("decode", "d", prefill_tokens_per_s=200.0, decode_only_tpot_s=0.02, num_free_blocks=100)]
    chooser = balancer(prefill, full_decode)
    waiting = [now[0]] * 6  # when each of the waiting contexts came
    longest_wait = 0.0
    for _ in range(60):  # sixty first tokens, one context on the prefill replica at a time
        choices = chooser.admit([(1430, now[0] - since) for since in waiting])
        [(index, choice)] = [(index, choice) for index, choice in enumerate(choices) if choice is not None]
        longest_wait = max(longest_wait, now[0] - waiting.pop(index))
        now[0] += 1.43  # its prompt's time on the prefill replica
        choice.done(first_token=True)
        waiting.append(now[0])  # the client sends its next request
    longest_wait = max(longest_wait, *(now[0] - since for since in waiting))  # the ones still waiting too
    assert longest_wait <= balance.LATE_TURN_TTFTS * TTFT_S + 6 * 1.43 <= 20.0


def test_decode_replicas_that_share_the_cores_are_not_second_to_the_prefill_pool():
    """With cores of its own the prefill pool goes first while it has nothing queued; on shared
    cores a prompt computes on the same cores either way, so the sooner way decides (no hop and
    no transfer on the decode replica), within the decoders' TPOT room."""
    idle_prefill = [stats("prefill", "p", prefill_tokens_per_s=1000.0)]

    def decoding(shared: bool, tpot_s: float = 0.02) -> list[ReplicaStats]:
        return [stats("decode", "d", prefill_tokens_per_s=1000.0, decode_only_tpot_s=tpot_s, num_running=2, shared_cores=shared)]

    assert not balancer(idle_prefill, decoding(False)).choose(1000).local
    assert balancer(idle_prefill, decoding(True)).choose(1000).local
    assert not balancer(idle_prefill, decoding(True, tpot_s=TPOT_S)).choose(1000).local  # no TPOT room left


def test_on_an_idle_machine_a_decode_replica_that_shares_the_cores_computes_the_prompt():
    """Nothing decoding and nothing in flight: the decode replica has every core, as one engine
    would, even before any speed is measured (a long prompt otherwise goes through the prefill
    pool). Not so while the router has a stream decoding or a context in flight, while the
    replica reports work, or without shared cores."""
    prefill = [stats("prefill", "p")]
    shared = [stats("decode", "d", shared_cores=True)]
    assert not balancer(prefill, [stats("decode", "d")]).choose(500).local
    idle = balancer(prefill, shared)
    first = idle.choose(500)
    assert first.local
    second = idle.choose(500)
    assert not second.local  # the first is still in flight
    first.done(first_token=True)
    second.done(first_token=True)
    idle.live_streams = lambda: 1  # and now decoding
    assert not idle.choose(500).local
    for work in ({"num_running": 1}, {"num_waiting": 1}):
        assert not balancer(prefill, [stats("decode", "d", shared_cores=True, **work)]).choose(500).local


def test_before_any_measurement_a_burst_of_long_prompts_is_shared_by_threads_and_decode_room():
    # One thread each: the prefill pool first, then every other context local.
    both = balancer([stats("prefill", "p")], [stats("decode", "d")])
    assert [both.choose(256).local for _ in range(6)] == [False, True, False, True, False, True]
    # Three prefill threads to one decode thread: a quarter local.
    wide = balancer([stats("prefill", "p", threads=3)], [stats("decode", "d")])
    assert sum(wide.choose(256).local for _ in range(8)) == 2
    # Two decode replicas, one prefill thread: one after another, each finds the prefill pool idle and goes there.
    pools = [stats("prefill", "p")], [stats("decode", "d1"), stats("decode", "d2")]
    one_by_one = balancer(*pools)
    for _ in range(4):
        choice = one_by_one.choose(200)
        assert not choice.local
        choice.done(first_token=True)
    # A decode pool without room takes none.
    full = balancer([stats("prefill", "p")], [stats("decode", "d", num_decode_waiting=1)])
    assert not any(full.choose(256).local for _ in range(4))


def test_a_busy_holders_history_is_pulled_only_where_that_is_sooner_than_computing_it_again(monkeypatch):
    """#40's cost model: a turn of 1,200 tokens whose 1,024-token history (64 blocks) decode
    replica "d" holds, "d" too busy to take it (``busy_holder``: the orchestrator's rule). The
    local side is priced with the pull: the hops, one of d's steps (70 ms) and 64 blocks of
    720 KiB at what the replicas' sends moved (2 GB/s here: 24 ms), against 1,024 tokens
    computed again at 1,000 a second. Over a link of 1 MB/s (47 s) or for a history of one block
    (16 tokens: 16 ms), computing it again is sooner: no holder, and the prefill pool, idle,
    computes the turn past the last prompt it holds; with that pool 5 s behind, a decode replica
    computes it whole. The holder's own sends, where it has made some, give its rate."""
    from duet.block_pool import routing_block_hashes
    from duet.router import pd, serve_internals
    from duet.router.balance import PD_OVERHEAD_S
    from duet.router.held import Holder
    from duet.router.routing import IMBALANCE_THRESHOLD
    from tests.router.fake_serve import FakePool

    history = list(range(1000, 2024))
    turn = history + list(range(5000, 5176))
    block_bytes = 720 * 1024

    def pools(link, held, pending=0, decode_rate=1000.0, own_link=(0, 0.0), prefill_rate=1000.0):
        decode = [
            stats(
                "decode", name, prefill_tokens_per_s=decode_rate, decode_only_tpot_s=0.02, tpot_s=0.07, kv_bytes_per_block=block_bytes,
                prefix_hashes=routing_block_hashes(held, 16) if name == "d" else [],
            )
            for name in ("d", "e")
        ]
        last_prompt = routing_block_hashes(history[:960], 16)
        idle = [stats("prefill", "p", prefill_tokens_per_s=prefill_rate, prefix_hashes=last_prompt, prompt_tokens_pending=pending)]
        idle[0] = dataclasses.replace(idle[0], transfer=dataclasses.replace(idle[0].transfer, wire_bytes=link[0], wire_seconds=link[1]))
        decode[0] = dataclasses.replace(decode[0], transfer=dataclasses.replace(decode[0].transfer, wire_bytes=own_link[0], wire_seconds=own_link[1]))
        chooser = balancer(idle, decode)
        chooser.busy_holder = lambda holder: holder.replica_id == "d"
        return chooser

    priced = PD_OVERHEAD_S + 0.07 + 64 * block_bytes / 2e9
    fast_link = pools((2_000_000_000, 1.0), history)
    fast = fast_link.choose(len(turn), prefix_hashes=routing_block_hashes(turn, 16))
    assert fast.local and fast.num_tokens == 176 and fast.holder == Holder("d", "decode", 64)
    assert fast_link._pull_s(fast.holder) == pytest.approx(priced)
    slow = pools((1_000_000, 1.0), history).choose(len(turn), prefix_hashes=routing_block_hashes(turn, 16))
    assert (slow.local, slow.num_tokens, slow.holder) == (False, 240, None)
    # The holder's own sends, where it made some, price its pull: its links, beside its steps.
    hashes = routing_block_hashes(turn, 16)
    own_slow = pools((2_000_000_000, 1.0), history, own_link=(1_000_000, 1.0)).choose(len(turn), prefix_hashes=hashes)
    assert (own_slow.local, own_slow.holder) == (False, None)
    own_fast = pools((1_000_000, 1.0), history, own_link=(2_000_000_000, 1.0))
    assert own_fast.choose(len(turn), prefix_hashes=hashes).holder == fast.holder and own_fast._pull_s(fast.holder) == pytest.approx(priced)
    # 300 ms on the wire: cheaper than computing the history again, but the turn is then
    # sooner through the idle prefill pool. With that pool 5 s behind, over the slow link, the
    # turn is computed whole on a decode replica.
    medium = pools((64 * block_bytes, 0.3), history).choose(len(turn), prefix_hashes=routing_block_hashes(turn, 16))
    assert (medium.local, medium.num_tokens, medium.holder) == (False, 240, None)
    busy = pools((1_000_000, 1.0), history, pending=5000).choose(len(turn), prefix_hashes=routing_block_hashes(turn, 16))
    assert (busy.local, busy.num_tokens, busy.holder) == (True, len(turn), None)
    # A context waiting in the router is in time by the same price: 1.5 s waited, 176 tokens
    # on decode (0.18 s) and the pull over the 300 ms link (0.42 s) pass the 2 s target, the
    # prefill pool (a tenth as fast) further still; the holder not busy, it is in time.
    waited = pools((64 * block_bytes, 0.3), history, prefill_rate=100.0)
    assert not waited.in_time(len(turn), 1.5, hashes)
    waited.busy_holder = lambda holder: False
    assert waited.in_time(len(turn), 1.5, hashes)
    unmeasured = pools((1_000_000, 1.0), history, pending=5000, decode_rate=0.0)  # the prefill replicas' speed stands in
    assert unmeasured.choose(len(turn), prefix_hashes=routing_block_hashes(turn, 16)).holder is None
    short_turn = history[:16] + list(range(5000, 5176))
    short = pools((2_000_000_000, 1.0), history[:16]).choose(len(short_turn), prefix_hashes=routing_block_hashes(short_turn, 16))
    assert (short.local, short.num_tokens, short.holder) == (False, 176, None)
    not_busy = pools((1_000_000, 1.0), history)
    not_busy.busy_holder = lambda holder: False
    kept = not_busy.choose(len(turn), prefix_hashes=routing_block_hashes(turn, 16))
    assert kept.local and kept.holder == Holder("d", "decode", 64)

    # The orchestrator gives the balancer its rule: busier than the least loaded by more than
    # the pools' routers allow.
    listed = FakePool("decode")
    monkeypatch.setitem(serve_internals._ROUTERS, "decode", listed)
    listed.set("d", num_running=IMBALANCE_THRESHOLD + 2)
    listed.set("e", num_running=1)
    wired = balancer(None, None)
    pd.Orchestrator(object(), None, 16, wired)
    assert wired.busy_holder(Holder("d", "decode", 64)) and not wired.busy_holder(Holder("e", "decode", 64))
