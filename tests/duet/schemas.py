"""JSON schemas the structured-output tests ask for (offline and over HTTP), with a prompt each,
and a small one that random-weight models complete in a few dozen tokens."""

from duet import SamplingParams, StructuredOutputs

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["ok", "count", "kind", "tags"],
    "additionalProperties": False,
}

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30}},
    "required": ["street", "city"],
    "additionalProperties": False,
}

SCHEMAS = {
    "nested": (
        "Describe a person who lives in Paris as JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": ADDRESS,
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
    ),
    "bounded_array": (
        "List the primary colours as JSON.",
        {
            "type": "object",
            "properties": {
                "colours": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
            },
            "required": ["colours"],
            "additionalProperties": False,
        },
    ),
    "enum_and_range": (
        "Classify the sentiment of 'I love this bread!' as JSON.",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["sentiment", "confidence", "stars"],
            "additionalProperties": False,
        },
    ),
    "optional_fields": (
        "Give a book title and, if you know it, its year, as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "in_print": {"type": "boolean"},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    ),
    "array_of_objects": (
        "Give two cities and their countries as JSON.",
        {
            "type": "object",
            "properties": {
                "cities": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
                        "required": ["city", "country"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["cities"],
            "additionalProperties": False,
        },
    ),
}


def small_schema_greedy(max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=SMALL_SCHEMA))
