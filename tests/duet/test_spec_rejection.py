"""Speculative-sampling acceptance: exact on greedy and one-hot rows, chi-square against the target otherwise."""

import pytest
import torch

from duet.sampler import advance_generator, exponential_race, make_generator
from duet.spec_decode.rejection import one_hot_draft_probs, rejection_sample

VOCAB = 6
K = 3
# Tokens checked per sequence: the first step alone can emit them all (K drafts plus the bonus).
LENGTH = K + 1
NUM_TRIALS = 30_000
ALPHA = 0.001


def _peaked(argmax_ids: list[int]) -> torch.Tensor:
    """Probability rows with half their mass on each given id."""
    probs = torch.full((len(argmax_ids), VOCAB), 0.5 / (VOCAB - 1))
    probs[torch.arange(len(argmax_ids)), torch.tensor(argmax_ids)] = 0.5
    return probs


def test_greedy_keeps_drafts_up_to_first_mismatch_then_emits_target_argmax():
    drafts = [[4, 1, 5], [], [2, 0], [3]]
    target_argmax = [[4, 2, 5, 0], [1], [2, 0, 3], [5, 1]]
    target = _peaked([token_id for rows in target_argmax for token_id in rows])
    # Greedy ignores the draft distribution.
    output = rejection_sample(drafts, torch.rand(6, VOCAB), target, [True] * 4, [None] * 4)
    # Mismatch at 1; no drafts; all kept plus the bonus argmax; mismatch at 0.
    assert output.sampled_token_ids == [[4, 2], [1], [2, 0, 3], [5]]
    assert output.num_accepted_tokens == [1, 0, 2, 0]
    for emitted, argmax_ids in zip(output.sampled_token_ids, target_argmax):
        assert emitted == argmax_ids[: len(emitted)]


def test_one_hot_target_makes_random_requests_exact_beside_greedy_ones():
    # With p one-hot, a draft is kept iff it is p's token, and the residual p - q is p's token again.
    drafts = [[4, 1, 5], [], [2, 0], [3]]
    target_ids = [4, 2, 5, 0, 1, 2, 0, 3, 5, 1]
    target = torch.nn.functional.one_hot(torch.tensor(target_ids), VOCAB).float()
    draft_probs = one_hot_draft_probs(drafts, VOCAB, "cpu")
    output = rejection_sample(drafts, draft_probs, target, [False, True, False, False], [None] * 4)
    assert output.sampled_token_ids == [[4, 2], [1], [2, 0, 3], [5]]
    assert output.num_accepted_tokens == [1, 0, 2, 0]


def test_residual_without_mass_falls_back_to_target():
    """Guards against drawing from an all-zero residual, which an argmax race turns into token 0."""
    # p(2) = 0 < q(2) forces a rejection, and p <= q everywhere leaves max(0, p - q) empty.
    target = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0] * 5 + [1.0]])
    draft = torch.tensor([[0.0, 0.5, 1e-30, 0.5, 0.0, 0.0]])
    batch = 2_000
    torch.manual_seed(0)
    draft_probs, target_probs = draft.repeat(batch, 1), target.repeat(batch, 1)
    output = rejection_sample([[2]] * batch, draft_probs, target_probs, [False] * batch, [None] * batch)
    assert output.num_accepted_tokens == [0] * batch
    tokens = torch.tensor([ids[0] for ids in output.sampled_token_ids])
    assert set(tokens.tolist()) == {1, 3}
    assert abs((tokens == 1).float().mean().item() - 0.5) < 0.05


def test_row_counts_must_match_the_drafts():
    with pytest.raises(ValueError, match="need 5 \\(k \\+ 1 per request\\)"):
        rejection_sample([[1, 2], [3]], torch.rand(3, VOCAB), torch.rand(4, VOCAB), [False] * 2, [None] * 2)


def _companion(k: int, greedy: bool, generator: torch.Generator | None) -> tuple:
    """(draft ids, q, p, greedy, generator) of a request with fresh random rows from the global stream."""
    draft_ids = torch.randint(VOCAB, (k,)).tolist()
    return draft_ids, torch.rand(k, VOCAB).softmax(-1), torch.rand(k + 1, VOCAB).softmax(-1), greedy, generator


def test_seeded_request_gets_same_tokens_whatever_its_batch_and_row():
    fixed = torch.Generator().manual_seed(5)
    target_probs = torch.randn(K + 1, VOCAB, generator=fixed).softmax(dim=-1)
    draft_probs = torch.randn(K, VOCAB, generator=fixed).softmax(dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=fixed).squeeze(1).tolist()

    def run(companions: list[tuple[int, bool, int | None]], row: int, global_seed: int) -> list[list[int]]:
        """Twenty calls beside companions given as (k, greedy, seed)."""
        torch.manual_seed(global_seed)
        own = make_generator(1234, "cpu")
        generators = [None if seed is None else make_generator(seed, "cpu") for _, _, seed in companions]
        emitted = []
        for _ in range(20):
            requests = [_companion(k, greedy, g) for (k, greedy, _), g in zip(companions, generators)]
            requests.insert(row, (drafts, draft_probs, target_probs, False, own))
            ids, q, p, greedy, request_generators = zip(*requests)
            output = rejection_sample(list(ids), torch.cat(q), torch.cat(p), list(greedy), list(request_generators))
            emitted.append(output.sampled_token_ids[row])
        return emitted

    alone = run([], row=0, global_seed=0)
    assert len({tuple(ids) for ids in alone}) > 1
    companions = [(2, False, 99), (0, True, None), (3, False, None), (1, False, 7)]
    assert run(companions, row=2, global_seed=1) == alone
    assert run(companions[1:], row=0, global_seed=2) == alone


def test_a_seeded_request_emits_its_unspeculated_samples_whatever_its_drafts():
    """Guards seeded sampling under speculation: the tokens are those the request samples one at a
    time, and its generator ends one race per emitted token further, as a resumed request assumes."""
    fixed = torch.Generator().manual_seed(2)
    target_probs = torch.randn(K + 1, VOCAB, generator=fixed).mul(2).softmax(dim=-1)
    alone = make_generator(11, "cpu")
    unspeculated = [int(exponential_race(row.unsqueeze(0).clone(), {0: alone})) for row in target_probs]
    wrong = [(token_id + 1) % VOCAB for token_id in unspeculated]
    cases = [unspeculated[:K], [unspeculated[0], wrong[1], unspeculated[2]], wrong[:K], unspeculated[:2]]
    for drafts in cases:
        rows = target_probs[: len(drafts) + 1]
        generator = make_generator(11, "cpu")
        draft_probs = one_hot_draft_probs([drafts], VOCAB, "cpu")
        output = rejection_sample([drafts], draft_probs, rows, [False], [generator])
        emitted = output.sampled_token_ids[0]
        assert emitted == unspeculated[: len(emitted)], drafts
        assert output.num_accepted_tokens == [len(emitted) - 1]
        resumed = make_generator(11, "cpu")
        advance_generator(resumed, VOCAB, len(emitted))
        assert torch.equal(generator.get_state(), resumed.get_state()), drafts
    assert [len(rejection_sample([d], one_hot_draft_probs([d], VOCAB, "cpu"), target_probs[: len(d) + 1], [False],
                                 [make_generator(11, "cpu")]).sampled_token_ids[0]) for d in cases] == [K + 1, 2, 1, 3]


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q per absolute position, whatever came before: sequences should follow prod p_t."""
    fixed = torch.Generator().manual_seed(0)
    num_positions = LENGTH + K
    p_table = torch.randn(num_positions, VOCAB, generator=fixed).softmax(-1)
    return p_table, torch.randn(num_positions, VOCAB, generator=fixed).softmax(-1)


def _library_step(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> list[list[int]]:
    random_requests = [False] * drafts.shape[0]
    generators = [None] * drafts.shape[0]
    output = rejection_sample(drafts.tolist(), q.reshape(-1, VOCAB), p.reshape(-1, VOCAB), random_requests, generators)
    return output.sampled_token_ids


def _broken_step(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, rule: str) -> list[list[int]]:
    """A speculative step over [batch, K] tensors with one rule deliberately wrong."""
    rows = torch.arange(drafts.shape[0])
    p_draft, q_draft = (probs.gather(2, drafts.unsqueeze(2)).squeeze(2) for probs in (p[:, :K], q))
    ratio = q_draft / p_draft if rule == "accept_with_q_over_p" else p_draft / q_draft
    kept = (torch.rand(ratio.shape) < ratio).int().cumprod(dim=1).sum(dim=1)
    last = p[rows, kept]
    if rule != "resample_from_target":
        residual = (last - q[rows, kept.clamp(max=K - 1)]).clamp_min(0)
        last = torch.where((kept < K).unsqueeze(1), residual, last)
    last_ids = torch.multinomial(last, 1).squeeze(1).tolist()
    return [ids[:count] + [token_id] for ids, count, token_id in zip(drafts.tolist(), kept.tolist(), last_ids)]


def _generate(step, p_table: torch.Tensor, q_table: torch.Tensor) -> torch.Tensor:
    """[NUM_TRIALS, LENGTH] tokens: speculative steps of K drafts (q_table) until every trial has LENGTH."""
    torch.manual_seed(0)
    sequences: list[list[int]] = [[] for _ in range(NUM_TRIALS)]
    active = list(range(NUM_TRIALS))
    while active:
        positions = torch.tensor([len(sequences[trial]) for trial in active])
        rows = positions.unsqueeze(1) + torch.arange(K + 1)
        q = q_table[rows[:, :K]]
        drafts = torch.multinomial(q.reshape(-1, VOCAB), 1).view(-1, K)
        for trial, emitted in zip(active, step(drafts, q, p_table[rows])):
            sequences[trial].extend(emitted)
        active = [trial for trial in active if len(sequences[trial]) < LENGTH]
    return torch.tensor([tokens[:LENGTH] for tokens in sequences])


def _chi_square_p_value(cells: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test that ``cells`` (indices into the flattened probabilities) follow them."""
    expected = expected_probs.flatten().double() * cells.numel()
    assert expected.min() >= 5, "too few trials for the chi-square approximation"
    counts = torch.bincount(cells, minlength=expected.numel()).double()
    statistic = ((counts - expected) ** 2 / expected).sum()
    degrees_of_freedom = torch.tensor((expected.numel() - 1) / 2, dtype=torch.float64)
    # The chi-square survival function is the regularized upper incomplete gamma function.
    return torch.special.gammaincc(degrees_of_freedom, statistic / 2).item()


def _failed_checks(sequences: torch.Tensor, p_table: torch.Tensor) -> list[str]:
    """Names of the checks with p-value below ALPHA: each position's marginal, and the first two jointly."""
    checks = {f"position {t}": (sequences[:, t], p_table[t]) for t in range(LENGTH)}
    checks["positions 0 and 1"] = (sequences[:, 0] * VOCAB + sequences[:, 1], torch.outer(p_table[0], p_table[1]))
    return [name for name, (cells, probs) in checks.items() if _chi_square_p_value(cells, probs) < ALPHA]


def test_emitted_tokens_follow_the_target_distribution():
    p_table, q_table = _tables()
    assert _failed_checks(_generate(_library_step, p_table, q_table), p_table) == []


@pytest.mark.parametrize("rule", ["accept_with_q_over_p", "resample_from_target"])
def test_chi_square_check_rejects_a_broken_rule(rule):
    p_table, q_table = _tables()
    sequences = _generate(lambda drafts, q, p: _broken_step(drafts, q, p, rule), p_table, q_table)
    assert {"position 0", "positions 0 and 1"} <= set(_failed_checks(sequences, p_table))
