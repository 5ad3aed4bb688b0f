"""Completions' extras: best_of (each prompt's sequences ranked by the total log-probability of
their tokens), echo (the prompt before the output, with its logprobs), prompt_logprobs."""

import pytest

from duet.detokenizer import TextDelta
from duet.errors import InvalidRequestError
from duet.router.protocol import CompletionRequest
from duet.router.responses import Choice, ResponseBuilder, best_choices


def _choice(index: int, logprobs: list[float]) -> Choice:
    return Choice(index, [f"text {index}"], list(range(len(logprobs))), "stop", None, [(t, {t: lp}) for t, lp in enumerate(logprobs)])


def test_the_n_most_likely_of_each_prompts_sequences_are_kept_and_renumbered():
    # Two prompts, best_of=3: totals -3, -1, -2 and -0.5, -4, -0.25.
    choices = [_choice(0, [-1, -2]), _choice(1, [-1]), _choice(2, [-2]), _choice(3, [-0.5]), _choice(4, [-4]), _choice(5, [-0.25])]
    choices[0].prompt_logprobs = [None, {7: -0.5}]  # the prompt's first sequence scored it
    best = best_choices(choices, n=2, best_of=3)
    assert [(choice.index, choice.text) for choice in best] == [(0, "text 1"), (1, "text 2"), (2, "text 5"), (3, "text 3")]
    assert [choice.prompt_logprobs for choice in best] == [[None, {7: -0.5}]] * 2 + [None] * 2


@pytest.mark.parametrize("fields", [{"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}])
def test_best_of_below_n_or_streamed_is_refused(fields):
    with pytest.raises(InvalidRequestError) as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": "a"} | fields).check_best_of()
    assert refused.value.param == "best_of"


PROMPT_LOGPROBS = [None, {6: -1.5, 9: -0.5}, {7: -0.25}]


def test_echo_puts_the_prompt_and_its_logprobs_before_the_output():
    builder = ResponseBuilder("cmpl-1", "m", False, lambda token: f"<{token}>", True, False, echo_prompts=[("5 6 7", [5, 6, 7])], n=1)
    choice = Choice(0, [" 8"], [8], "length", None, [(8, {8: -0.75})], PROMPT_LOGPROBS)
    body = builder.response([choice], {})["choices"][0]
    assert body["text"] == "5 6 7 8"
    assert body["logprobs"]["tokens"] == ["<5>", "<6>", "<7>", "<8>"]
    assert body["logprobs"]["token_logprobs"] == [None, -1.5, -0.25, -0.75]
    assert body["logprobs"]["top_logprobs"][0] is None and body["logprobs"]["top_logprobs"][1] == {"<6>": -1.5, "<9>": -0.5}
    assert body["prompt_logprobs"][1] == {"6": {"logprob": -1.5, "decoded_token": "<6>"}, "9": {"logprob": -0.5, "decoded_token": "<9>"}}
    streamed = builder.chunk(0, TextDelta(" 8", [8], [{8: -0.75}], None, None, PROMPT_LOGPROBS), True, 0)["choices"][0]
    assert streamed["text"] == "5 6 7 8" and streamed["logprobs"]["token_logprobs"] == [None, -1.5, -0.25, -0.75]


def test_a_prompts_logprobs_reach_each_of_its_choices():
    """Only a prompt's first sequence computes them; every choice of the prompt shows them."""
    builder = ResponseBuilder("cmpl-2", "m", False, str, False, False, n=2)
    choices = [Choice(0, ["a"], [1], "stop", prompt_logprobs=PROMPT_LOGPROBS), Choice(1, ["b"], [2], "stop")]
    bodies = builder.response(choices, {})["choices"]
    assert bodies[0]["prompt_logprobs"] == bodies[1]["prompt_logprobs"] and bodies[1]["prompt_logprobs"][2] is not None
    assert "text" in bodies[1] and bodies[1]["text"] == "b"
