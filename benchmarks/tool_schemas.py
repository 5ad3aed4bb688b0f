"""Random function tools for `duet bench tools` and the tool-calling tests: parameters with nested
objects, enums, arrays, required and optional fields, each a seeded draw. ``bounded``: every
string, array and number has a bound, so that random-weight models (which rarely close a string
of their own accord) finish a call within a few dozen tokens."""

from __future__ import annotations

import random

WORDS = ["city", "unit", "query", "limit", "tags", "user", "options", "mode", "date", "count", "items", "target", "level", "note"]


def random_value_schema(rng: random.Random, depth: int, bounded: bool) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)} if bounded else {"type": "string"}
    if kind == "integer":
        return {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 500)} if bounded or rng.random() < 0.5 else {"type": "integer"}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25} if bounded else {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "celsius", "fahrenheit", "asc", "desc"], rng.randint(2, 4))}
    if kind == "array":
        array = {"type": "array", "items": random_value_schema(rng, depth + 1, bounded)}
        if bounded:
            array["maxItems"] = rng.randint(1, 3)
        return array
    return random_object_schema(rng, depth + 1, bounded)


def random_object_schema(rng: random.Random, depth: int = 0, bounded: bool = True) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4))
    schema = {
        "type": "object",
        "properties": {name: random_value_schema(rng, depth, bounded) for name in names},
        "required": [name for name in names if rng.random() < 0.7],
    }
    if bounded or rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def random_tools(rng: random.Random, count: int, bounded: bool = True) -> list[dict]:
    """``count`` tools in OpenAI's shape, named ``f0``, ``f1``, ..."""
    return [
        {"type": "function", "function": {"name": f"f{index}", "description": f"function {index}", "parameters": random_object_schema(rng, 0, bounded)}}
        for index in range(count)
    ]
