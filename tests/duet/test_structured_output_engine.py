"""Structured outputs through the offline engine: every constrained output is valid, whatever the
batching, speculation or preemption, and a constraint that allows everything changes nothing."""

import gc
import json
import logging
import re

import jsonschema
import pytest

from duet import LLM, SamplingParams, StructuredOutputs
from tests.conftest import drain
from tests.duet.schemas import SCHEMAS, SMALL_SCHEMA, small_schema_greedy
from duet.benchmarks.prompts import encode_conversations
from tests.reference import compare_to_reference

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive": False}
MAX_TOKENS = 160
EOS_ID = 2  # SmolLM2's <|im_end|>, at the same id in the tiny models' tokenizer


def _chat(tokenizer, question: str) -> list[int]:
    return encode_conversations(tokenizer, [[{"role": "user", "content": question}]])[0]


def _schema_requests(tokenizer, temperature: float):
    prompts, params = [], []
    for index, (question, schema) in enumerate(SCHEMAS.values()):
        prompts.append(_chat(tokenizer, question))
        params.append(
            SamplingParams(
                temperature=temperature, seed=index, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs(json=schema)
            )
        )
    return prompts, params


def _check_valid(outputs) -> list[list[int]]:
    for output, (name, (_, schema)) in zip(outputs, SCHEMAS.items()):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def plain(smollm2_tokenizer):
    llm = LLM(model="smollm2", max_model_len=1024)
    yield llm
    del llm
    gc.collect()


@pytest.mark.slow
def test_every_schema_output_validates_with_and_without_ngram_speculation(plain, smollm2_tokenizer, caplog):
    """Guards the masks on every path that samples: plain rows, and drafts cut to what the
    schema allows then verified against masked rows (greedy output equal token for token), with
    no step failing on the way."""
    greedy_prompts, greedy = _schema_requests(smollm2_tokenizer, 0.0)
    random_prompts, random = _schema_requests(smollm2_tokenizer, 0.8)
    speculating = LLM(model="smollm2", max_model_len=1024, speculative_config=NGRAM)
    with caplog.at_level(logging.ERROR, logger="duet"):
        expected = _check_valid(plain.generate(greedy_prompts, greedy))
        _check_valid(plain.generate(random_prompts, random))
        assert _check_valid(speculating.generate(greedy_prompts, greedy)) == expected
        _check_valid(speculating.generate(random_prompts, random))
    assert not caplog.records, [record.getMessage()[:200] for record in caplog.records]
    stats = speculating.engine.stats()
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens, stats
    speculating.engine.check_integrity()
    del speculating
    gc.collect()


@pytest.mark.slow
def test_regex_choice_and_grammar_outputs_match(plain, smollm2_tokenizer):
    cases = [
        ("What is today's date?", StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}"), lambda text: re.fullmatch(r"\d{4}-\d{2}-\d{2}", text)),
        ("Is the sky green?", StructuredOutputs(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
        (
            "Add two small numbers.",
            StructuredOutputs(grammar='root ::= number " + " number " = " number\nnumber ::= [1-9] [0-9]?'),
            lambda text: re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?", text),
        ),
        (
            "Name a fruit.",
            StructuredOutputs(grammar='start: "A " FRUIT "."\nFRUIT: "apple" | "pear" | "plum"'),
            lambda text: text in ("A apple.", "A pear.", "A plum."),
        ),
    ]
    prompts = [_chat(smollm2_tokenizer, question) for question, _, _ in cases]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint) for _, constraint, _ in cases]
    for output, (_, _, matches) in zip(plain.generate(prompts, params), cases):
        assert output.outputs[0].finish_reason == "stop" and matches(output.outputs[0].text), output.outputs[0].text


@pytest.mark.slow
def test_a_grammar_that_allows_everything_leaves_greedy_output_unchanged(plain, parity_prompts, parity_references):
    """The mask is exact: where every text is allowed, greedy output is transformers' token for token."""
    prompts, references = parity_prompts[:6], parity_references[:6]
    num_tokens = len(references[0].token_ids)  # transformers' references hold EOS off as min_tokens does
    everything = SamplingParams(
        temperature=0, max_tokens=num_tokens, min_tokens=num_tokens, structured_outputs=StructuredOutputs(regex=r"(?s:.*)")
    )
    outputs = plain.generate(prompts, everything)
    failures = [compare_to_reference(o.outputs[0].token_ids, ref, f"prompt {i}") for i, (o, ref) in enumerate(zip(outputs, references))]
    assert not any(failures), failures


@pytest.mark.slow
def test_a_preempted_constrained_request_resumes_from_its_output(smollm2_tokenizer, plain):
    """Guards the matcher's rebuild: a request recomputed after preemption goes on from the
    state after its last token, not from the start of its schema."""
    prompts, params = _schema_requests(smollm2_tokenizer, 0.0)
    expected = [output.outputs[0].token_ids for output in plain.generate(prompts, params)]
    cramped = LLM(model="smollm2", max_model_len=1024, num_kv_blocks=14)
    assert _check_valid(cramped.generate(prompts, params)) == expected
    assert cramped.engine.scheduler.num_preemptions > 0
    cramped.engine.check_integrity()


@pytest.mark.slow
def test_a_constraint_cut_by_max_tokens_finishes_with_length(plain, smollm2_tokenizer):
    _, schema = SCHEMAS["nested"]
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputs(json=schema))
    completion = plain.generate([_chat(smollm2_tokenizer, "Describe a person.")], params)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5


def test_the_engine_refuses_a_grammar_naming_a_token_the_model_lacks(tiny_llama_dir):
    from duet.structured_output import StructuredOutputsError

    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(grammar='start: <|nope|> "a"'))
    with pytest.raises(StructuredOutputsError, match="unknown special token"):
        llm.generate([[1, 2, 3]], params)
    llm.engine.check_integrity()


def test_logprobs_under_a_constraint_are_the_masked_distribution_s(tiny_llama_dir):
    """As vLLM's: the sampled token's logprob is finite, a forbidden token's -inf."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, structured_outputs=StructuredOutputs(choice=["x"]))
    completion = llm.generate([[1, 2, 3]], params)[0].outputs[0]
    first = completion.logprobs[0]
    assert first[completion.token_ids[0]] > float("-inf") and float("-inf") in first.values()


def test_a_random_model_writes_valid_json_under_a_schema(tiny_llama_dir):
    """A random-weight model never writes JSON by itself: only the masks make these valid."""
    schema = SMALL_SCHEMA
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    params = [
        SamplingParams(temperature=temperature, seed=seed, max_tokens=60, structured_outputs=StructuredOutputs(json=schema))
        for temperature in (0.0, 1.0)
        for seed in range(3)
    ]
    outputs = llm.generate([[1, 2, 3, 4 + index] for index in range(len(params))], params)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    llm.engine.check_integrity()


@pytest.mark.parametrize("speculative_config", [None, NGRAM], ids=["plain", "ngram"])
def test_min_tokens_gives_way_when_the_constraint_allows_only_eos(tiny_llama_dir, tiny_tokenizer, speculative_config, caplog):
    """Guards a hostile mix: min_tokens forbids EOS, a complete constraint allows EOS alone. The
    request ends there (EOS wins) instead of sampling from a row where nothing is allowed, also
    when the prompt makes n-gram speculation propose the constraint's end and EOS: no step fails
    (a failed step is rerun request by request, which would hide it in the tokens)."""
    answer = tiny_tokenizer.encode("yes please")
    prompt = (answer + [EOS_ID]) * 4
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=speculative_config)
    constraint = StructuredOutputs(choice=["yes please"])
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=constraint)
    with caplog.at_level(logging.ERROR, logger="duet"):
        completion = llm.generate([prompt], params)[0].outputs[0]
    assert not caplog.records, [record.getMessage()[:200] for record in caplog.records]
    assert (completion.text, completion.finish_reason) == ("yes please", "stop")
    assert completion.token_ids == answer + [EOS_ID]
    llm.engine.check_integrity()


@pytest.mark.parametrize("min_tokens", [0, 1])
def test_a_draft_that_ends_the_constraint_with_eos_ends_the_output_there(tiny_llama_dir, tiny_tokenizer, min_tokens, caplog):
    """Guards a complete answer failed under speculation: a draft ending the constraint with EOS
    was kept, verification added a token after the EOS (from a row no mask constrains), and the
    grammar failed the request for going on past its end, its accepted tokens dropped."""
    answer = tiny_tokenizer.encode("yes please")
    prompt = [1000, *answer, EOS_ID, 198, 1000]
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM | {"prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=min_tokens, structured_outputs=StructuredOutputs(choice=["yes please"]))
    with caplog.at_level(logging.WARNING, logger="duet"):
        completion = llm.generate([prompt], params)[0].outputs[0]
    assert not caplog.records, [record.getMessage()[:200] for record in caplog.records]
    assert (completion.token_ids, completion.finish_reason) == (answer + [EOS_ID], "stop")
    assert llm.engine.stats().spec.num_accepted_tokens > 0
    llm.engine.check_integrity()


def test_a_constraint_the_grammar_engine_gives_up_on_fails_its_request_alone(tiny_llama_dir, caplog):
    """Hostile grammars that pass the check but cannot be followed: one with no end (its parser
    hits llguidance's item limit) and one whose only text is EOS's own (a special token the
    matcher then refuses). Each fails alone, reported by the runner: no step fails, so the others
    are not rerun one by one, and they finish as if alone."""
    from duet.messages import EngineRequest

    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    prompts = [[1, 2, 3], [5, 6, 7, 8], [9, 10]]
    plain = SamplingParams(temperature=0, max_tokens=12)
    undisturbed = [output.outputs[0].token_ids for output in llm.generate(prompts, [plain, small_schema_greedy(), plain])]
    engine = llm.engine
    for index, (prompt, params) in enumerate(zip(prompts, [plain, small_schema_greedy(), plain])):
        engine.add_request(EngineRequest(f"good-{index}", prompt, params))
    for index, grammar in enumerate(['root ::= "a" root', 'start: "<|im_end|>"']):
        engine.add_request(EngineRequest(f"bad-{index}", [4, 4], SamplingParams(max_tokens=200, structured_outputs=StructuredOutputs(grammar=grammar))))
    with caplog.at_level(logging.ERROR, logger="duet"):
        tokens, errors = drain(engine, 2000)
    assert not caplog.records, [record.getMessage()[:200] for record in caplog.records]
    assert "constraint cannot go on" in errors.pop("bad-0") and "constraint cannot go on" in errors.pop("bad-1")
    assert set(errors.values()) == {None}
    assert [tokens[f"good-{index}"] for index in range(len(prompts))] == undisturbed
    engine.check_integrity()
