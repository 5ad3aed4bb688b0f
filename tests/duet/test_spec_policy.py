"""The adaptive draft-length rule: the cost fit, the acceptance estimate, the choices they give,
and when requests without drafts probe."""

import pytest

from duet.config import SpeculativeConfig
from duet.spec_decode.decoder import SpeculativeDecoder, _Track
from duet.spec_decode.policy import PROBE_INTERVAL, AcceptanceEstimate, StepCost, StepCostModel, choose_draft_lengths
from duet.spec_decode.proposers import NgramProposer


def test_cost_model_recovers_a_line_and_needs_two_sizes():
    model = StepCostModel()
    model.observe(8, 0.046)
    assert model.fit() is None
    for tokens in (1, 8, 40, 8, 1):
        model.observe(tokens, 0.03 + 0.002 * tokens)
    fit = model.fit()
    assert fit.intercept == pytest.approx(0.03)
    assert fit.per_token == pytest.approx(0.002)
    assert fit.verification == 0.0


def test_cost_model_separates_verifications_fixed_cost():
    # A 2-core EPYC at batch 8: 9 ms + 1.3 ms a token, and 2-7 ms more for a step that verifies.
    model = StepCostModel()
    for step in range(60):
        verifies = step % 4 == 0
        tokens = 8 + (step % 7 if verifies else 0)
        model.observe(tokens, 0.009 + 0.0013 * tokens + (0.004 if verifies else 0.0), verifies=verifies)
    fit = model.fit()
    assert (fit.intercept, fit.per_token, fit.verification) == pytest.approx((0.009, 0.0013, 0.004))


def test_verifications_cost_is_left_in_the_intercept_while_every_step_verifies():
    model = StepCostModel()
    for tokens in (5, 9, 13, 5, 9):
        model.observe(tokens, 0.014 + 0.001 * tokens, verifies=True)
    fit = model.fit()
    assert (fit.intercept, fit.per_token, fit.verification) == pytest.approx((0.014, 0.001, 0.0))


def test_acceptance_estimate_counts_one_failure_per_rejection():
    estimate = AcceptanceEstimate()
    assert estimate.alpha(prior=0.5) == 0.5
    estimate.observe(num_drafts=4, num_accepted=4)  # 4 successes, no failure
    estimate.observe(num_drafts=4, num_accepted=1)  # 1 success, 1 failure
    accepted, trials = 4 * 0.8 + 1, 4 * 0.8 + 2
    assert estimate.alpha(prior=0.5) == pytest.approx((accepted + 0.5) / (trials + 1))


def test_memory_bound_steps_draft_fully_even_at_modest_acceptance():
    # 30 ms to read the weights, 0.1 ms per token: a draft that is right half the time pays.
    assert choose_draft_lengths([0.5, 0.5], [4, 4], 2, StepCost(0.03, 0.0001), 0.0) == [4, 4]


def test_compute_bound_steps_draft_only_where_acceptance_is_high():
    # 10 ms + 4 ms per token at 8 running: a token must be accepted with probability > 0.76.
    lengths = choose_draft_lengths([0.95, 0.5, 0.2] + [0.5] * 5, [4] * 8, 8, StepCost(0.01, 0.004), 0.0)
    assert lengths[0] >= 2
    assert lengths[1:] == [0] * 7


def test_costly_proposer_drafts_less():
    cheap = choose_draft_lengths([0.7], [4], 1, StepCost(0.03, 0.001), 0.0)
    costly = choose_draft_lengths([0.7], [4], 1, StepCost(0.03, 0.001), 0.02)
    assert cheap == [4]
    assert costly[0] < 4


def test_without_a_fit_every_request_drafts_its_maximum():
    assert choose_draft_lengths([0.1, 0.9], [3, 1], 2, None, 0.0) == [3, 1]


def test_verifications_fixed_cost_keeps_a_batch_from_drafts_that_would_pay_without_it():
    # 9 ms + 1.3 ms a token at 8 running: four requests at 0.8 pay if verification is free...
    alphas, limits = [0.8] * 4 + [0.0] * 4, [4] * 8
    assert sum(choose_draft_lengths(alphas, limits, 8, StepCost(0.009, 0.0013), 0.0)) > 0
    # ...not when a verifying step costs 4 ms more, and then nobody drafts at all.
    assert choose_draft_lengths(alphas, limits, 8, StepCost(0.009, 0.0013, 0.004), 0.0) == [0] * 8
    # Eight requests that draft well share that price and still draft.
    assert min(choose_draft_lengths([0.97] * 8, limits, 8, StepCost(0.009, 0.0013, 0.004), 0.0)) >= 2


def _probing(estimate: AcceptanceEstimate) -> int:
    """Steps without drafts until the estimate's probe is due, then its probe started."""
    steps = 0
    while not estimate.probe_due():
        estimate.count_step(drafting=False)
        steps += 1
    estimate.start_probe()
    return steps


def test_rejected_probes_wait_twice_as_long_and_an_accepted_one_resets_the_wait():
    estimate = AcceptanceEstimate()
    waits = []
    for _ in range(3):
        waits.append(_probing(estimate))
        estimate.observe(num_drafts=1, num_accepted=0)
    assert waits == [16, 32, 64]
    _probing(estimate)
    estimate.observe(num_drafts=1, num_accepted=1)
    assert estimate.probe_interval == 16


def test_probes_due_within_half_an_interval_share_a_step():
    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), NgramProposer(1, 3), 100, 2048, None)
    for tokens in (9, 12, 9, 12):  # 20 ms at 8 tokens, 2.5 ms a token, 10 ms to verify
        decoder.step_cost.observe(8, 0.02, verifies=False)
        decoder.step_cost.observe(tokens, 0.02 + 0.0025 * (tokens - 8) + 0.01, verifies=True)
    tracks = decoder._tracks
    names = ("late", "half", "due")
    for name, idle in zip(names, (0, 5, 12)):
        tracks[name] = _Track()
        tracks[name].acceptance.steps_idle = idle
    probes = []
    for _ in range(2 * PROBE_INTERVAL):
        lengths = decoder._adaptive_lengths([tracks[name] for name in names], [4, 4, 4], 8)
        probes.append(tuple(name for name, length in zip(names, lengths) if length))
        for name, length in zip(names, lengths):
            if length:
                tracks[name].acceptance.observe(num_drafts=1, num_accepted=1)
    steps_with_probes = [(step, probe) for step, probe in enumerate(probes) if probe]
    # "due" reaches its interval on the 4th step and "half" (then 9 steps idle) joins it; "late"
    # (4) waits; it is due 12 steps later, and the others join it (12 idle each); then all three
    # probe together, one interval on.
    everyone = ("late", "half", "due")
    assert steps_with_probes == [(3, ("half", "due")), (15, everyone), (31, everyone)]


def test_a_probe_lasts_one_step():
    """A probe with nothing to verify (no n-gram match) ends with its step: the request's next
    drafts, the policy's own, do not count as its result."""
    estimate = AcceptanceEstimate()
    estimate.start_probe()
    estimate.count_step(drafting=True)
    estimate.observe(num_drafts=4, num_accepted=0)
    assert estimate.probe_interval == PROBE_INTERVAL
