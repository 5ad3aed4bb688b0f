"""Prompt-lookup proposals: exact on handcrafted contexts and against a brute-force search on random ones."""

import random

import numpy as np
import pytest

from duet.spec_decode.ngram import propose_ngram_tokens


def test_most_recent_occurrence_wins():
    # [1, 2, 3] occurs at 0 (then 9) and at 4 (then 8).
    context = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert propose_ngram_tokens(context, 3, 3, 3) == [8, 5, 1]


def test_longer_ngram_preferred_over_more_recent_shorter_one():
    # The 3-gram [2, 3, 4] occurs at 1 (then 1, 9); the 2-gram [3, 4] also at 6 (then 6), more recently.
    context = [7, 2, 3, 4, 1, 9, 3, 4, 6, 2, 3, 4]
    assert propose_ngram_tokens(context, 1, 3, 3) == [1, 9, 3]
    assert propose_ngram_tokens(context, 1, 2, 3) == [6, 2, 3]


def test_proposal_capped_at_num_speculative_tokens():
    context = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    assert propose_ngram_tokens(context, 2, 2, 2) == [7, 8]
    assert propose_ngram_tokens(context, 2, 2, 10) == [7, 8, 9, 10, 11, 5, 6]
    assert propose_ngram_tokens(context, 2, 2, 0) == []


def test_overlapping_occurrence_proposes_only_tokens_that_exist():
    # The most recent [4, 4, 4] before the tail is tokens 1..3, followed only by the last token.
    assert propose_ngram_tokens([4, 4, 4, 4, 4], 1, 3, 3) == [4]


@pytest.mark.parametrize(
    ("context", "prompt_lookup_min"),
    [([1, 2, 3, 4], 1), ([1, 2, 9, 2], 2), ([], 1), ([7], 1)],
    ids=["last_token_never_seen", "only_shorter_than_min", "empty", "single_token"],
)
def test_no_match_proposes_nothing(context, prompt_lookup_min):
    assert propose_ngram_tokens(context, prompt_lookup_min, 3, 4) == []


def test_accepts_numpy_context_and_returns_python_ints():
    proposal = propose_ngram_tokens(np.array([3, 1, 4, 3, 1], dtype=np.int32), 1, 2, 2)
    assert proposal == [4, 3] and all(type(token_id) is int for token_id in proposal)


def test_rejects_inverted_lookup_range():
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max, got 3 and 2"):
        propose_ngram_tokens([1, 2, 3], 3, 2, 4)


def _brute_force(context: list[int], prompt_lookup_min: int, prompt_lookup_max: int, k: int) -> list[int]:
    for n in range(min(prompt_lookup_max, len(context) - 1), prompt_lookup_min - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + k]
    return []


def test_matches_brute_force_search_on_random_contexts():
    rng = random.Random(0)
    for _ in range(300):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        lookup_min = rng.randrange(1, 4)
        lookup_max = lookup_min + rng.randrange(3)
        k = rng.randrange(1, 6)
        expected = _brute_force(context, lookup_min, lookup_max, k)
        assert propose_ngram_tokens(context, lookup_min, lookup_max, k) == expected, context
