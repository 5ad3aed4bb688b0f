"""Adaptive selective PD: per context, compute it on the prefill pool or on the decode replica
that will run it, whichever gives its first token sooner without breaking the decode pool's
time per output token. Replica counts move in tens of seconds, load within one, so the router
balances the two stages per request, from the replicas' reports (``ReplicaStats``: prompt
tokens per second, time per output token, KV use) and what it sent each side that has not yet
given its first token (fresher than any report). The rules (the runs behind them:
docs/benchmarks.md, "Adaptive selective PD"):

- **Prices.** Through the prefill pool: its queue (``_wait_s``) and the context at its measured
  speed, plus ``PD_OVERHEAD_S`` (two hops and a transfer). Locally: the same at the decode
  replicas' prompt speed (the prefill pool's per-replica figure until they have one). Each
  side adds the running mean of how late its first tokens came against the prediction
  (``lateness``: the placement waits for a step to end, the hops, reports a second old).
- **Local only with room**: no sequence waiting for room, KV below ``MAX_LOCAL_KV_USAGE``, and
  TPOT room: a replica whose decode-only TPOT is ``t`` and which spends a share ``f`` of its
  time on prompts gives its streams a token every ``t / (1 - f)``, kept within
  ``DECODE_TPOT_SHARE`` of the target; ``f`` counts the local prompts sent over the last
  ``LOCAL_WINDOW_S``, at what a token costs there (a prompt step there also decodes). Past that
  share, the rest of the way to the target goes to prompts that would be late through the
  prefill pool and in time locally.
- **The prefill pool first** while it has nothing queued or gives the first token within
  ``PREFILL_FIRST_TTFT_SHARE`` of the TTFT target: its time has no other use, while a prompt on
  a decode replica stalls every stream there. Past that, the sooner side.
- **A context late either way waits** in the router (``choose`` gives None), holding no KV,
  when the prefill pool would give its first token past the TTFT target and the decode pool
  has no room; it still joins the prefill pool once that queue is below ``PREFILL_FEED_S``.
  Waiting contexts are asked for in arrival order, those still in time first; one that has
  waited ``LATE_TURN_TTFTS`` targets goes before all of them, so none starves.
- **Held prefixes.** A context costs each side only the tokens past what its best replica holds
  (the reports' routing hashes, ``duet.block_pool.held_blocks``, and this router's own record,
  ``duet.router.held``): a decode replica holds the last prompt and the reply it decoded, a
  prefill replica at most the last prompt. Where the decode side holds more, the prefill pool
  does not come first: the sooner side decides, within the TPOT room, and names the decode
  replica holding the most (``Choice.holder``), where the router reserves the context first or,
  that replica busy, from which it pulls the history (``duet.router.pd``).
- **A pull's cost.** Where that replica is too busy to take the context (``busy_holder``), the
  local side is priced with its history pulled from there (``_pull_s``: the hops, one of the
  holder's steps, and the history's KV at what the holder's sends, or where it made none every
  replica's, moved a second, ``TransferStats.wire_bytes / wire_seconds``) or computed again by
  the receiver, whichever is sooner; computed again, the choice names no holder. A short
  history is computed sooner than it is pulled, and so is a long one over a slow link. A
  context waiting in the router is judged in time or late (``in_time``) at the same price.
- **Shared cores** (``cores.share``, ``duet.cores``): a prompt computes on the same cores either
  way, so the sooner side decides from the start; on an idle machine (nothing of this router's
  in flight, a decode replica running nothing) every prompt goes to such a decode replica.
- **Before any prefill replica measured its speed**, a prompt shorter than
  ``local_prefill_threshold`` stays local; a longer one goes through the prefill pool when
  that pool has none of this router's contexts in flight, else (the decode pool having TPOT
  room) to the side with less of them a thread, the prefill pool on a tie: a burst at a
  deployment's start does not queue on the prefill pool while the decode replicas idle. With
  no running prefill replica at all, every context stays local: a call to the pool would wait
  for its next replica.
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
    holder: Holder | None = None  # local: the decode replica holding the most of it (record or reports)

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
        # Whether a decode replica holding a context's history is too busy to take it (the
        # orchestrator's rule, ``duet.router.targets``): its history is then pulled or recomputed.
        self.busy_holder: Callable[[Holder], bool] = lambda holder: False

    def choose(self, num_tokens: int, waited_s: float = 0.0, prefix_hashes: Sequence[int] = ()) -> Choice | None:
        """Where a context of ``num_tokens`` (its routing hashes ``prefix_hashes``) that has waited
        ``waited_s`` for it goes, or None: it should wait (through the prefill pool it would give
        its first token past the TTFT target, that pool has enough queued not to idle, and the
        decode pool has no room for it)."""
        tokens, holder, pull_s = self._priced(num_tokens, prefix_hashes)
        local, predicted_s = self._local(tokens, waited_s, num_tokens, pull_s or 0.0)
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
        and this router's records (``held``, ``prefilled``); and the decode replica holding the
        most of it, by the record where it says more than the reports, else by the reports."""
        tokens = {True: num_tokens, False: num_tokens}
        if not prefix_hashes or not self.block_size:
            return tokens, None
        holder = self.held.holder(prefix_hashes) if self.held is not None else None
        prefilled = self.prefilled.holder(prefix_hashes) if self.prefilled is not None else None
        for local, pool, recorded in ((True, "decode", holder), (False, "prefill", prefilled)):
            held, reporter = max(
                ((held_blocks(prefix_hashes, set(stats.prefix_hashes)), stats.replica_id) for stats in self._stats(pool)),
                default=(0, None),
            )
            if recorded is not None and recorded.blocks > held:
                held = recorded.blocks
            elif local:
                holder = Holder(reporter, pool, held) if held else None
            tokens[local] = max(1, num_tokens - held * self.block_size)
        return tokens, holder

    def _priced(self, num_tokens: int, prefix_hashes: Sequence[int]) -> tuple[dict[bool, int], Holder | None, float | None]:
        """``_to_compute``'s tokens and holder, and the pull's cost; where that holder is too busy
        to take the context, pulled from or computed again as ``_pull_or_recompute`` says."""
        tokens, holder = self._to_compute(num_tokens, prefix_hashes)
        if holder is not None and holder.replica_id is not None and self.busy_holder(holder):
            return self._pull_or_recompute(tokens, num_tokens, holder)
        return tokens, holder, None

    def _pull_or_recompute(self, tokens: dict[bool, int], num_tokens: int, holder: Holder) -> tuple[dict[bool, int], Holder | None, float | None]:
        """For a context whose history ``holder`` holds but is too busy to take: ``tokens``,
        ``holder`` and the pull's cost where pulling that history is sooner than the receiver
        computing it (at the decode replicas' prompt speed, the prefill replicas' until they have
        one; with neither measured, it pulls); else the whole context to compute locally, no
        holder and no pull."""
        pull_s = self._pull_s(holder)

        def measured(pool: str) -> list[float]:
            return [stats.load.prefill_tokens_per_s for stats in self._stats(pool) if stats.load.prefill_tokens_per_s > 0]

        rates = measured("decode") or measured("prefill")
        if not rates or pull_s < (num_tokens - tokens[True]) / (sum(rates) / len(rates)):
            return tokens, holder, pull_s
        return {True: num_tokens, False: tokens[False]}, None, None

    def _pull_s(self, holder: Holder) -> float:
        """What pulling ``holder``'s blocks of a history costs before the receiver computes the
        rest: the hops (``PD_OVERHEAD_S``), one step of the holder's (its time per output token:
        the pull's one token is computed in its batch), and the blocks' bytes at what the
        holder's own sends moved a second where it has sent (its links, beside its own steps),
        else every replica's (free before any send measured it, or without the holder's report)."""
        reports = self._stats("prefill") + self._stats("decode")
        own = next((stats for stats in reports if stats.replica_id == holder.replica_id), None)
        if own is None:
            return PD_OVERHEAD_S
        senders = [own] if own.transfer.wire_seconds > 0 else reports
        wire_bytes = sum(stats.transfer.wire_bytes for stats in senders)
        wire_s = sum(stats.transfer.wire_seconds for stats in senders)
        transfer_s = holder.blocks * own.kv.kv_bytes_per_block * wire_s / wire_bytes if wire_bytes and wire_s > 0 else 0.0
        return PD_OVERHEAD_S + own.load.tpot_s + transfer_s

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
        or on a decode replica, each computing what it does not hold (a busy holder's history
        pulled or computed again, as ``choose`` prices it; True before any replica measured its
        prompt throughput)."""
        tokens, _, pull_s = self._priced(num_tokens, prefix_hashes)
        local_s = self.lateness[True] + (pull_s or 0.0)
        ways = [
            tokens[local] / stats.load.prefill_tokens_per_s + (local_s if local else PD_OVERHEAD_S + self.lateness[False])
            for local, pool in ((False, "prefill"), (True, "decode"))
            for stats in self._stats(pool)
            if stats.load.prefill_tokens_per_s > 0
        ]
        return not ways or waited_s + min(ways) <= self.ttft_s

    def _local(self, tokens: dict[bool, int], waited_s: float, num_tokens: int, pull_s: float = 0.0) -> tuple[bool | None, float | None]:
        """Where a context of ``num_tokens`` goes (None: it waits), ``tokens`` what each side would
        compute of it (``_to_compute``), ``pull_s`` what its history's pull adds locally, and in
        how long its first token should come by the replicas' speeds and what this router sent,
        before ``lateness`` (None: not known)."""
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
        on_decode = self._wait_s(True, decode_rate, sum(stats.scheduler.prompt_tokens_pending for stats in decode)) + tokens[True] / decode_rate + pull_s
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
