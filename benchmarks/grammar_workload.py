"""The constraints `duet bench grammar` compiles and walks: twelve JSON schemas (nested objects,
bounded arrays, enums, numeric ranges, optional fields, closed objects, string formats and
patterns, references, recursion, anyOf, arrays of objects), json_object mode, a regex, a
choice and a GBNF grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Constraint:
    name: str
    kind: str  # json, regex, choice or ebnf
    text: str


def _schema(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required} | extra


STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
ADDRESS = _schema({"street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
SCHEMAS = {
    "nested": _schema({
        "user": _schema({"name": STRING, "address": ADDRESS, "contact": _schema({"email": STRING, "phone": STRING})}),
    }),
    "array_bounds": _schema({
        "tags": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 5},
        "scores": {"type": "array", "items": NUMBER, "minItems": 3, "maxItems": 3},
    }),
    "enum": _schema({"status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}, "priority": {"enum": [1, 2, 3]}}),
    "numeric_ranges": _schema({
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "discount": {"type": "number", "minimum": 0, "maximum": 1}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    }),
    "optional_fields": _schema({"title": STRING, "subtitle": STRING, "pages": INTEGER, "draft": BOOLEAN}, required=["title"]),
    "closed_object": _schema(
        {"id": INTEGER, "settings": _schema({"theme": STRING, "font_size": INTEGER}, additionalProperties=False)},
        additionalProperties=False,
    ),
    "string_formats": _schema({
        "email": {"type": "string", "format": "email"}, "created": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}, "birthday": {"type": "string", "format": "date"},
    }),
    "string_pattern": _schema({
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "code": {"type": "string", "minLength": 4, "maxLength": 8},
        "hex_color": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
    }),
    "refs": _schema(
        {"shipping": {"$ref": "#/$defs/address"}, "billing": {"$ref": "#/$defs/address"}}, **{"$defs": {"address": ADDRESS}}
    ),
    "recursive_ref": {"$ref": "#/$defs/node", "$defs": {
        "node": _schema({"label": STRING, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}),
    }},
    "any_of": _schema({
        "id": {"anyOf": [STRING, INTEGER]},
        "payment": {"anyOf": [_schema({"card_number": STRING, "expiry": STRING}), _schema({"iban": STRING, "bic": STRING})]},
    }),
    "array_of_objects": _schema({
        "order_id": INTEGER,
        "lines": {"type": "array", "minItems": 1, "items": _schema({"sku": STRING, "quantity": INTEGER, "unit_price": NUMBER})},
    }),
    "json_object": {"type": "object"},
}
SQL_GRAMMAR = r"""root ::= "SELECT " columns " FROM " name where? ";"
columns ::= "*" | name (", " name)*
where ::= " WHERE " name " " op " " value
op ::= "=" | "<" | ">"
value ::= [0-9]+ | "'" [a-zA-Z ]* "'"
name ::= [a-z] [a-z_]*
"""
CONSTRAINTS = [Constraint(name, "json", json.dumps(schema)) for name, schema in SCHEMAS.items()] + [
    Constraint("iso_date", "regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    Constraint("sentiment", "choice", json.dumps(["positive", "negative", "neutral"])),
    Constraint("sql_select", "ebnf", SQL_GRAMMAR),
]
