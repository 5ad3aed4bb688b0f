"""Adaptive selective PD: per sequence, compute its context on the prefill pool or on the decode
replica it will run on, whichever gives it its first token sooner without breaking the decode
pool's time per output token.

Replica counts move in tens of seconds; load moves within one. So the router balances the two
stages per request, from what the replicas measured of themselves (``ReplicaStats``: prompt
tokens per second, time per output token, KV use) and what it sent each stage that has not yet
produced its first token (fresher than any report):

- through the prefill pool: the time it needs for what it has (``_wait_s``) and for the
  context, at its measured throughput, plus the fixed cost of going through two replicas
  (``PD_OVERHEAD_S``);
- on a decode replica: the same for the local prompts, at its measured prompt throughput (the
  prefill pool's per-replica figure until it has one), allowed only while the decode pool has
  room for it: no sequence waiting, KV not nearly full, and the time its prompts take leaves
  the sequences decoding there within their TPOT target.

The prefill pool comes first: its time has no other use, while a decode replica's time is its
sequences' next tokens, and a prompt computed there stalls every one of them for as long as it
takes. So a context goes through the prefill pool while that pool has nothing queued, or gives
its first token within ``PREFILL_FIRST_TTFT_SHARE`` of the TTFT target; only past that does the
sooner of the two ways decide. (Choosing the sooner way for every prompt kept the decode
replica computing half the prompts at 1 req/s on two cores, its decoding sequences near their
TPOT target, while the prefill core idled 40% of the time.) The share is a quarter: at three
quarters, a load past the prefill pool's capacity (4 req/s of 256-token prompts on two cores)
held its queue near that bound, so first tokens came at 1.5-2 s against a 2 s target (TTFT p90
1.7-2.05 s) while the decode core's sequences took 8 ms a token against 200; at a quarter the
same load gave TTFT p90 0.69-1.47 s and TPOT p50 23-55 ms over four runs, and the TPOT room
below still bounds what the decode pool takes.

The TPOT room is a share of time. A decode replica that gives each decoding sequence a token
every ``t`` while it computes no prompt (its ``decode_only_tpot_s``: step time over the tokens a
sequence gets per step, more than one where drafts are accepted), and spends a share ``f`` of
its time on local prompts, gives them a token every ``t / (1 - f)`` on average: within
``DECODE_TPOT_SHARE`` of the target while ``f <= 1 - t / (DECODE_TPOT_SHARE * tpot)``. TPOT is
a mean over a request's life (a few seconds), so the share is counted over the last
``LOCAL_WINDOW_S`` seconds of local prompts the router sent (fresher than any report: each
counts the moment it is sent), priced at what a token costs on the decode pool
(``tokens_per_s``: a prompt step there also decodes, which its prompt speed would count against
the prompt). A single prompt step is long; the mean is what the SLO bounds. Past that share,
the rest of the way to the TPOT target itself goes to prompts that would miss their TTFT target
through the prefill pool and meet it locally: a first token that comes too late loses the
request, a TPOT within its target loses nothing.

A context that would give its first token past the TTFT target through the prefill pool (counting
the time it has already waited for a choice), where the decode pool has no room for it, waits in
the router (``choose`` gives None) instead of joining the prefill pool's queue: it would be late
there anyway, and its place in the queue is better given to a context still in time. Placed
there, it would also hold its KV blocks on a decode replica, reserved for the transfer, for as
long as the queue takes: at 6 req/s of 256-token prompts on two cores, such reservations filled
the decode replica's KV within ten seconds, after which it ran 2-20 sequences and computed no
prompt of its own, while the prefill queue grew to 38 prompts. A late context still goes through
the prefill pool once that pool's queue is below ``PREFILL_FEED_S`` (its time has no other use),
and the router asks for the contexts still in time first (``in_time``), in the order they came,
then for the late ones; a late context that has waited ``LATE_TURN_TTFTS`` TTFT targets goes
before all of them, so none starves. Waiting until that queue was past the target itself held it there under
a load past both pools, so every context that joined it came late: at 4.3 req/s (seed 2000, 128
requests on two cores) goodput was 1.45-1.87 req/s, TTFT p90 5.3-7.3 s; asking for those in time
first and keeping the queue short gave 2.45-2.61 req/s in three runs (colocation 2.00-2.32 in the
same runs), each context in time or well past it.

A prediction leaves out what no report shows: the placement, which waits on the decode replica
for the end of its current step (a prompt chunk there is ~0.5 s on one core), the hops, reports
a second old. So each side keeps the running mean of how much later than predicted its first
tokens came (``lateness``) and adds it to what it predicts; without it, contexts predicted in
time under that load missed the target by 0.1-0.5 s.

Decode replicas that share their machine's cores with the prefill replicas (``cores.share``,
``duet.cores``) are not second to the prefill pool: a prompt computes on the same cores either
way, so the sooner way decides from the start (a local prompt saves the hop and the transfer),
within the decoders' TPOT room. While the machine is idle (nothing of this router's in flight or
decoding, a decode replica reporting nothing running) every prompt goes to such a replica: it
has every core, as one engine would.

A context whose start some replica holds (a conversation's history: ``prefix_hashes``, against
the hashes each replica reports holding, ``duet.block_pool.held_blocks``) costs each side only
the tokens past what its best replica holds: a decode replica holds the last turn's prompt and
the reply it decoded, a prefill replica at most the last prompt. Where the decode side holds
more, the prefill pool does not come first: computed there, the next turn's prompt computes
the reply again and sends the whole history's KV; computed where the history is, only the new
message (on the replica holding the history: the one this router's record names, where the
reports do not yet, ``duet.router.held``; else the decode pool's router finds it,
``duet.router.routing.prefix_first``). The sooner way decides, within the TPOT room.

Before any prefill replica measured its prompt throughput, the static ``local_prefill_threshold``
decides for a short prompt (shorter than it stays local). A longer one goes through the prefill
pool when that pool has none of this router's contexts in flight; otherwise to the side with less
of them a thread, the prefill pool on a tie (``_unmeasured``): the same model on either side
computes a prompt at about the same speed a thread, so a burst at a deployment's start does not
wait on the prefill pool while the decode replicas idle. With measurements, a short prompt goes
through the prefill pool when decode is busy, and a long one stays local when the prefill pool
is the bottleneck. While the prefill pool has no running replica at all (its last one died, and
Serve is starting another), every context stays local, whatever the rule: a call to the pool
would wait for the new replica.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence

from duet.block_pool import held_blocks
from duet.messages import ReplicaStats
from duet.router.held import HeldContexts, Holder

PD_OVERHEAD_S = 0.05  # two hops and a KV transfer, over computing locally
PREFILL_FIRST_TTFT_SHARE = 0.25  # of the TTFT target within which a prompt goes through the prefill pool
DECODE_TPOT_SHARE = 0.75  # of the TPOT target that decoding sequences may reach with local prompts among their steps
LOCAL_WINDOW_S = 5.0  # local prompts counted against the decode pool's time
MAX_LOCAL_KV_USAGE = 0.85
LATENESS_WEIGHT = 0.2  # of each first token's lateness in the running mean
PREFILL_FEED_S = 0.5  # queued on the prefill pool below which it takes contexts that will be late anyway
LATE_TURN_TTFTS = 4.0  # TTFT targets a late context waits before it goes ahead of those in time


def _now() -> float:
    return time.monotonic()  # read when called (tests set the time)


@dataclasses.dataclass(eq=False)
class Choice:
    """Where one context goes; ``done()`` once its first token (or failure) is in."""

    local: bool
    num_tokens: int
    balancer: StageBalancer | None = None
    sent_at: float = 0.0
    predicted_s: float | None = None  # when its first token should come after ``sent_at``, before lateness
    holder: Holder | None = None  # local: the replica this router knows holds the most of it (``duet.router.held``)

    def done(self, first_token: bool = False) -> None:
        """``first_token``: it came (its lateness counts), rather than the context failing or
        its client leaving."""
        if self.balancer is not None:
            self.balancer._done(self, first_token)
            self.balancer = None


class StageBalancer:
    """``stats(pool)`` gives the pool's replicas' latest ``ReplicaStats`` (None: not known yet);
    ``pool_size(pool)`` its running replicas (None: not known yet)."""

    def __init__(
        self,
        stats: Callable[[str], list[ReplicaStats] | None],
        pool_size: Callable[[str], int | None],
        local_prefill_threshold: int,
        ttft_s: float,
        tpot_s: float,
        clock: Callable[[], float] | None = None,
        block_size: int = 0,
    ) -> None:
        self.clock = clock or _now  # ``duet simulate`` gives its simulated time
        self.block_size = block_size  # the replicas' (0: not known, held prefixes are not counted)
        self.stats = stats
        self.pool_size = pool_size
        self.local_prefill_threshold = local_prefill_threshold
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self._outstanding = {True: 0, False: 0}  # context tokens sent (local or not) awaiting their first token
        self._in_flight: dict[bool, list[Choice]] = {True: [], False: []}  # the same choices, in the order sent
        self._last_done = {True: 0.0, False: 0.0}  # when a side last gave a first token
        self._local_sent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last LOCAL_WINDOW_S
        self.decisions = {True: 0, False: 0}
        # How much later than predicted each side's first tokens came, a running mean: what the
        # prediction leaves out (placement between two decode steps, the hops, stale reports).
        self.lateness = {True: 0.0, False: 0.0}
        self._snapshot: dict[str, list[ReplicaStats]] | None = None  # the pools' stats during ``admit``
        # The router's sequences now decoding (its ``Orchestrator`` sets it): with none, and none
        # waiting for a first token, a decode replica that shares the cores has them all.
        self.live_streams: Callable[[], int] = lambda: 0
        # The contexts the router's sequences ended with on decode replicas, and those it had the
        # prefill pool compute, before the replicas report them (its ``Orchestrator`` sets them).
        self.held: HeldContexts | None = None
        self.prefilled: HeldContexts | None = None

    def choose(self, num_tokens: int, waited_s: float = 0.0, prefix_hashes: Sequence[int] = ()) -> Choice | None:
        """Where a context of ``num_tokens`` (its routing hashes ``prefix_hashes``) that has waited
        ``waited_s`` for it goes, or None: it should wait (through the prefill pool it would give
        its first token past the TTFT target, that pool has enough queued not to idle, and the
        decode pool has no room for it)."""
        tokens, holder = self._to_compute(num_tokens, prefix_hashes)
        local, predicted_s = self._local(tokens, waited_s, num_tokens)
        if local is None:
            return None
        self.decisions[local] += 1
        self._outstanding[local] += tokens[local]
        choice = Choice(local, tokens[local], self, self.clock(), predicted_s, holder if local else None)
        self._in_flight[local].append(choice)
        if local:
            self._local_sent.append((choice.sent_at, tokens[local]))
            self._recent_local_tokens()  # trims: bounded however the choice was made
        return choice

    def _to_compute(self, num_tokens: int, prefix_hashes: Sequence[int]) -> tuple[dict[bool, int], Holder | None]:
        """The tokens each side (local: True) would compute of a context: those past the most its
        best replica holds (one at least: the last is always computed), by the replicas' reports
        and this router's records (``held``, ``prefilled``); and the decode replica the record
        names, where it holds more than any report says (else the pool's router finds the holder)."""
        tokens = {True: num_tokens, False: num_tokens}
        if not prefix_hashes or not self.block_size:
            return tokens, None
        holder = self.held.holder(prefix_hashes) if self.held is not None else None
        prefilled = self.prefilled.holder(prefix_hashes) if self.prefilled is not None else None
        for local, pool, recorded in ((True, "decode", holder), (False, "prefill", prefilled)):
            held = max((held_blocks(prefix_hashes, set(stats.prefix_hashes)) for stats in self._stats(pool) if stats.prefix_hashes), default=0)
            if recorded is not None and recorded.blocks > held:
                held = recorded.blocks
            elif local:
                holder = None
            tokens[local] = max(1, num_tokens - held * self.block_size)
        return tokens, holder

    def admit(self, contexts: list[tuple]) -> list[Choice | None]:
        """Choices for the contexts waiting in the router (``(num_tokens, waited_s)``, or with their
        ``prefix_hashes`` third, in the order they came; None: wait on), asked for the most
        urgent first: late ones that have waited their turn (``LATE_TURN_TTFTS`` targets), then
        those still ``in_time``, then the other late ones, each group in the order it came. Under
        a load past both pools, first come first served made every context late: each joined the
        end of a queue that was already past the target by the time it got there. A late context
        goes whenever a pool has time no context in time needs (``choose`` feeds an emptying
        prefill pool), or its turn came."""
        self._snapshot = {}  # each pool's stats read once for all of them
        try:
            turn_s = LATE_TURN_TTFTS * self.ttft_s
            rank = [
                1 if self.in_time(num_tokens, waited_s, *hashes) else 0 if waited_s >= turn_s else 2
                for num_tokens, waited_s, *hashes in contexts
            ]
            choices: list[Choice | None] = [None] * len(contexts)
            for index in sorted(range(len(contexts)), key=rank.__getitem__):
                choices[index] = self.choose(*contexts[index])
            return choices
        finally:
            self._snapshot = None

    def _stats(self, pool: str) -> list[ReplicaStats]:
        if self._snapshot is None:
            return self.stats(pool) or []
        if pool not in self._snapshot:
            self._snapshot[pool] = self.stats(pool) or []
        return self._snapshot[pool]

    def _done(self, choice: Choice, first_token: bool) -> None:
        self._outstanding[choice.local] -= choice.num_tokens
        self._in_flight[choice.local].remove(choice)
        self._last_done[choice.local] = now = self.clock()
        if first_token and choice.predicted_s is not None:
            late_s = now - choice.sent_at - choice.predicted_s
            self.lateness[choice.local] += LATENESS_WEIGHT * (late_s - self.lateness[choice.local])

    def _wait_s(self, local: bool, tokens_per_s: float, reported_pending: int) -> float:
        """How long a side would take to get through what it has before a new context: what this
        router sent it, in order at ``tokens_per_s`` from when each could start (sent, or the one
        before it done: one half done counts for half), and what its replicas report beyond that
        (other routers')."""
        free_at = self._last_done[local]
        for choice in self._in_flight[local]:
            free_at = max(free_at, choice.sent_at) + choice.num_tokens / tokens_per_s
        others = max(0, reported_pending - self._outstanding[local])
        return max(0.0, free_at - self.clock()) + others / tokens_per_s

    def in_time(self, num_tokens: int, waited_s: float, prefix_hashes: Sequence[int] = ()) -> bool:
        """Whether a context that has waited ``waited_s`` could still give its first token within
        the TTFT target the fastest way with nothing queued before it: through a prefill replica,
        or on a decode replica, each computing what it does not hold (True before any replica
        measured its prompt throughput)."""
        tokens, _ = self._to_compute(num_tokens, prefix_hashes)
        ways = [
            tokens[local] / stats.load.prefill_tokens_per_s + (self.lateness[True] if local else PD_OVERHEAD_S + self.lateness[False])
            for local, pool in ((False, "prefill"), (True, "decode"))
            for stats in self._stats(pool)
            if stats.load.prefill_tokens_per_s > 0
        ]
        return not ways or waited_s + min(ways) <= self.ttft_s

    def _local(self, tokens: dict[bool, int], waited_s: float, num_tokens: int) -> tuple[bool | None, float | None]:
        """Where a context of ``num_tokens`` goes (None: it waits), ``tokens`` what each side would
        compute of it (``_to_compute``), and in how long its first token should come by the
        replicas' speeds and what this router sent, before ``lateness`` (None: not known)."""
        if self.pool_size("prefill") == 0:
            return True, None
        prefill = self._stats("prefill")
        decode = self._stats("decode")
        shared = bool(decode) and all(stats.cores.shared_cores for stats in decode)
        if shared and self._machine_idle(decode):
            return True, None  # one engine on every core: no hop, no transfer
        prefill_rates = [stats.load.prefill_tokens_per_s for stats in prefill if stats.load.prefill_tokens_per_s > 0]
        if not prefill_rates or not decode:
            # Short: what decode computes of it, where decode holds more of it; else the whole context.
            short = (tokens[True] if tokens[True] < tokens[False] else num_tokens) < self.local_prefill_threshold
            return short or (bool(prefill) and bool(decode) and self._unmeasured(tokens, prefill, decode)), None
        prefill_rate = sum(prefill_rates)
        per_replica = prefill_rate / len(prefill_rates)
        decode_rate = sum(stats.load.prefill_tokens_per_s or per_replica for stats in decode)
        prefill_wait = self._wait_s(False, prefill_rate, sum(stats.scheduler.prompt_tokens_pending for stats in prefill))
        through_prefill = prefill_wait + tokens[False] / prefill_rate + PD_OVERHEAD_S
        prefill_first = not shared and tokens[True] >= tokens[False]  # not where decode holds more of it
        if prefill_first and (prefill_wait == 0 or through_prefill <= PREFILL_FIRST_TTFT_SHARE * self.ttft_s):
            return False, through_prefill
        on_decode = self._wait_s(True, decode_rate, sum(stats.scheduler.prompt_tokens_pending for stats in decode)) + tokens[True] / decode_rate
        first_token_s = {False: through_prefill + self.lateness[False], True: on_decode + self.lateness[True]}
        in_time = waited_s + first_token_s[False] <= self.ttft_s
        through_prefill_or_wait = (False, through_prefill) if in_time or prefill_wait <= PREFILL_FEED_S else (None, None)
        if first_token_s[True] >= first_token_s[False]:
            return through_prefill_or_wait
        token_cost_s = len(decode) / sum(stats.load.tokens_per_s or stats.load.prefill_tokens_per_s or per_replica for stats in decode)
        spent_s = (self._recent_local_tokens() + tokens[True]) * token_cost_s
        if spent_s <= self._local_prompt_budget_s(decode, DECODE_TPOT_SHARE):
            return True, on_decode
        rescues = not in_time and waited_s + first_token_s[True] <= self.ttft_s
        if rescues and spent_s <= self._local_prompt_budget_s(decode, 1.0):
            return True, on_decode
        return through_prefill_or_wait

    def _unmeasured(self, tokens: dict[bool, int], prefill: list[ReplicaStats], decode: list[ReplicaStats]) -> bool:
        """Before a prompt speed is known: whether the context goes to the decode pool, which has
        room for it. Only while the prefill pool computes this router's earlier contexts: then to
        the side with fewer of them a thread."""
        if not self._outstanding[False] or self._local_prompt_budget_s(decode, DECODE_TPOT_SHARE) <= 0:
            return False

        def per_thread(local: bool, pool: list[ReplicaStats]) -> float:
            return (self._outstanding[local] + tokens[local]) / sum(max(1, stats.cores.threads) for stats in pool)

        return per_thread(True, decode) < per_thread(False, prefill)

    def _machine_idle(self, decode: list[ReplicaStats]) -> bool:
        """Nothing of this router's in flight or decoding, and a decode replica reports nothing running."""
        nothing_sent = not self._in_flight[True] and not self._in_flight[False] and self.live_streams() == 0
        return nothing_sent and any(stats.scheduler.num_running == 0 and not stats.scheduler.num_waiting for stats in decode)

    def _recent_local_tokens(self) -> int:
        """Context tokens sent local in the last ``LOCAL_WINDOW_S`` (older ones are dropped)."""
        since = self.clock() - LOCAL_WINDOW_S
        while self._local_sent and self._local_sent[0][0] < since:
            self._local_sent.popleft()
        return sum(tokens for _, tokens in self._local_sent)

    def _local_prompt_budget_s(self, decode: list[ReplicaStats], tpot_share: float) -> float:
        """Seconds of the last ``LOCAL_WINDOW_S`` the decode pool may spend on local prompts: each
        replica with room gives the share its decoding sequences leave within ``tpot_share`` of
        the TPOT target."""
        budget = 0.0
        for stats in decode:
            if stats.scheduler.num_decode_waiting or stats.kv.kv_usage >= MAX_LOCAL_KV_USAGE:
                continue
            budget += LOCAL_WINDOW_S * max(0.0, 1.0 - stats.load.decode_only_tpot_s / (tpot_share * self.tpot_s))
        return budget
