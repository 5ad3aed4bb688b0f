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

Past the TTFT target, a context the decode pool cannot take waits in the router (``choose``
gives None) instead of joining the prefill pool's queue: placed there, it would hold its KV
blocks on a decode replica, reserved for the transfer, for as long as the queue takes. At 6
req/s of 256-token prompts on two cores, those reservations filled the decode replica's KV
within ten seconds. It then ran 2-20 sequences, computed no prompt of its own (its KV was
full), and the prefill queue grew to 38 prompts. Held in the router, the context is placed once
either way has room for it, in the order contexts came.

Before any replica measured its prompt throughput, the static ``local_prefill_threshold`` decides
(prompts shorter than it stay local): the rule's starting point, not the rule. With
measurements, a short prompt goes through the prefill pool when decode is busy, and a long one
stays local when the prefill pool is the bottleneck. While the prefill pool has no running
replica at all (its last one died, and Serve is starting another), every context stays local,
whatever the rule: a call to the pool would wait for the new replica.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from duet.messages import ReplicaStats

PD_OVERHEAD_S = 0.05  # two hops and a KV transfer, over computing locally
PREFILL_FIRST_TTFT_SHARE = 0.25  # of the TTFT target within which a prompt goes through the prefill pool
DECODE_TPOT_SHARE = 0.75  # of the TPOT target that decoding sequences may reach with local prompts among their steps
LOCAL_WINDOW_S = 5.0  # local prompts counted against the decode pool's time
MAX_LOCAL_KV_USAGE = 0.85


@dataclasses.dataclass(eq=False)
class Choice:
    """Where one context goes; ``done()`` once its first token (or failure) is in."""

    local: bool
    num_tokens: int
    balancer: StageBalancer | None = None
    sent_at: float = 0.0

    def done(self) -> None:
        if self.balancer is not None:
            self.balancer._done(self)
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
    ) -> None:
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

    def choose(self, num_tokens: int) -> Choice | None:
        """Where a context of ``num_tokens`` goes, or None: it should wait (the prefill pool's
        queue is past the TTFT target and the decode pool has no room for it)."""
        local = self._local(num_tokens)
        if local is None:
            return None
        self.decisions[local] += 1
        self._outstanding[local] += num_tokens
        choice = Choice(local, num_tokens, self, time.monotonic())
        self._in_flight[local].append(choice)
        if local:
            self._local_sent.append((choice.sent_at, num_tokens))
            self._recent_local_tokens()  # trims: bounded however the choice was made
        return choice

    def _done(self, choice: Choice) -> None:
        self._outstanding[choice.local] -= choice.num_tokens
        self._in_flight[choice.local].remove(choice)
        self._last_done[choice.local] = time.monotonic()

    def _wait_s(self, local: bool, tokens_per_s: float, reported_pending: int) -> float:
        """How long a side would take to get through what it has before a new context: what this
        router sent it, in order at ``tokens_per_s`` from when each could start (sent, or the one
        before it done: one half done counts for half), and what its replicas report beyond that
        (other routers')."""
        free_at = self._last_done[local]
        for choice in self._in_flight[local]:
            free_at = max(free_at, choice.sent_at) + choice.num_tokens / tokens_per_s
        others = max(0, reported_pending - self._outstanding[local])
        return max(0.0, free_at - time.monotonic()) + others / tokens_per_s

    def _local(self, num_tokens: int) -> bool | None:
        if self.pool_size("prefill") == 0:
            return True
        prefill = self.stats("prefill") or []
        decode = self.stats("decode") or []
        prefill_rates = [stats.prefill_tokens_per_s for stats in prefill if stats.prefill_tokens_per_s > 0]
        if not prefill_rates or not decode:
            return num_tokens < self.local_prefill_threshold
        prefill_rate = sum(prefill_rates)
        per_replica = prefill_rate / len(prefill_rates)
        decode_rate = sum(stats.prefill_tokens_per_s or per_replica for stats in decode)
        prefill_wait = self._wait_s(False, prefill_rate, sum(stats.prompt_tokens_pending for stats in prefill))
        through_prefill = prefill_wait + num_tokens / prefill_rate + PD_OVERHEAD_S
        if prefill_wait == 0 or through_prefill <= PREFILL_FIRST_TTFT_SHARE * self.ttft_s:
            return False
        through_prefill_or_wait = None if prefill_wait > self.ttft_s else False
        on_decode = self._wait_s(True, decode_rate, sum(stats.prompt_tokens_pending for stats in decode)) + num_tokens / decode_rate
        if on_decode >= through_prefill:
            return through_prefill_or_wait
        token_cost_s = len(decode) / sum(stats.tokens_per_s or stats.prefill_tokens_per_s or per_replica for stats in decode)
        spent_s = (self._recent_local_tokens() + num_tokens) * token_cost_s
        if spent_s <= self._local_prompt_budget_s(decode, DECODE_TPOT_SHARE):
            return True
        rescues = through_prefill > self.ttft_s >= on_decode
        if rescues and spent_s <= self._local_prompt_budget_s(decode, 1.0):
            return True
        return through_prefill_or_wait

    def _recent_local_tokens(self) -> int:
        """Context tokens sent local in the last ``LOCAL_WINDOW_S`` (older ones are dropped)."""
        since = time.monotonic() - LOCAL_WINDOW_S
        while self._local_sent and self._local_sent[0][0] < since:
            self._local_sent.popleft()
        return sum(tokens for _, tokens in self._local_sent)

    def _local_prompt_budget_s(self, decode: list[ReplicaStats], tpot_share: float) -> float:
        """Seconds of the last ``LOCAL_WINDOW_S`` the decode pool may spend on local prompts: each
        replica with room gives the share its decoding sequences leave within ``tpot_share`` of
        the TPOT target."""
        budget = 0.0
        for stats in decode:
            if stats.num_decode_waiting or stats.kv_usage >= MAX_LOCAL_KV_USAGE:
                continue
            budget += LOCAL_WINDOW_S * max(0.0, 1.0 - stats.decode_only_tpot_s / (tpot_share * self.tpot_s))
        return budget
