"""The adaptive draft-length rule: the cost fit, the acceptance estimate, and the choices they give."""

import pytest

from duet.spec_decode.policy import AcceptanceEstimate, StepCostModel, choose_draft_lengths


def test_cost_model_recovers_a_line_and_needs_two_sizes():
    model = StepCostModel()
    model.observe(8, 0.046)
    assert model.fit() is None
    for tokens in (1, 8, 40, 8, 1):
        model.observe(tokens, 0.03 + 0.002 * tokens)
    intercept, slope = model.fit()
    assert intercept == pytest.approx(0.03)
    assert slope == pytest.approx(0.002)


def test_acceptance_estimate_counts_one_failure_per_rejection():
    estimate = AcceptanceEstimate()
    assert estimate.alpha(prior=0.5) == 0.5
    estimate.observe(num_drafts=4, num_accepted=4)  # 4 successes, no failure
    estimate.observe(num_drafts=4, num_accepted=1)  # 1 success, 1 failure
    accepted, trials = 4 * 0.8 + 1, 4 * 0.8 + 2
    assert estimate.alpha(prior=0.5) == pytest.approx((accepted + 0.5) / (trials + 1))


def test_memory_bound_steps_draft_fully_even_at_modest_acceptance():
    # 30 ms to read the weights, 0.1 ms per token: a draft that is right half the time pays.
    assert choose_draft_lengths([0.5, 0.5], [4, 4], 2, (0.03, 0.0001), 0.0) == [4, 4]


def test_compute_bound_steps_draft_only_where_acceptance_is_high():
    # 10 ms + 4 ms per token at 8 running: a token must be accepted with probability > 0.76.
    lengths = choose_draft_lengths([0.95, 0.5, 0.2] + [0.5] * 5, [4] * 8, 8, (0.01, 0.004), 0.0)
    assert lengths[0] >= 2
    assert lengths[1:] == [0] * 7


def test_costly_proposer_drafts_less():
    cheap = choose_draft_lengths([0.7], [4], 1, (0.03, 0.001), 0.0)
    costly = choose_draft_lengths([0.7], [4], 1, (0.03, 0.001), 0.02)
    assert cheap == [4]
    assert costly[0] < 4


def test_without_a_fit_every_request_drafts_its_maximum():
    assert choose_draft_lengths([0.1, 0.9], [3, 1], 2, None, 0.0) == [3, 1]


def test_rejected_probes_wait_twice_as_long_and_an_accepted_one_resets_the_wait():
    estimate = AcceptanceEstimate()
    waits = []
    for _ in range(3):
        steps = 1
        while not estimate.wants_probe(drafting=False):
            steps += 1
        waits.append(steps)
        estimate.observe(num_drafts=1, num_accepted=0)
    assert waits == [16, 32, 64]
    while not estimate.wants_probe(drafting=False):
        pass
    estimate.observe(num_drafts=1, num_accepted=1)
    assert estimate.probe_interval == 16
