"""Sampler behaviour on CPU with a 32-token vocabulary: exact where deterministic, statistical otherwise."""

import math

import pytest
import torch

from duet import sampler as sampler_module
from duet.sampler import Sampler, apply_penalties, build_sampling_metadata, make_generator
from duet.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 32
NUM_SAMPLES = 20_000
# Five likely tokens and a flat tail, placed at scattered ids so a wrong sort/scatter shows up.
TOKEN_IDS = [17, 3, 29, 8, 21]
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05]


def _metadata(params, prompts=None, outputs=None, generators=None, forbidden=None, vocab_size=VOCAB):
    rows = len(params)
    return build_sampling_metadata(
        params,
        prompts or [[] for _ in range(rows)],
        outputs or [[] for _ in range(rows)],
        generators or [None] * rows,
        forbidden or [() for _ in range(rows)],
        vocab_size,
        "cpu",
    )


def _skewed_logits() -> torch.Tensor:
    probs = torch.full((VOCAB,), 0.05 / (VOCAB - len(PROBS)))
    probs[TOKEN_IDS] = torch.tensor(PROBS)
    return probs.log()


def _expected(kept: dict[int, float]) -> torch.Tensor:
    """A distribution over the vocabulary from unnormalized weights of the kept tokens."""
    expected = torch.zeros(VOCAB)
    for token_id, weight in kept.items():
        expected[token_id] = weight
    return expected / expected.sum()


def _frequencies(*params: SamplingParams) -> list[torch.Tensor]:
    """Empirical token distribution of each setting, sampled side by side in one batch of skewed rows."""
    per_setting = NUM_SAMPLES // len(params)
    batch = [p for p in params for _ in range(per_setting)]
    torch.manual_seed(0)
    tokens = Sampler()(_skewed_logits().expand(len(batch), VOCAB), _metadata(batch)).sampled_token_ids
    return [
        torch.bincount(torch.tensor(tokens[i * per_setting : (i + 1) * per_setting]), minlength=VOCAB) / per_setting
        for i in range(len(params))
    ]


def _assert_matches(frequencies: torch.Tensor, expected: torch.Tensor) -> None:
    assert set(frequencies.nonzero().flatten().tolist()) == set(expected.nonzero().flatten().tolist())
    # At least 10k samples per setting: one standard deviation is at most 0.005, so 0.025 is 5 sigma.
    torch.testing.assert_close(frequencies, expected, atol=0.025, rtol=0)


def test_greedy_picks_argmax_of_logits():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    output = Sampler()(logits, _metadata([SamplingParams(temperature=0.0)] * 8))
    assert output.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert output.logprobs is None


@pytest.mark.parametrize("companion_top_p", [1.0, 0.5], ids=["top_k_only", "top_k_then_top_p"])
def test_top_k_one_samples_the_argmax(companion_top_p):
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 15 + [SamplingParams(top_p=companion_top_p)]
    tokens = Sampler()(logits, _metadata(params)).sampled_token_ids
    assert tokens[:15] == logits[:15].argmax(dim=-1).tolist()


def test_seeded_request_gets_same_tokens_whatever_its_batch_and_row():
    num_steps = 16
    target_logits = torch.randn(num_steps, VOCAB, generator=torch.Generator().manual_seed(3))
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    companions = [
        SamplingParams(top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.1, seed=99),
        SamplingParams(temperature=2.0, frequency_penalty=1.0),
    ]

    def run(companion_params: list[SamplingParams], target_row: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        params = companion_params[:target_row] + [target] + companion_params[target_row:]
        generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
        sampler, tokens = Sampler(), []
        for step in range(num_steps):
            logits = torch.randn(len(params), VOCAB)
            logits[target_row] = target_logits[step]
            outputs = [[1, 2]] * len(params)
            metadata = _metadata(params, outputs=outputs, generators=generators)
            tokens.append(sampler(logits, metadata).sampled_token_ids[target_row])
        return tokens

    alone = run([], target_row=0, global_seed=0)
    assert len(set(alone)) > 1
    assert run(companions, target_row=2, global_seed=1) == alone
    assert run(companions[1:], target_row=0, global_seed=2) == alone


def test_temperature_sharpens_softmax():
    [frequencies] = _frequencies(SamplingParams(temperature=0.5))
    # Dividing log-probabilities by 0.5 squares the probabilities before renormalizing.
    expected = _skewed_logits().mul(2).softmax(dim=-1)
    # Tail tokens keep ~1e-5 each, so some are never drawn: compare values, not the support.
    torch.testing.assert_close(frequencies, expected, atol=0.025, rtol=0)


def test_top_k_keeps_only_the_k_most_likely_tokens():
    [frequencies] = _frequencies(SamplingParams(top_k=3))
    _assert_matches(frequencies, _expected({17: 0.4, 3: 0.25, 29: 0.15}))


def test_top_p_keeps_smallest_set_reaching_p():
    # Cumulative 0.4, 0.65: the second token reaches 0.6, the third is not needed.
    [frequencies] = _frequencies(SamplingParams(top_p=0.6))
    _assert_matches(frequencies, _expected({17: 0.4, 3: 0.25}))


def test_top_p_fully_sorts_only_rows_its_candidates_do_not_cover(monkeypatch):
    # With two candidates (0.4 + 0.25 = 0.65), top_p=0.6 is covered; top_p=0.7 needs a full sort.
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", 2)
    covered, uncovered = _frequencies(SamplingParams(top_p=0.6), SamplingParams(top_p=0.7))
    _assert_matches(covered, _expected({17: 0.4, 3: 0.25}))
    _assert_matches(uncovered, _expected({17: 0.4, 3: 0.25, 29: 0.15}))


def test_top_p_measures_mass_among_top_k_survivors():
    # Alone, top_p=0.7 would keep three tokens (0.4, 0.65, 0.8); renormalized over the top 3
    # the cumulative mass is 0.5, 0.8125, so two suffice.
    [frequencies] = _frequencies(SamplingParams(top_k=3, top_p=0.7))
    _assert_matches(frequencies, _expected({17: 0.4, 3: 0.25}))


def test_min_p_drops_tokens_below_fraction_of_top_probability():
    # Threshold 0.3 x 0.4 = 0.12 keeps 0.4, 0.25, 0.15 and drops 0.1.
    [frequencies] = _frequencies(SamplingParams(min_p=0.3))
    _assert_matches(frequencies, _expected({17: 0.4, 3: 0.25, 29: 0.15}))


def test_rows_with_top_k_and_rows_with_top_p_share_one_batch():
    top_k_frequencies, top_p_frequencies = _frequencies(SamplingParams(top_k=2), SamplingParams(top_p=0.7))
    _assert_matches(top_k_frequencies, _expected({17: 0.4, 3: 0.25}))
    _assert_matches(top_p_frequencies, _expected({17: 0.4, 3: 0.25, 29: 0.15}))


# Tokens 0 and 1 are in the prompt; the output holds 1 once and 3 twice.
PENALTY_LOGITS = [2.0, -1.0, 0.5, 3.0, 0.0, -2.0]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, 0.0, -2.0]),
        (SamplingParams(frequency_penalty=0.5), [2.0, -1.5, 0.5, 2.0, 0.0, -2.0]),
        (SamplingParams(presence_penalty=0.25), [2.0, -1.25, 0.5, 2.75, 0.0, -2.0]),
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -2.75, 0.5, 0.25, 0.0, -2.0],
        ),
    ],
    ids=["repetition", "frequency", "presence", "repetition_then_frequency_then_presence"],
)
def test_penalty_gives_exact_logits(params, expected):
    metadata = _metadata([params], prompts=[[0, 1]], outputs=[[1, 3, 3]], vocab_size=6)
    penalized = apply_penalties(torch.tensor([PENALTY_LOGITS]), metadata)
    assert penalized.tolist() == [expected]


def test_penalties_count_each_rows_own_tokens_and_ignore_padding():
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)] * 2
    metadata = _metadata(params, prompts=[[0, 1, 2, 4], [5]], outputs=[[1, 3, 3], []], vocab_size=6)
    penalized = apply_penalties(torch.tensor([PENALTY_LOGITS] * 2), metadata)
    assert penalized.tolist() == [
        [1.0, -2.5, 0.25, 0.5, 0.0, -2.0],
        [2.0, -1.0, 0.5, 3.0, 0.0, -4.0],
    ]


def test_penalties_change_greedy_choice():
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    metadata = _metadata(params, outputs=[[2]], vocab_size=4)
    assert Sampler()(torch.tensor([[0.0, 0.0, 3.0, 2.5]]), metadata).sampled_token_ids == [3]


def test_logit_bias_adds_to_each_rows_own_tokens_after_the_penalties():
    """OpenAI's logit_bias, given as the API's dict: +100 makes a token the greedy choice, -100
    rules it out; ids past the logits are ignored; another row is untouched."""
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.25, logit_bias={"4": 100, 3: -100.0, 40: 5}),
        SamplingParams(temperature=0.0),
    ]
    assert params[0].logit_bias == ((3, -100.0), (4, 100.0), (40, 5.0))
    metadata = _metadata(params, outputs=[[1, 3, 3], [3]], vocab_size=6)
    biased = apply_penalties(torch.tensor([PENALTY_LOGITS] * 2), metadata)
    assert biased.tolist() == [[2.0, -1.25, 0.5, -97.25, 100.0, -2.0], PENALTY_LOGITS]
    assert Sampler()(torch.tensor([PENALTY_LOGITS] * 2), metadata).sampled_token_ids == [4, 3]


@pytest.mark.parametrize("bias", [{1: 100.5}, {-1: 1.0}, {token_id: 1.0 for token_id in range(1025)}])
def test_a_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(SamplingParamsError) as refused:
        SamplingParams(logit_bias=bias)
    assert refused.value.param == "logit_bias"


def test_forbidden_tokens_never_sampled_even_greedy():
    logits = _skewed_logits().expand(NUM_SAMPLES, VOCAB)
    params = [SamplingParams(temperature=0.0)] + [SamplingParams()] * (NUM_SAMPLES - 1)
    # Id 40 lies outside the logits and is ignored rather than an error.
    forbidden = [(17, 3, 40)] * NUM_SAMPLES
    torch.manual_seed(0)
    tokens = Sampler()(logits, _metadata(params, forbidden=forbidden)).sampled_token_ids
    assert tokens[0] == 29
    assert 29 in tokens and not {17, 3} & set(tokens)


def test_logprobs_are_raw_log_softmax_and_include_sampled_token():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    raw_argmax = int(logits[2].argmax())
    params = [
        SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    metadata = _metadata(params, prompts=[[0, 1], [], []], forbidden=[(), (), (raw_argmax,)])
    output = Sampler()(logits, metadata)
    expected = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = expected[0].topk(3)
    sampled = output.sampled_token_ids

    assert list(output.logprobs[0])[:3] == top_ids.tolist()
    assert output.logprobs[0] == {
        **dict(zip(top_ids.tolist(), top_values.tolist())),
        sampled[0]: expected[0, sampled[0]].item(),
    }
    assert output.logprobs[1] is None
    assert sampled[2] != raw_argmax
    assert output.logprobs[2] == {sampled[2]: expected[2, sampled[2]].item()}


def test_mixed_greedy_and_random_rows_in_one_batch():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)] * 4
    metadata = _metadata(params)
    top_two = logits.topk(2, dim=-1).indices.tolist()
    torch.manual_seed(0)
    sampler, random_picks = Sampler(), [set() for _ in range(8)]
    for _ in range(50):
        tokens = sampler(logits, metadata).sampled_token_ids
        for row in range(0, 8, 2):
            assert tokens[row] == top_two[row][0]
        for row in range(1, 8, 2):
            random_picks[row].add(tokens[row])
    for row in range(1, 8, 2):
        assert random_picks[row] == set(top_two[row])


def test_all_greedy_batch_builds_no_sampling_tensors():
    metadata = _metadata([SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=1)] * 4)
    assert metadata.all_greedy and metadata.no_penalties
    assert metadata.temperature is None and metadata.output_token_ids is None
    assert metadata.generators == {}


def test_top_k_flag_ignores_settings_of_greedy_rows():
    generators = [make_generator(1, "cpu"), make_generator(2, "cpu")]
    params = [SamplingParams(temperature=0.0, top_k=5, seed=1), SamplingParams(seed=2)]
    metadata = _metadata(params, generators=generators)
    assert metadata.no_top_k and metadata.no_top_p and metadata.no_min_p
    assert metadata.top_k.tolist() == [VOCAB, VOCAB]
    assert metadata.generators == {1: generators[1]}


def test_sampler_leaves_caller_logits_untouched():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_p=0.8, presence_penalty=1.0)] * 2
    Sampler()(logits, _metadata(params, outputs=[[0, 1], [2]], forbidden=[(5,), ()]))
    assert torch.equal(logits, before)


def test_bfloat16_logits_sample_like_float32():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 4
    output = Sampler()(logits, _metadata(params))
    assert output.sampled_token_ids == logits.float().argmax(dim=-1).tolist()
    assert all(math.isfinite(value) for row in output.logprobs for value in row.values())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-45, seed=1),
        SamplingParams(temperature=1e-6, top_k=5, seed=1),
        SamplingParams(temperature=1e38, seed=1),
        SamplingParams(temperature=0.5, repetition_penalty=1e-38, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=1e-38),
        SamplingParams(temperature=1e-30, top_p=1e-30, min_p=1.0, seed=1),
    ],
)
def test_extreme_values_sample_a_valid_token_as_their_limit(params):
    """Guards temperature=1e-45 (logits divided into inf, probabilities NaN, token 0 every time)
    and its kin: a temperature below GREEDY_TEMPERATURE is greedy, a huge one stays finite, a
    repetition penalty near 0 pushes seen tokens up without overflowing."""
    logits = _skewed_logits().unsqueeze(0) * 10
    output = Sampler()(logits, _metadata([params], prompts=[[3]], outputs=[[29]]))
    (token,) = output.sampled_token_ids
    assert 0 <= token < VOCAB
    if params.greedy and not params.has_penalties:
        assert token == TOKEN_IDS[0]
    if params.repetition_penalty < 1:
        assert token in (3, 29)  # the seen tokens, their logits pushed towards the top
