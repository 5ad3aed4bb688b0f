"""Structured outputs: constraints refused with the problem named, and the runner's matchers
(masks, drafts, the end of a constraint) on the tiny models' tokenizer (byte-level BPE with
SmolLM2's special tokens)."""

import json

import pytest
import torch

from duet.grammar_masks import GrammarMasks
from duet.runner_state import CachedRequestState
from duet.sampling_params import SamplingParams, SamplingParamsError
from duet.structured_output import StructuredOutputs, StructuredOutputsError
from tests.conftest import TINY_VOCAB

VOCAB = TINY_VOCAB
EOS = 2


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"regex": "(abc"}, "unclosed group"),
        ({"regex": "(?=a)b"}, "look-around"),
        ({"json": {"not": {"type": "string"}}}, "not"),
        ({"json": {"type": "foo"}}, "foo"),
        ({"json": "{"}, "not JSON"),
        ({"json": [1, 2]}, "is an object"),
        ({"json": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
        ({"json": _nested(1000)}, "nested too deeply"),
        ({"json": {"type": "array", "items": {"type": "array", "items": {"type": "array"}}} | {"$defs": {"x": _nested(400)}}}, "recursion"),
        ({"grammar": "root ::= (("}, "GBNF"),
        ({"grammar": "start: foo"}, "foo"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({}, "got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"choice": [f"o{i}" for i in range(12_000)]}, "at most 65536 are taken"),
        ({"regex": "a" * 70_000}, "the regex constraint has 70000 characters"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_problem(kwargs, named):
    with pytest.raises(StructuredOutputsError, match=named) as error:
        StructuredOutputs(**kwargs)
    assert error.value.param == "structured_outputs"


@pytest.mark.parametrize(
    "grammar, named", [('start: <|nope|> "a"', "unknown special token"), ("start: <[99999]>", "too large")]
)
def test_a_grammar_naming_tokens_the_model_lacks_is_refused_by_the_tokenizer_check(tiny_tokenizer_dir, grammar, named):
    """Guards what the check without a tokenizer cannot see: such a matcher starts in error,
    allows EOS alone and read as a complete, empty output."""
    import llguidance

    constraint = StructuredOutputs(grammar=grammar)  # passes: it parses
    tokenizer = llguidance.LLTokenizer((tiny_tokenizer_dir / "tokenizer.json").read_text(), eos_token=EOS)
    with pytest.raises(StructuredOutputsError, match=named):
        constraint.check_tokens(tokenizer)
    StructuredOutputs(grammar='start: <|im_end|> | "a"').check_tokens(tokenizer)


def test_the_tokenizer_check_runs_once_per_constraint_not_once_per_sequence(tiny_tokenizer_dir):
    """Guards against an ``n`` fan-out of a large constraint repeating llguidance's check against
    the tokenizer for every sequence, on the engine's thread between everyone's steps."""
    import llguidance

    from duet.structured_output import _tokenizer_problem

    tokenizer = llguidance.LLTokenizer((tiny_tokenizer_dir / "tokenizer.json").read_text(), eos_token=EOS)
    constraint = StructuredOutputs(choice=[f"tool_{i}" for i in range(500)])
    before = _tokenizer_problem.cache_info()
    for _ in range(16):
        constraint.check_tokens(tokenizer)
    after = _tokenizer_problem.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 15)


def test_a_lark_grammar_with_gbnf_s_operator_in_a_string_stays_lark():
    assert StructuredOutputs(grammar='start: "x ::= y"').kind == "grammar"
    StructuredOutputs(grammar='root ::= "yes" | "no"\n')


def test_ignore_eos_cannot_hold_a_constrained_output_open():
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a+"))


def test_a_schema_keeps_its_property_order_and_equal_schemas_share_a_grammar():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    first, second = StructuredOutputs(json=schema), StructuredOutputs(json=json.dumps(schema, indent=2))
    assert first == second and first.json == '{"type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"}}}'
    assert first.grammar_text() is second.grammar_text()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture
def masks(tiny_tokenizer_dir):
    grammar = GrammarMasks(str(tiny_tokenizer_dir), VOCAB, EOS, overlap=True)
    yield grammar
    grammar.close()


def _state(request_id: str, constraint: StructuredOutputs | None, output_token_ids=()) -> CachedRequestState:
    params = SamplingParams(temperature=0, structured_outputs=constraint)
    return CachedRequestState(request_id, [1, 2, 3], list(output_token_ids), params, [], 0, None)


def _allowed(masks: GrammarMasks, rows) -> list[set[int]]:
    logits = torch.zeros(sum(len(drafts) + 1 for _, drafts in rows), VOCAB)
    masks.apply(logits, masks.start(rows))
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]


def test_masks_allow_the_constraint_s_tokens_and_leave_other_rows_alone(masks, tokenizer):
    choice = _state("a", StructuredOutputs(choice=["yes", "no"]))
    free = _state("b", None)
    first, unconstrained = _allowed(masks, [(choice, []), (free, [])])
    assert len(unconstrained) == VOCAB
    assert tokenizer.encode("yes")[0] in first and tokenizer.encode("no")[0] in first
    assert all(("yes".startswith(text) or "no".startswith(text)) and text for text in map(tokenizer.decode, first))


def test_no_constrained_request_means_no_mask_job(masks):
    assert masks.start([(_state("b", None), [])]) is None


def test_draft_rows_follow_the_drafts_and_bad_drafts_are_cut(masks, tokenizer):
    digits = _state("a", StructuredOutputs(regex="[0-9]{3}"))
    tokens = [tokenizer.convert_tokens_to_ids(digit) for digit in "123"]
    assert masks.clip_drafts(digits, tokens + [tokens[0]]) == tokens  # a fourth digit is refused
    assert masks.clip_drafts(digits, [tokenizer.convert_tokens_to_ids("x")]) == []
    rows = _allowed(masks, [(digits, tokens)])
    assert tokens[0] in rows[0] and tokens[1] in rows[1] and tokens[2] in rows[2]
    assert rows[3] == {EOS}  # three digits complete the constraint: EOS alone is left


def test_a_resumed_request_goes_on_from_its_output_and_ends_at_eos(masks, tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(digit) for digit in "12"]
    resumed = _state("a", StructuredOutputs(regex="[0-9]{3}"), output_token_ids=ids)
    assert not masks.only_eos_left(resumed)
    (row,) = _allowed(masks, [(resumed, [])])
    assert EOS not in row and all(tokenizer.decode([token]).isdigit() for token in row)
    masks.accept(resumed, [tokenizer.convert_tokens_to_ids("3")])
    assert masks.only_eos_left(resumed)
    masks.accept(resumed, [EOS])


def test_a_token_the_constraint_refuses_fails_that_request_alone(masks, tokenizer):
    state = _state("a", StructuredOutputs(regex="[0-9]{3}"))
    masks.matcher(state)
    masks.accept(state, [tokenizer.convert_tokens_to_ids("x")])
    done = _state("b", StructuredOutputs(choice=["1"]), output_token_ids=[tokenizer.convert_tokens_to_ids("1")])
    masks.matcher(done)
    masks.accept(done, [tokenizer.convert_tokens_to_ids("1")])
    failures = masks.take_failures()
    assert set(failures) == {"a", "b"} and "cannot go on" in failures["a"] and "past the end" in failures["b"]
    assert masks.take_failures() == {}


def test_requests_of_one_grammar_start_from_copies_of_one_compiled_matcher(masks, tokenizer):
    """A request must not advance the compiled matcher the next one starts from."""
    one = tokenizer.convert_tokens_to_ids("1")
    constraint = StructuredOutputs(regex="[0-9]{2}")
    first, second = _state("a", constraint), _state("b", constraint)
    masks.matcher(first)
    masks.accept(first, [one])
    masks.matcher(second)
    assert len(masks._pristine) == 1
    assert masks.clip_drafts(second, [one] * 3) == [one] * 2 and masks.clip_drafts(first, [one] * 2) == [one]


def test_threads_asking_for_the_grammar_tokenizer_at_once_build_it_once(tiny_llama_dir, monkeypatch):
    """Its build holds the GIL (~0.25 s for SmolLM2's 49k tokens): two requests checked at once in
    one replica built it twice, stalling every stream there twice as long."""
    import threading
    import time

    import llguidance

    from duet.structured_output import _grammar_tokenizer, grammar_tokenizer

    builds = []
    real = llguidance.LLTokenizer

    def counted(*args, **kwargs):  # a build long enough for every thread to ask meanwhile
        builds.append(threading.get_ident())
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", counted)
    _grammar_tokenizer.cache_clear()
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    start, got = threading.Barrier(4), []

    def ask():
        start.wait()
        got.append(grammar_tokenizer(str(tiny_llama_dir), vocab, 2))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _grammar_tokenizer.cache_clear()  # not the counting one for later tests
    assert len(builds) == 1 and len(got) == 4 and all(tokenizer is got[0] for tokenizer in got)


def test_a_tokenizer_llguidance_refuses_before_serving_is_logged_not_raised(caplog):
    """A replica or router builds the grammar tokenizer before it serves; a model whose tokenizer
    llguidance cannot read still starts, as it did when only constrained requests built it."""
    from duet.structured_output import build_before_serving

    def refuse():
        raise ValueError("an unsupported pre-tokenizer")

    with caplog.at_level("WARNING"):
        build_before_serving(refuse)
    assert "an unsupported pre-tokenizer" in caplog.text and "constrained requests will fail" in caplog.text


def test_the_engines_grammar_tokenizer_comes_from_tokenizer_json_without_transformers(tiny_llama_dir):
    """Guards every stream of a replica: its first constrained request built llguidance's view of
    the tokenizer through transformers (1-3 s, between two steps of everyone's); from
    tokenizer.json, as the router builds its own, it takes ~0.2 s, and masks the same tokens."""
    import json
    import subprocess
    import sys

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    code = (
        "import sys; from duet.structured_output import grammar_tokenizer; "
        f"tokenizer = grammar_tokenizer({str(tiny_llama_dir)!r}, {vocab}, 2); "
        "print('transformers' in sys.modules, tokenizer.vocab_size, tokenizer.eos_token)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", str(vocab), "2"]
