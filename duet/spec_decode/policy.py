"""How many tokens each request drafts this step: the choice that maximises expected tokens per second.

A step's time is modelled as ``a + b * tokens`` (fitted online, with forgetting, to the
target's measured steps: on a GPU or a CPU at batch 1 ``a`` dominates and verification is
nearly free; on a CPU at batch 8 ``b`` is large and a rejected draft costs real time). A
request's drafts are accepted one after another with probability ``alpha`` each, estimated
from its own verified drafts. Drafting one more token for a request adds ``alpha ** j`` expected
tokens (its j-th draft is used only if the j - 1 before it were) and ``b`` plus the proposer's
own cost per token to the step; tokens go to the requests with the largest gains while a gain
beats the step's current tokens-per-second rate.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# Past steps' weight in the cost fit and past drafts' weight in a request's acceptance estimate.
_COST_FORGETTING = 0.98
_ACCEPTANCE_FORGETTING = 0.8
# A request that has not drafted for this many steps drafts one token, to re-measure its
# acceptance; the wait doubles after each rejected probe (up to the maximum) and resets on success.
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256


class StepCostModel:
    """Least-squares fit of step seconds = a + b * tokens, older steps weighing less."""

    def __init__(self) -> None:
        self._weight = self._sum_x = self._sum_y = self._sum_xx = self._sum_xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        for name in ("_weight", "_sum_x", "_sum_y", "_sum_xx", "_sum_xy"):
            setattr(self, name, getattr(self, name) * _COST_FORGETTING)
        self._weight += 1.0
        self._sum_x += num_tokens
        self._sum_y += seconds
        self._sum_xx += num_tokens * num_tokens
        self._sum_xy += num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before steps of different sizes have been seen."""
        spread = self._weight * self._sum_xx - self._sum_x**2
        if self._weight < 2 or spread <= 1e-9 * max(1.0, self._sum_xx):
            return None
        slope = max(0.0, (self._weight * self._sum_xy - self._sum_x * self._sum_y) / spread)
        intercept = max(0.0, (self._sum_y - slope * self._sum_x) / self._weight)
        return intercept, slope


@dataclass
class AcceptanceEstimate:
    """One request's draft acceptance: accepted tokens over accepted plus rejections (geometric MLE),
    starting from one pseudo-draft at the prior."""

    accepted: float = 0.0
    trials: float = 0.0
    steps_idle: int = 0
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False

    def alpha(self, prior: float) -> float:
        return (self.accepted + prior) / (self.trials + 1.0)

    def wants_probe(self, drafting: bool) -> bool:
        """Called once per step with whether the policy gave the request drafts."""
        self.steps_idle = 0 if drafting else self.steps_idle + 1
        self.probing = not drafting and self.steps_idle >= self.probe_interval
        if self.probing:
            self.steps_idle = 0
        return self.probing

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if self.probing:
            self.probe_interval = PROBE_INTERVAL if num_accepted else min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
            self.probing = False
        self.accepted = self.accepted * _ACCEPTANCE_FORGETTING + num_accepted
        # Every accepted draft is a success; a rejection (if any) is the one failure.
        self.trials = self.trials * _ACCEPTANCE_FORGETTING + num_accepted + (num_accepted < num_drafts)


def choose_draft_lengths(
    alphas: list[float],
    max_lengths: list[int],
    num_tokens: int,
    cost: tuple[float, float] | None,
    draft_cost_per_token: float,
) -> list[int]:
    """Draft length per candidate request for a step that already computes ``num_tokens`` tokens
    (one per running request) and so emits that many; ``cost`` = (a, b), None: draft fully."""
    if cost is None:
        return list(max_lengths)
    intercept, slope = cost
    expected_tokens = float(num_tokens)
    seconds = intercept + slope * num_tokens
    lengths = [0] * len(alphas)
    # Max-heap of each request's next gain: alpha ** (drafted + 1).
    heap = [(-alpha, index) for index, alpha in enumerate(alphas) if max_lengths[index] > 0 and alpha > 0]
    heapq.heapify(heap)
    added_cost = slope + draft_cost_per_token
    while heap:
        negative_gain, index = heapq.heappop(heap)
        gain = -negative_gain
        # Worth it iff (tokens + gain) / (seconds + added_cost) > tokens / seconds.
        if gain * seconds <= expected_tokens * added_cost:
            break
        lengths[index] += 1
        expected_tokens += gain
        seconds += added_cost
        if lengths[index] < max_lengths[index]:
            heapq.heappush(heap, (-gain * alphas[index], index))
    return lengths
