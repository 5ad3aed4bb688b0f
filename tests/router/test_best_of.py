"""best_of: each prompt's sequences ranked by the total log-probability of their tokens."""

import pytest

from duet.errors import InvalidRequestError
from duet.router.protocol import CompletionRequest
from duet.router.responses import Choice, best_choices


def _choice(index: int, logprobs: list[float]) -> Choice:
    return Choice(index, [f"text {index}"], list(range(len(logprobs))), "stop", None, [(t, {t: lp}) for t, lp in enumerate(logprobs)])


def test_the_n_most_likely_of_each_prompts_sequences_are_kept_and_renumbered():
    # Two prompts, best_of=3: totals -3, -1, -2 and -0.5, -4, -0.25.
    choices = [_choice(0, [-1, -2]), _choice(1, [-1]), _choice(2, [-2]), _choice(3, [-0.5]), _choice(4, [-4]), _choice(5, [-0.25])]
    best = best_choices(choices, n=2, best_of=3)
    assert [(choice.index, choice.text) for choice in best] == [(0, "text 1"), (1, "text 2"), (2, "text 5"), (3, "text 3")]


@pytest.mark.parametrize("fields", [{"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}])
def test_best_of_below_n_or_streamed_is_refused(fields):
    with pytest.raises(InvalidRequestError) as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": "a"} | fields).check_best_of()
    assert refused.value.param == "best_of"
