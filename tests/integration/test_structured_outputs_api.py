"""Structured outputs over HTTP with the official ``openai`` client: the ``pd`` application
(prefill samples the first token under the schema, decode goes on with n-gram speculation) and
the colocated one (no speculation)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.duet.schemas import SCHEMAS
from tests.integration.client import settled

pytestmark = pytest.mark.slow
APPS = [pytest.param(False, id="pd-ngram"), pytest.param(True, id="colocated")]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=30)


def _chat(client, question: str, max_tokens: int = 160, **kwargs):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0, **kwargs
    )


@pytest.mark.parametrize("colocated", APPS)
def test_every_schema_answer_validates(cluster, colocated):
    client = cluster.client(colocated)

    def ask(item):
        question, schema = item
        response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        return _chat(client, question, response_format=response_format).choices[0]

    with ThreadPoolExecutor(2) as pool:  # the pd application admits two sequences at once
        choices = list(pool.map(ask, SCHEMAS.values()))
    for choice, (name, (_, schema)) in zip(choices, SCHEMAS.items()):
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert settled(cluster, cluster.colocated_url if colocated else cluster.url)["ok"]


@pytest.mark.parametrize("colocated", APPS)
def test_parse_fills_a_pydantic_model(cluster, colocated):
    completion = cluster.client(colocated).beta.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person who lives in Rome."}],
        response_format=Person, max_tokens=120, temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120, completion.choices[0].message.content


@pytest.mark.parametrize("colocated", APPS)
def test_json_object_regex_choice_and_grammar(cluster, colocated):
    client = cluster.client(colocated)
    content = _chat(client, "Give me a JSON object about a cat.", response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(content), dict)
    date = client.completions.create(
        model="smollm2", prompt="The first moon landing was on", max_tokens=20, temperature=0.7, seed=3, stream=True,
        extra_body={"structured_outputs": {"regex": r" \d{4}-\d{2}-\d{2}"}},
    )
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", "".join(chunk.choices[0].text for chunk in date))
    answer = _chat(client, "Is water wet?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert answer.message.content in ("yes", "no") and answer.finish_reason == "stop"
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    sentence = _chat(client, "What is 6 times 7?", extra_body={"structured_outputs": {"grammar": grammar}}).choices[0].message.content
    assert re.fullmatch(r"The answer is [0-9]+\.", sentence)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "extra, named",
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "unclosed group"),
        ({"structured_outputs": {"json": {"not": {"type": "string"}}}}, "not"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
        ({"structured_outputs": {"grammar": 'start: <|nope|> "a"'}}, "unknown special token"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ],
)
def test_a_bad_constraint_gets_a_400_naming_the_problem(cluster, extra, named, stream):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, "stream": stream, **extra}
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    response = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_logprobs_under_a_constraint_are_finite_json(cluster):
    """A token the constraint forbids has logprob -inf, which JSON cannot carry: -9999.0."""
    choice = _chat(
        cluster.client(True), "Is water wet?", max_tokens=4, logprobs=True, top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["x"]}},
    ).choices[0]
    top = [entry.logprob for entry in choice.logprobs.content[0].top_logprobs]
    assert len(top) == 5 and -9999.0 in top and choice.logprobs.content[0].logprob > -9999.0


def test_a_schema_cut_by_max_tokens_finishes_with_length(cluster):
    _, schema = SCHEMAS["nested"]
    choice = _chat(
        cluster.client(), "Describe a person.", max_tokens=6,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    ).choices[0]
    assert choice.finish_reason == "length"
