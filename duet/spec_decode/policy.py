"""How many tokens each request drafts this step: the choice that maximises expected tokens per second.

A step's time is modelled as ``a + b * tokens``, plus ``c`` when it verifies drafts (fitted
online, with forgetting, to the target's measured steps). ``c`` is verification's fixed price:
a step with drafts writes every row's logits and samples them, where a greedy step without
drafts takes each row's token from the LM head's fused argmax (on a 2-core EPYC Zen 4 at batch 8,
fitted at 2-7 ms on a 20-22 ms step). On a GPU or a CPU at batch 1 ``a`` dominates and verification is
nearly free; on a CPU at batch 8 ``b`` and ``c`` are large and a rejected draft costs real time.
A request's drafts are accepted one after another with probability ``alpha`` each, estimated
from its own verified drafts. Drafting one more token for a request adds ``alpha ** j`` expected
tokens (its j-th draft is used only if the j - 1 before it were) and ``b`` plus the proposer's
own cost per token to the step; tokens go to the requests with the largest gains while a gain
beats the step's tokens-per-second rate with ``c`` paid, and the step drafts at all only if
that rate beats the rate without drafts.

A request the rule leaves without drafts probes now and then (one draft, to re-measure its
acceptance); probes due within half an interval of each other are taken in the same step, so
that the batch pays ``c`` once for them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

# Past steps' weight in the cost fit and past drafts' weight in a request's acceptance estimate.
_COST_FORGETTING = 0.98
_ACCEPTANCE_FORGETTING = 0.8
# A cost fit whose normal matrix is worse conditioned than this is not determined by the steps seen.
_MAX_CONDITION = 1e12
# A request that has not drafted for this many steps drafts one token, to re-measure its
# acceptance; the wait doubles after each rejected probe (up to the maximum) and resets on success.
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256


@dataclass(frozen=True)
class StepCost:
    """Seconds of a step: ``intercept + per_token * tokens``, plus ``verification`` if it verifies drafts."""

    intercept: float
    per_token: float
    verification: float = 0.0


class StepCostModel:
    """Least-squares fit of step seconds = a + b * tokens + c * verifies, older steps weighing
    less. ``c`` is fitted once both kinds of step have been seen lately; before that it is 0 (a
    batch that always verifies pays it in ``a``)."""

    # The weight each kind of step needs among the remembered ones for c to be fitted.
    MIN_KIND_WEIGHT = 1.0

    def __init__(self) -> None:
        self._normal = np.zeros((3, 3))  # sum of w * x x^T over x = (1, tokens, verifies)
        self._moment = np.zeros(3)  # sum of w * x * seconds

    def observe(self, num_tokens: int, seconds: float, verifies: bool = False) -> None:
        x = np.array([1.0, float(num_tokens), float(verifies)])
        self._normal = self._normal * _COST_FORGETTING + np.outer(x, x)
        self._moment = self._moment * _COST_FORGETTING + x * seconds

    def fit(self) -> StepCost | None:
        """The fit, or None before steps of different sizes have been seen."""
        weight, verifying = self._normal[0, 0], self._normal[2, 2]
        if weight - verifying >= self.MIN_KIND_WEIGHT and verifying >= self.MIN_KIND_WEIGHT:
            fitted = self._solve([0, 1, 2])
            if fitted is not None and fitted[2] >= 0.0:
                return StepCost(*fitted)
        fitted = self._solve([0, 1])
        return None if fitted is None else StepCost(*fitted)

    def _solve(self, terms: list[int]) -> tuple[float, ...] | None:
        """The least-squares coefficients of ``terms`` (the intercept first, then the slope), both
        at least 0; None where the steps seen do not determine them."""
        normal = self._normal[np.ix_(terms, terms)]
        if normal[0, 0] < 2 or np.linalg.cond(normal) > _MAX_CONDITION:
            return None
        coefficients = np.linalg.solve(normal, self._moment[terms])
        if coefficients[1] < 0.0:  # noise made the slope negative: fit the other terms with none
            rest = [term for term in terms if term != 1]
            coefficients = np.insert(np.linalg.solve(self._normal[np.ix_(rest, rest)], self._moment[rest]), 1, 0.0)
        return (max(0.0, float(coefficients[0])), *(float(c) for c in coefficients[1:]))


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

    def count_step(self, drafting: bool) -> None:
        """Called once per step with whether the policy gave the request drafts (a probe started
        last step was verified before this one, or had no draft to verify)."""
        self.steps_idle = 0 if drafting else self.steps_idle + 1
        self.probing = False

    def probe_due(self, within: float = 1.0) -> bool:
        """Whether the request has gone ``within`` of its probe interval without drafting."""
        return self.steps_idle >= within * self.probe_interval

    def start_probe(self) -> None:
        self.probing = True
        self.steps_idle = 0

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
    cost: StepCost | None,
    draft_cost_per_token: float,
) -> list[int]:
    """Draft length per candidate request for a step that already computes ``num_tokens`` tokens
    (one per running request) and so emits that many; ``cost`` None: draft fully."""
    if cost is None:
        return list(max_lengths)
    expected_tokens = float(num_tokens)
    plain_seconds = cost.intercept + cost.per_token * num_tokens
    seconds = plain_seconds + cost.verification
    lengths = [0] * len(alphas)
    # Max-heap of each request's next gain: alpha ** (drafted + 1).
    heap = [(-alpha, index) for index, alpha in enumerate(alphas) if max_lengths[index] > 0 and alpha > 0]
    heapq.heapify(heap)
    added_cost = cost.per_token + draft_cost_per_token
    while heap:
        negative_gain, index = heapq.heappop(heap)
        gain = -negative_gain
        # Worth it iff (tokens + gain) / (seconds + added_cost) > tokens / seconds: the gains come
        # largest first, so the rate rises while this holds and falls after.
        if gain * seconds <= expected_tokens * added_cost:
            break
        lengths[index] += 1
        expected_tokens += gain
        seconds += added_cost
        if lengths[index] < max_lengths[index]:
            heapq.heappush(heap, (-gain * alphas[index], index))
    # The best rate with drafts, verification paid, against the step's rate without them.
    if expected_tokens * plain_seconds <= num_tokens * seconds:
        return [0] * len(alphas)
    return lengths
