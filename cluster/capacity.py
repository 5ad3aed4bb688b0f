"""The replicas a load needs, by a ``duet profile``: the planning autoscaler's arithmetic.

A pool whose ``autoscaling_config`` names a ``profile`` is sized ahead of its queues
(``duet.cluster.autoscale``): from the arrival rate and the length mix the routers measure
(``Demand``) and the profile's step times of the pool's engine (``StageModel``), the replica
count that meets the SLO at that rate, before any queue shows it.

- **prefill**: a prompt of ``L`` tokens takes ``S``, its chunks' steps by the profile's fit. The
  router spreads prompts over ``n`` replicas, each then an M/D/1 queue (Poisson arrivals, one
  service time): at utilization ``rho = rate S / n`` a prompt waits ``rho S / (2 (1 - rho))`` on
  average. The pool needs the fewest ``n`` with ``S +`` that wait within ``HEADROOM`` of the
  TTFT target and ``rho <= MAX_UTILIZATION``; a prompt that alone comes near the target (or
  past it) may wait ``MIN_WAIT_SHARE`` of its time still.
- **decode**: a sequence decodes ``O`` tokens, one a step; with ``B`` sequences a replica's step
  takes ``t(B) = a + (b + c C) B`` (the fit; ``C`` the mean context, ``L + O/2``; where the pool
  speculates, ``a / T + (b + c C) V B / T`` with the tokens a sequence gets from a step ``T`` and
  a row's verification factor ``V`` at that batch, ``drafts_at``). By Little's law a replica
  receiving ``rate / n`` holds ``B = k t(B)`` sequences, ``k = rate O / n``: without drafts ``B = k
  a / (1 - k (b + c C))`` when ``k (b + c C) < 1`` (otherwise it falls behind at any batch); with
  them the least ``B`` where ``k t(B)`` comes down to ``B``. The pool needs the fewest ``n``
  whose ``B`` steps within ``HEADROOM`` of the TPOT target, fits ``max_num_seqs`` and whose
  blocks fit ``kv_usage`` of a replica's.
- **colocated**: both on the same replicas: the prompts take ``rho`` of each replica's time, and
  decoding runs in the rest (``k`` divided by ``1 - rho``), each sequence's tokens spread over
  its steps and the prompts between them (its mean time a token ``t(B) / (1 - rho)``).

Replicas of a pool are independent queues, so ``n`` of them take ``n`` times one's rate
(``prefill_rate``, ``decode_rate``, ``colocated_rate``: where the counts above step up), which
``duet plan --devices`` lays a fleet out by (``benchmarks/fleet.py``).

Each model is corrected by what the replicas measure (``Measured``, ``correction``: the measured
time over the profile's, kept within ``CORRECTION_BOUNDS``): a machine slower than the profiled
one, or replicas slowing each other, is planned for as it runs. ``plan`` is the count a pool's
policy takes: for the window of arrivals that needs the most, and down only past a margin.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

HEADROOM = 0.8  # of each SLO target, what the plan fills: queues vary around their means
MAX_UTILIZATION = 0.85  # of a replica's time, what prompts may fill
MIN_WAIT_SHARE = 0.25  # of a prompt's time, the mean wait a plan allows however close the prompt alone comes to the target
CORRECTION_BOUNDS = (0.5, 4.0)  # measured over profiled times, clamped: a few odd steps do not swing the plan
MAX_PLANNED = 64  # replicas a plan considers per pool (the pool's bounds cut it further)
DOWN_MARGIN = 1.25  # a pool planned down goes to what serves this much more than the demand: noise in the rate does not flap it
MIN_WINDOW_S = 5.0  # a router up for less is measured over this long: its first request is not a burst
DEFAULT_OUTPUT_TOKENS = 128  # planned for before any sequence finished or asked for a length


@dataclasses.dataclass(frozen=True)
class Demand:
    """What the routers took in: requests per second to plan for, and their mean lengths."""

    rate: float
    prompt_tokens: float
    output_tokens: float

    @classmethod
    def from_reports(cls, reports: list[list[dict]]) -> list[Demand]:
        """The router replicas' ``ArrivalMeter.summary()`` reports as one demand per window,
        shortest first (none without reports), summed over the routers: each window's rate, its
        mean prompt, and its mean output the larger of its finished sequences' and the lengths
        those in flight are likely to end with (``running_expected``: longer outputs show there
        long before any of them finishes), else what its requests asked for. A pool is planned for the
        window that needs the most: a rise shows in the short one at once, a lull holds the pools
        for the long one, and each window's rate goes with its own lengths."""
        if not reports:
            return []
        running = sum(report[0].get("running", 0) for report in reports)
        in_flight = sum(report[0].get("running_expected", 0) for report in reports) / running if running else 0.0
        demands = []
        for index in range(min(len(report) for report in reports)):
            windows = [report[index] for report in reports]
            total = {key: sum(window[key] for window in windows) for key in ("requests", "prompt_tokens", "max_tokens", "finished", "output_tokens")}
            rate = sum(window["requests"] / max(window["seconds"], MIN_WINDOW_S) for window in windows)
            prompt = total["prompt_tokens"] / total["requests"] if total["requests"] else 0.0
            output = max(total["output_tokens"] / total["finished"] if total["finished"] else 0.0, in_flight)
            if not output:
                output = total["max_tokens"] / total["requests"] if total["max_tokens"] else DEFAULT_OUTPUT_TOKENS
            demands.append(cls(rate, prompt, output))
        return demands


@dataclasses.dataclass(frozen=True)
class StageModel:
    """One pool's engine, by its ``duet profile`` entry: the prompt fit ``a + b T + c T (C +
    T/2)`` (``prompt``), the decode fit ``a + b B + c B C`` (``decode``), its token budget,
    sequences, blocks, and its drafts (``drafts``: the tokens a sequence gets from a decode
    step, and how much more a row costs verifying them; ``drafts_by_batch``: both by the step's
    batch, where the profile measured them so)."""

    prompt: dict[str, float]
    decode: dict[str, float]
    budget: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    draft_tokens: float = 1.0
    draft_verify: float = 1.0
    drafts_by_batch: tuple = ()  # ``(batch, tokens, verify)``, batch ascending (``drafts_by_batch``)

    @classmethod
    def from_profile(cls, profile: dict, stage: str) -> StageModel:
        pool = profile["pools"][stage]
        settings = pool["settings"]
        return cls(
            pool["prompt"]["fit"], pool["decode"]["fit"], settings["max_num_batched_tokens"], settings["max_num_seqs"],
            settings["num_blocks"], settings["block_size"], *drafts(pool.get("speculation")), drafts_by_batch(pool.get("speculation")),
        )

    def prompt_seconds(self, tokens: float) -> float:
        """A prompt of ``tokens`` computed alone, in chunks of the token budget (none quicker than
        a roofline profile's ``floor_s``: reading the weights)."""
        seconds, done, left = 0.0, 0.0, max(tokens, 1.0)
        fit = self.prompt
        while left > 0:
            chunk = min(left, self.budget)
            linear = fit["base_s"] + fit["per_token_s"] * chunk + fit["per_token_context_s"] * chunk * (done + chunk / 2)
            seconds += max(fit.get("floor_s", 0.0), linear)
            done, left = done + chunk, left - chunk
        return seconds

    def drafts_at(self, batch: float) -> tuple[float, float]:
        """The tokens a sequence gets from a decode step of ``batch`` sequences and a drafting
        row's cost over a plain one (``drafts_at``)."""
        return drafts_at(self.drafts_by_batch, self.draft_tokens, self.draft_verify, batch)

    def step_seconds(self, batch: float, context: float) -> float:
        """A decode step's time a token of each of ``batch`` sequences of ``context`` tokens
        (with drafts: a step verifying them over the tokens each sequence gets from it)."""
        return self.decode["base_s"] / self.drafts_at(batch)[0] + self.row_seconds(context, batch) * batch

    def row_seconds(self, context: float, batch: float) -> float:
        """What a sequence of ``context`` tokens adds to a decode step of ``batch`` sequences'
        time a token: its row, verifying drafts (their verification factor times a row
        without), over the tokens it gets."""
        fit = self.decode
        tokens, verify = self.drafts_at(batch)
        return (fit["per_row_s"] + fit["per_row_context_s"] * context) * verify / tokens


def drafts(speculation: dict | None) -> tuple[float, float]:
    """A drafting pool's ``(tokens a sequence gets from a decode step, what a row costs verifying
    its drafts over a row without)`` from its profile's ``speculation`` (``duet profile``'s
    ``profile_spec``); a profile of before they were measured has only the factor its decode
    steps took at its batch: the same factor at every batch. ``(1, 1)`` without drafts."""
    if not speculation:
        return 1.0, 1.0
    if "tokens_per_step" in speculation:
        return speculation["tokens_per_step"], speculation["verify_factor"]
    return 1.0 / speculation["decode_factor"], 1.0


def drafts_by_batch(speculation: dict | None) -> tuple:
    """A profile's drafts measured by batch (``profile_spec``'s ``by_batch``): ``(batch, tokens a
    step, verification factor)``, batch ascending; empty where it measured one batch."""
    return tuple(sorted(tuple(point) for point in (speculation or {}).get("by_batch", ())))


def drafts_at(points: tuple, tokens: float, verify: float, batch: float) -> tuple[float, float]:
    """The tokens a sequence gets from a decode step of ``batch`` sequences, and what a row
    verifying drafts costs over a row without: ``points``' figures (``drafts_by_batch``) at the
    batches measured, straight between them, the nearest one's beyond; ``(tokens, verify)``
    without points (a profile measured at one batch: its figures at every batch)."""
    if not points:
        return tokens, verify
    if batch <= points[0][0]:
        return points[0][1], points[0][2]
    for (low, tokens_low, verify_low), (high, tokens_high, verify_high) in zip(points, points[1:]):
        if batch <= high:
            share = (batch - low) / (high - low)
            return tokens_low + (tokens_high - tokens_low) * share, verify_low + (verify_high - verify_low) * share
    return points[-1][1], points[-1][2]


def load_models(path: str) -> dict[str, StageModel]:
    """Every pool of a profile JSON, by stage; a ``ValueError`` naming what is wrong."""
    try:
        profile = json.loads(Path(path).read_text())
        return {stage: StageModel.from_profile(profile, stage) for stage in profile["pools"]}
    except OSError as error:
        raise ValueError(f"profile {path!r} cannot be read ({error.strerror}): write it with `duet profile CONFIG --out {path}`") from None
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"profile {path!r} is not a `duet profile` JSON ({error!r})") from None


def correction(measured_s: float, predicted_s: float) -> float:
    """The factor on the profile's times that the replicas' measure asks for (1 without one)."""
    if measured_s <= 0 or predicted_s <= 0:
        return 1.0
    low, high = CORRECTION_BOUNDS
    return min(max(measured_s / predicted_s, low), high)


def _wait_allowed(seconds: float, ttft_s: float) -> float:
    """The mean wait a prompt of ``seconds`` may have: what it leaves of the planned TTFT, and at
    least ``MIN_WAIT_SHARE`` of its own time (near or past the target no count of replicas meets
    it, and queueing must not make it worse: the plan stays continuous there)."""
    return max(HEADROOM * ttft_s - seconds, MIN_WAIT_SHARE * seconds)


def _prefill_fits(seconds: float, rate: float, replicas: int, ttft_s: float) -> bool:
    rho = rate * seconds / replicas
    return rho <= MAX_UTILIZATION and rho * seconds / (2 * (1 - rho)) <= _wait_allowed(seconds, ttft_s)


def decode_batch(model: StageModel, demand: Demand, replicas: int, busy: float = 0.0, factor: float = 1.0) -> float | None:
    """The sequences each of ``replicas`` holds at the demand's rate (Little's law), ``busy`` of
    its time taken by prompts; None where it falls behind at any batch."""
    if demand.rate <= 0 or demand.output_tokens <= 0:
        return 0.0
    context = demand.prompt_tokens + demand.output_tokens / 2
    k = demand.rate * demand.output_tokens / (replicas * (1 - busy))

    def excess(batch: float) -> float:  # the sequences a replica would hold at ``batch``'s step time, past ``batch``
        return k * model.step_seconds(batch, context) * factor - batch

    # Drafts by batch: the least batch where the excess comes down to 0, if it does among the
    # batches measured (straight between them, so bisection finds it)...
    for batch in (point[0] for point in model.drafts_by_batch):
        if excess(batch) <= 0:
            return _highest(lambda smaller: excess(smaller) > 0, batch)
    # ...else with the drafts of the largest batch (or the same at every batch): in closed form.
    last = model.drafts_by_batch[-1][0] if model.drafts_by_batch else 1.0
    growth = k * model.row_seconds(context, last) * factor
    if growth >= 1:
        return None
    return k * model.decode["base_s"] / model.drafts_at(last)[0] * factor / (1 - growth)


def _decode_fits(model: StageModel, demand: Demand, replicas: int, tpot_s: float, kv_usage: float, busy: float, factor: float) -> bool:
    batch = decode_batch(model, demand, replicas, busy, factor)
    if batch is None:
        return False
    context = demand.prompt_tokens + demand.output_tokens / 2
    blocks = math.ceil(batch) * math.ceil((demand.prompt_tokens + demand.output_tokens) / model.block_size)
    # a sequence's mean time a token: its steps, stretched by the prompts' share of the replica's time
    per_token = model.step_seconds(max(batch, 1.0), context) * factor / (1 - busy)
    return per_token <= HEADROOM * tpot_s and batch <= model.max_num_seqs and blocks <= kv_usage * model.num_blocks


def prefill_replicas(model: StageModel, demand: Demand, ttft_s: float, factor: float = 1.0) -> int:
    """The prefill replicas the demand needs (0 with no arrivals)."""
    if demand.rate <= 0:
        return 0
    seconds = model.prompt_seconds(demand.prompt_tokens) * factor
    return next((n for n in range(1, MAX_PLANNED + 1) if _prefill_fits(seconds, demand.rate, n, ttft_s)), MAX_PLANNED)


def decode_replicas(model: StageModel, demand: Demand, tpot_s: float, kv_usage: float, factor: float = 1.0) -> int:
    """The decode replicas the demand needs (0 with no arrivals)."""
    if demand.rate <= 0:
        return 0
    return next((n for n in range(1, MAX_PLANNED + 1) if _decode_fits(model, demand, n, tpot_s, kv_usage, 0.0, factor)), MAX_PLANNED)


def colocated_replicas(
    model: StageModel, demand: Demand, ttft_s: float, tpot_s: float, kv_usage: float, prompt_factor: float = 1.0, decode_factor: float = 1.0,
) -> int:
    """The colocated replicas the demand needs: prompts and decoding on the same ones."""
    if demand.rate <= 0:
        return 0
    seconds = model.prompt_seconds(demand.prompt_tokens) * prompt_factor
    for n in range(1, MAX_PLANNED + 1):
        busy = demand.rate * seconds / n
        if _prefill_fits(seconds, demand.rate, n, ttft_s) and _decode_fits(model, demand, n, tpot_s, kv_usage, busy, decode_factor):
            return n
    return MAX_PLANNED


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a pool's replicas measured (0: nothing yet): prompt tokens per second, TPOT, and the
    sequences they ran meanwhile."""

    prefill_tokens_per_s: float = 0.0
    tpot_s: float = 0.0
    num_running: float = 0.0

    def factors(self, model: StageModel, demand: Demand) -> tuple[float, float]:
        """The corrections of the model's prompt and decode times (``correction``)."""
        prompt = decode = 1.0
        if self.prefill_tokens_per_s and demand.prompt_tokens:
            prompt = correction(demand.prompt_tokens / self.prefill_tokens_per_s, model.prompt_seconds(demand.prompt_tokens))
        if self.tpot_s and self.num_running:
            decode = correction(self.tpot_s, model.step_seconds(self.num_running, demand.prompt_tokens + demand.output_tokens / 2))
        return prompt, decode


def plan(
    stage: str, model: StageModel, demands: list[Demand], measured: Measured, ttft_s: float, tpot_s: float, kv_usage: float, current: int,
) -> tuple[int, float, Demand]:
    """A pool's replicas for the window of ``demands`` that needs the most, its correction and
    that window; below ``current`` only as far as ``DOWN_MARGIN`` times that window's rate
    allows (the window that set the count is the one returned)."""

    def count(demand: Demand, margin: float) -> tuple[int, float, Demand]:
        wanted = dataclasses.replace(demand, rate=demand.rate * margin)
        prompt_factor, decode_factor = measured.factors(model, demand)
        if stage == "prefill":
            return prefill_replicas(model, wanted, ttft_s, prompt_factor), prompt_factor, demand
        if stage == "colocated":
            replicas = colocated_replicas(model, wanted, ttft_s, tpot_s, kv_usage, prompt_factor, decode_factor)
            return replicas, max(prompt_factor, decode_factor), demand
        return decode_replicas(model, wanted, tpot_s, kv_usage, decode_factor), decode_factor, demand

    planned = max((count(demand, 1.0) for demand in demands), key=lambda item: item[0])
    if planned[0] < current:
        planned = max((count(demand, DOWN_MARGIN) for demand in demands), key=lambda item: item[0])
    return planned


def prefill_rate(model: StageModel, prompt_tokens: float, ttft_s: float, factor: float = 1.0) -> float:
    """The arrivals per second one prefill replica takes within ``prefill_replicas``' rule (n
    replicas take n times this): the utilization whose M/D/1 wait fills what the prompt leaves
    of the planned TTFT; 0 where a prompt alone is past it."""
    seconds = model.prompt_seconds(prompt_tokens) * factor
    if seconds > HEADROOM * ttft_s:
        return 0.0
    left = _wait_allowed(seconds, ttft_s)
    return min(MAX_UTILIZATION, 2 * left / (seconds + 2 * left)) / seconds


def _highest(fits, upper: float) -> float:
    """The highest value in (0, ``upper``) that ``fits`` (monotone: a lower one fits too), by bisection."""
    low, high = 0.0, upper
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def decode_rate(model: StageModel, prompt_tokens: float, output_tokens: float, tpot_s: float, kv_usage: float, factor: float = 1.0) -> float:
    """The arrivals per second one decode replica takes within ``decode_replicas``' rule."""
    # above any rate that fits: the cheapest row at any batch (drafts by batch) leaves none higher
    batches = [point[0] for point in model.drafts_by_batch] or [1.0]
    growth = min(model.row_seconds(prompt_tokens + output_tokens / 2, batch) for batch in batches) * factor
    upper = 1 / (output_tokens * growth) if growth > 0 else 1e6

    def fits(rate: float) -> bool:
        return _decode_fits(model, Demand(rate, prompt_tokens, output_tokens), 1, tpot_s, kv_usage, 0.0, factor)

    return _highest(fits, upper)


def colocated_rate(model: StageModel, prompt_tokens: float, output_tokens: float, ttft_s: float, tpot_s: float, kv_usage: float) -> float:
    """The arrivals per second one colocated replica takes within ``colocated_replicas``' rule."""
    seconds = model.prompt_seconds(prompt_tokens)
    if seconds > HEADROOM * ttft_s:
        return 0.0

    def fits(rate: float) -> bool:
        demand = Demand(rate, prompt_tokens, output_tokens)
        return _prefill_fits(seconds, rate, 1, ttft_s) and _decode_fits(model, demand, 1, tpot_s, kv_usage, rate * seconds, 1.0)

    return _highest(fits, MAX_UTILIZATION / seconds)
