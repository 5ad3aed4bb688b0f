"""Property tests of the sampler over every setting SamplingParams accepts, with extreme logits.

Guards the numerics at the edges: a NaN that reaches sampling silently picks token 0 (the argmax
of NaN), which may be the EOS that min_tokens forbids; and settings whose limit is greedy
(temperature -> 0, top_k=1, a tiny top_p, min_p=1) must pick greedy's token.
"""

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from duet.sampler import Sampler, SamplerOutput, apply_penalties, make_generator, sampling_probs
from duet.sampling_params import GREEDY_TEMPERATURE, INT64_MAX, INT64_MIN, SamplingParams
from tests.duet.test_sampler import _metadata

# The largest logit both float32 and bfloat16 hold: past it a bf16 model's logit would be inf.
LOGIT_MAX = torch.finfo(torch.bfloat16).max
# Magnitudes drawn on purpose besides arbitrary ones: 0, subnormal, tiny, ordinary, huge.
EXTREMES = [0.0, 1e-45, 1e-38, 1e-5, 1.0, 1e30, 1e38, LOGIT_MAX]
MAGNITUDES = st.one_of(st.sampled_from(EXTREMES), st.floats(0.0, LOGIT_MAX, width=32))

RANDOM_TEMPERATURES = st.one_of(
    st.sampled_from([GREEDY_TEMPERATURE, 1e30, 1e300]),
    st.floats(GREEDY_TEMPERATURE, 4.0),
    st.floats(min_value=GREEDY_TEMPERATURE, allow_infinity=False),
)
GREEDY_TEMPERATURES = st.floats(0.0, GREEDY_TEMPERATURE, exclude_max=True)
SEEDS = st.integers(0, 2**32 - 1)


def sampling_params(temperatures=st.one_of(GREEDY_TEMPERATURES, RANDOM_TEMPERATURES), penalties=True):
    """Any SamplingParams, each setting over its whole valid range with its edges drawn often."""

    def penalty(neutral: float, values: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
        return st.one_of(st.just(neutral), values) if penalties else st.just(neutral)

    return st.builds(
        SamplingParams,
        temperature=temperatures,
        top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True)),
        top_k=st.one_of(st.sampled_from([0, -1, 1]), st.integers(1, INT64_MAX)),
        min_p=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
        repetition_penalty=penalty(1.0, st.floats(0.0, exclude_min=True, allow_infinity=False)),
        presence_penalty=penalty(0.0, st.floats(-2.0, 2.0)),
        frequency_penalty=penalty(0.0, st.floats(-2.0, 2.0)),
        seed=st.one_of(st.none(), st.integers(INT64_MIN, INT64_MAX)),
        logprobs=st.one_of(st.none(), st.integers(0, 20)),
    )


@st.composite
def greedy_equivalent_params(draw, vocab_size: int) -> SamplingParams:
    """Any settings without penalties, with one setting at a value whose limit is greedy."""
    setting = draw(
        st.one_of(
            GREEDY_TEMPERATURES.map(lambda temperature: {"temperature": temperature}),
            st.just({"top_k": 1}),
            # The top token's probability is at least 1 / vocab_size, so it alone reaches this top_p.
            st.floats(0.0, 0.5 / vocab_size, exclude_min=True).map(lambda top_p: {"top_p": top_p}),
            st.just({"min_p": 1.0}),
        )
    )
    return dataclasses.replace(draw(sampling_params(penalties=False)), **setting)


def is_greedy_equivalent(params: SamplingParams, vocab_size: int) -> bool:
    """Settings that leave a row whose largest logit is unique only that logit's token to pick."""
    return not params.has_penalties and (
        params.greedy or params.top_k == 1 or params.top_p <= 0.5 / vocab_size or params.min_p == 1.0
    )


@dataclass(frozen=True)
class Row:
    """One logits row and its request: randn(noise_seed) x scale + offset, then ``extremes``
    (token id, logit) written over it and ``masked`` token ids set to -inf. ``keeper`` is neither
    masked nor forbidden, so every row has a token it may pick."""

    params: SamplingParams
    noise_seed: int
    scale: float
    offset: float
    extremes: tuple[tuple[int, float], ...]
    keeper: int
    masked: tuple[int, ...]
    forbidden: tuple[int, ...]
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class Batch:
    vocab_size: int
    dtype: torch.dtype
    rows: list[Row]


@st.composite
def rows(draw, vocab_size: int, params: st.SearchStrategy[SamplingParams]) -> Row:
    keeper = draw(st.integers(0, vocab_size - 1))

    def token_ids(limit: int) -> tuple[int, ...]:
        """A few ids below ``limit``, or all of them (leaving the keeper alone); never the keeper."""
        ids = draw(st.one_of(st.lists(st.integers(0, limit - 1), max_size=8), st.just(range(limit))))
        return tuple(sorted(set(ids) - {keeper}))

    seen = st.one_of(st.lists(st.integers(0, vocab_size - 1), max_size=16), st.just(list(range(vocab_size))))
    extreme_logit = st.sampled_from(EXTREMES).flatmap(lambda magnitude: st.sampled_from([magnitude, -magnitude]))
    return Row(
        params=draw(params),
        noise_seed=draw(SEEDS),
        scale=draw(MAGNITUDES),
        offset=draw(MAGNITUDES) * draw(st.sampled_from([1.0, -1.0])),
        extremes=tuple(draw(st.lists(st.tuples(st.integers(0, vocab_size - 1), extreme_logit), max_size=8))),
        keeper=keeper,
        masked=token_ids(vocab_size),
        # Ids past the vocabulary are allowed and ignored.
        forbidden=token_ids(vocab_size + 4),
        prompt=draw(seen),
        output=draw(seen),
    )


@st.composite
def batches(draw, params=sampling_params(), greedy_equivalent_rows=False) -> Batch:
    """1-8 rows over a 64-512 token vocabulary, as float32 or bfloat16 logits; with
    ``greedy_equivalent_rows`` about half of them have greedy-equivalent settings."""
    vocab_size = draw(st.integers(64, 512))
    any_row = rows(vocab_size, params)
    if greedy_equivalent_rows:
        any_row = st.one_of(any_row, rows(vocab_size, greedy_equivalent_params(vocab_size)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return Batch(vocab_size, dtype, draw(st.lists(any_row, min_size=1, max_size=8)))


def batch_logits(batch: Batch, unique_top: bool = False) -> torch.Tensor:
    """[rows, vocab] logits of ``batch``; with ``unique_top`` each row's keeper is its largest
    logit by a margin (1 plus 1/64 of the runner-up) that survives bf16 rounding."""
    logits = []
    for row in batch.rows:
        noise = torch.randn(batch.vocab_size, generator=torch.Generator().manual_seed(row.noise_seed), dtype=torch.float64)
        values = (noise * row.scale + row.offset).clamp(-LOGIT_MAX, LOGIT_MAX)
        for token_id, value in row.extremes:
            values[token_id] = value
        values[list(row.masked)] = float("-inf")
        if unique_top:
            values.clamp_(max=LOGIT_MAX / 2)  # room above the runner-up
            values[row.keeper] = float("-inf")
            runner_up = values.max().item()
            values[row.keeper] = 0.0 if runner_up == float("-inf") else runner_up + 1 + abs(runner_up) / 64
        logits.append(values)
    return torch.stack(logits).to(batch.dtype)


def sample(batch: Batch, logits: torch.Tensor, global_seed: int) -> SamplerOutput:
    generators = [None if row.params.seed is None else make_generator(row.params.seed, "cpu") for row in batch.rows]
    metadata = _metadata(
        [row.params for row in batch.rows],
        prompts=[row.prompt for row in batch.rows],
        outputs=[row.output for row in batch.rows],
        generators=generators,
        forbidden=[row.forbidden for row in batch.rows],
        vocab_size=batch.vocab_size,
    )
    torch.manual_seed(global_seed)
    return Sampler()(logits, metadata)


@pytest.mark.slow  # 200 examples: seconds
@settings(max_examples=200, deadline=None)
@given(batch=batches(), global_seed=SEEDS)
def test_any_settings_sample_a_token_that_is_neither_forbidden_nor_masked(batch, global_seed):
    """Guards NaN reaching sampling, where argmax picks the first NaN: a forbidden EOS seen in the
    prompt under repetition_penalty=1e-50 (-inf x 0), or token 0 of a row that is NaN throughout."""
    output = sample(batch, batch_logits(batch), global_seed)
    for row, token in zip(batch.rows, output.sampled_token_ids):
        assert 0 <= token < batch.vocab_size
        assert token not in row.forbidden and token not in row.masked
    for row_logprobs in output.logprobs or []:
        # -inf is a masked token's log-probability; NaN is never one.
        assert all(value <= 0 for value in (row_logprobs or {}).values())


@pytest.mark.slow  # 200 examples: seconds
@settings(max_examples=200, deadline=None)
@given(batch=batches())
def test_penalties_at_any_setting_never_make_a_logit_nan(batch):
    """Guards a repetition penalty that rounds to 0 or inf in float32 (1e-50, 1e39): -inf x 0 on a
    seen forbidden token, or 0 x inf on a seen logit of 0, was NaN, and greedy picked that token."""
    params = [row.params for row in batch.rows]
    metadata = _metadata(
        params,
        prompts=[row.prompt for row in batch.rows],
        outputs=[row.output for row in batch.rows],
        vocab_size=batch.vocab_size,
    )
    if not metadata.no_penalties:
        assert not apply_penalties(batch_logits(batch).float(), metadata).isnan().any()


@pytest.mark.slow  # 200 examples: seconds
@settings(max_examples=200, deadline=None)
@given(batch=batches(greedy_equivalent_rows=True), global_seed=SEEDS)
def test_settings_whose_limit_is_greedy_pick_the_largest_logit(batch, global_seed):
    """Guards the settings whose limit is greedy (temperature below GREEDY_TEMPERATURE, top_k=1, a
    top_p below the top token's probability, min_p=1) at any temperature and beside rows with
    penalties: min_p=1 and a tiny top_p at temperature 1e30 sampled at random, and a batch-mate's
    penalty clamped every row's logits at 1e30, tying those above it."""
    tokens = sample(batch, batch_logits(batch, unique_top=True), global_seed).sampled_token_ids
    greedy_rows = [i for i, row in enumerate(batch.rows) if is_greedy_equivalent(row.params, batch.vocab_size)]
    assert [tokens[i] for i in greedy_rows] == [batch.rows[i].keeper for i in greedy_rows]


@pytest.mark.slow  # 200 examples: seconds
@settings(max_examples=200, deadline=None)
@given(batch=batches(params=sampling_params(temperatures=RANDOM_TEMPERATURES)))
def test_extreme_logits_give_a_distribution_without_nan(batch):
    """Guards logits near float32's limit divided by a small temperature: they overflowed to inf and
    the probabilities were NaN. All-equal, hugely spread, masked (-inf) and bf16 logits included."""
    logits = batch_logits(batch)
    probs = sampling_probs(logits, [row.params for row in batch.rows])
    assert probs.isfinite().all() and (probs >= 0).all()
    # float32 rounding over at most 512 terms.
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(batch.rows)), rtol=0, atol=1e-5)
    for i, row in enumerate(batch.rows):
        assert probs[i, list(row.masked)].eq(0).all()
        # Every filter keeps the likeliest token.
        assert probs[i, logits[i].argmax()] > 0


def test_small_temperature_on_logits_near_float32_max_gives_probabilities():
    """Guards logits divided by a small temperature overflowing to inf: the probabilities were NaN
    and the exponential race picked token 0."""
    logits = torch.tensor([[3e38, 1e38, 0.0, -3e38], [-3e38] * 4])
    probs = sampling_probs(logits, [SamplingParams(temperature=0.01)] * 2)
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.25] * 4]


def test_repetition_penalty_beyond_float32_keeps_forbidden_tokens_impossible():
    """Guards repetition penalties that round to 0 or inf in float32: -inf x 0 made the forbidden
    EOS (7) seen in the prompt NaN and greedy picked it; 0 x inf did the same to a seen logit of 0."""
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1e-50),
        SamplingParams(temperature=0.0, repetition_penalty=1e39),
    ]
    metadata = _metadata(params, prompts=[[7, 1], [0, 1]], forbidden=[(7,), ()], vocab_size=8)
    assert Sampler()(torch.arange(8.0).expand(2, 8), metadata).sampled_token_ids == [1, 7]


def test_penalty_past_float32_on_every_allowed_token_still_picks_an_allowed_one():
    """Guards penalized logits overflowing to -inf: with every allowed token seen, the row was all
    -inf and argmax picked token 0, the forbidden one."""
    params = [SamplingParams(temperature=0.0, repetition_penalty=1e30)]
    metadata = _metadata(params, prompts=[[1, 2, 3]], forbidden=[(0,)], vocab_size=4)
    assert Sampler()(torch.tensor([[5.0, -1e10, -2e10, -3e10]]), metadata).sampled_token_ids == [1]


def test_a_batch_mates_penalty_leaves_extreme_logits_apart():
    """Guards the clamp at 1e30 that penalties applied to every row: logits above it tied, so a
    greedy row's token depended on whether another request in its batch had penalties."""
    logits = torch.tensor([[1e38, 2e38, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(presence_penalty=1.0)]
    assert Sampler()(logits, _metadata(params, vocab_size=4)).sampled_token_ids[0] == 1


def test_min_p_one_and_tiny_top_p_are_greedy_at_a_huge_temperature():
    """Guards probabilities that a huge temperature rounds to ties: min_p=1 and top_p=1e-3 kept
    every token and sampled at random instead of the largest logit."""
    params = [SamplingParams(temperature=1e30, min_p=1.0), SamplingParams(temperature=1e30, top_p=1e-3)] * 16
    torch.manual_seed(0)
    tokens = Sampler()(torch.arange(64.0).expand(32, 64), _metadata(params, vocab_size=64)).sampled_token_ids
    assert tokens == [63] * 32
