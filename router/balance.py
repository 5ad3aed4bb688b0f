"""Adaptive selective PD: per sequence, compute its context on the prefill pool or on the decode
replica it will run on, whichever gives it its first token sooner without breaking the decode
pool's time per output token.

Replica counts move in tens of seconds; load moves within one. So the router balances the two
stages per request, from what the replicas measured of themselves (``ReplicaStats``: prompt
tokens per second, decode step time, KV use) and what it sent each stage that has not yet
produced its first token (fresher than any report):

- through the prefill pool: its backlog over its throughput, plus the fixed cost of going
  through two replicas (``PD_OVERHEAD_S``);
- on a decode replica: its backlog of local prompts over its measured prompt throughput (the
  prefill pool's per-replica figure until it has one), allowed only while the decode pool has
  headroom: recent decode steps within half the TPOT target, no sequence waiting, KV not
  nearly full.

Before any replica measured its prompt throughput, the static ``local_prefill_threshold`` decides
(prompts shorter than it stay local): the rule's starting point, not the rule. With
measurements, a short prompt goes through the prefill pool when decode is busy, and a long one
stays local when the prefill pool is the bottleneck. While the prefill pool has no running
replica at all (its last one died, and Serve is starting another), every context stays local,
whatever the rule: a call to the pool would wait for the new replica.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from duet.messages import ReplicaStats

PD_OVERHEAD_S = 0.05  # two hops and a KV transfer, over computing locally
DECODE_STEP_HEADROOM = 0.5  # of the TPOT target a decode step may take before local prompts stop
MAX_LOCAL_KV_USAGE = 0.85


@dataclasses.dataclass
class Choice:
    """Where one context goes; ``done()`` once its first token (or failure) is in."""

    local: bool
    num_tokens: int
    balancer: StageBalancer | None = None

    def done(self) -> None:
        if self.balancer is not None:
            self.balancer._outstanding[self.local] -= self.num_tokens
            self.balancer = None


class StageBalancer:
    """``stats(pool)`` gives the pool's replicas' latest ``ReplicaStats`` (None: not known yet);
    ``pool_size(pool)`` its running replicas (None: not known yet)."""

    def __init__(
        self,
        stats: Callable[[str], list[ReplicaStats] | None],
        pool_size: Callable[[str], int | None],
        local_prefill_threshold: int,
        tpot_s: float,
    ) -> None:
        self.stats = stats
        self.pool_size = pool_size
        self.local_prefill_threshold = local_prefill_threshold
        self.tpot_s = tpot_s
        self._outstanding = {True: 0, False: 0}  # context tokens sent (local or not) awaiting their first token
        self.decisions = {True: 0, False: 0}

    def choose(self, num_tokens: int) -> Choice:
        local = self._local(num_tokens)
        self.decisions[local] += 1
        self._outstanding[local] += num_tokens
        return Choice(local, num_tokens, self)

    def _local(self, num_tokens: int) -> bool:
        if self.pool_size("prefill") == 0:
            return True
        prefill = self.stats("prefill") or []
        decode = self.stats("decode") or []
        prefill_rates = [stats.prefill_tokens_per_s for stats in prefill if stats.prefill_tokens_per_s > 0]
        if not prefill_rates or not decode:
            return num_tokens < self.local_prefill_threshold
        if not self._decode_has_headroom(decode):
            return False
        prefill_backlog = max(self._outstanding[False], sum(stats.prompt_tokens_pending for stats in prefill))
        through_prefill = (prefill_backlog + num_tokens) / sum(prefill_rates) + PD_OVERHEAD_S
        per_replica = sum(prefill_rates) / len(prefill_rates)
        decode_rate = sum(stats.prefill_tokens_per_s or per_replica for stats in decode)
        decode_backlog = max(self._outstanding[True], sum(stats.prompt_tokens_pending for stats in decode))
        on_decode = (decode_backlog + num_tokens) / decode_rate
        return on_decode < through_prefill

    def _decode_has_headroom(self, decode: list[ReplicaStats]) -> bool:
        return any(
            stats.decode_step_s <= DECODE_STEP_HEADROOM * self.tpot_s and stats.num_decode_waiting == 0 and stats.kv_usage < MAX_LOCAL_KV_USAGE
            for stats in decode
        )
