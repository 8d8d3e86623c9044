"""Real-world JSON schemas (the shapes of API payloads, config files and tool parameters), the constraints no
backend can enforce, and helpers that make a random-weight model finish its JSON: with a bias towards the closing
tokens (`"`, `}`, `]`, `,` and EOS, which the grammar allows only where they are valid) every string, array and
object closes as soon as the schema lets it, so each output is complete and checkable."""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

ADDRESS = {  # json-schema.org's address example
    "type": "object",
    "properties": {
        "post_office_box": {"type": "string"}, "extended_address": {"type": "string"},
        "street_address": {"type": "string"}, "locality": {"type": "string"}, "region": {"type": "string"},
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"}, "country_name": {"type": "string"},
    },
    "required": ["locality", "region", "country_name", "postal_code"],
}
CORPUS: dict[str, dict[str, Any]] = {
    "address": ADDRESS,
    "weather_tool": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "City and state"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False,
    },
    "geo_point": {
        "type": "object",
        "properties": {"latitude": {"type": "number", "minimum": -90, "maximum": 90},
                       "longitude": {"type": "number", "minimum": -180, "maximum": 180},
                       "accuracy_m": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10000}},
        "required": ["latitude", "longitude", "accuracy_m"],
    },
    "calendar_event": {
        "type": "object",
        "properties": {"summary": {"type": "string", "minLength": 1, "maxLength": 12},
                       "start": {"type": "string", "format": "date-time"},
                       "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2},
                       "id": {"type": "string", "format": "uuid"}},
        "required": ["summary", "start", "id"],
    },
    "product_catalog": {
        "type": "object",
        "properties": {"products": {"type": "array", "minItems": 1, "maxItems": 2,
                                    "items": {"$ref": "#/$defs/product"}}},
        "required": ["products"],
        "$defs": {"product": {"type": "object",
                              "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                             "price": {"type": "number", "minimum": 0},
                                             "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                             "in_stock": {"type": "boolean"}},
                              "required": ["sku", "price", "in_stock"]}},
    },
    "github_issue": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "state": {"enum": ["open", "closed"]},
                       "labels": {"type": "array", "items": {"type": "object",
                                                             "properties": {"name": {"type": "string"},
                                                                            "color": {"type": "string",
                                                                                      "pattern": "^[0-9a-f]{6}$"}},
                                                             "required": ["name", "color"]}},
                       "assignee": {"anyOf": [{"type": "null"}, {"$ref": "#/definitions/user"}]},
                       "number": {"type": "integer", "minimum": 1}},
        "required": ["title", "state", "labels", "assignee", "number"],
        "definitions": {"user": {"type": "object", "properties": {"login": {"type": "string"},
                                                                  "id": {"type": "integer"}},
                                 "required": ["login", "id"]}},
    },
    "payment": {
        "type": "object",
        "properties": {"amount": {"type": "number", "exclusiveMinimum": 0},
                       "method": {"oneOf": [
                           {"type": "object", "properties": {"card_last4": {"type": "string", "pattern": "^[0-9]{4}$"}},
                            "required": ["card_last4"], "additionalProperties": False},
                           {"type": "object", "properties": {"iban": {"type": "string", "minLength": 4,
                                                                      "maxLength": 8}},
                            "required": ["iban"], "additionalProperties": False}]}},
        "required": ["amount", "method"],
    },
    "tree": {  # recursive $ref
        "$ref": "#/$defs/node",
        "$defs": {"node": {"type": "object",
                           "properties": {"value": {"type": "integer"},
                                          "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                       "maxItems": 2}},
                           "required": ["value", "children"]}},
    },
    "app_config": {
        "type": "object",
        "properties": {"debug": {"type": "boolean"}, "log_level": {"enum": ["debug", "info", "warning"]},
                       "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "name": {"const": "raylm"}},
        "required": ["debug", "log_level", "workers", "ratio", "name"],
    },
    "string_list": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2, "maxItems": 4},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "multiple_of": {"type": "object", "properties": {"dozen": {"type": "integer", "multipleOf": 12, "minimum": 1}},
                    "required": ["dozen"]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "min_properties": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
}
# Neither backend enforces these: a request with one is refused (400), never answered with unchecked output.
UNSUPPORTED: dict[str, dict[str, Any]] = {
    "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    "if_then_else": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "lookahead_pattern": {"type": "string", "pattern": "^(?!admin).*$"},
}


def closing_bias(tokenizer: Any, eos_token_id: int) -> dict[int, float]:
    """EOS first, then tokens made only of `"`, `}`, `]` and `,`, in that order: a string closes before anything else
    that the grammar allows there, an object or array before it grows, and a number ends at its first digit."""
    bias = {eos_token_id: 50.0}
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text and set(text) <= set('"}],'):
            bias[token_id] = 40.0 if '"' in text else 35.0 if "}" in text else 30.0 if "]" in text else 20.0
    return bias


_FORMAT_CHECKER = jsonschema.FormatChecker()


_RFC3339_DATE_TIME = re.compile(
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?"
    r"(Z|[+-]([01]\d|2[0-3]):[0-5]\d)", flags=re.IGNORECASE)


@_FORMAT_CHECKER.checks("date-time")
def _rfc3339_date_time(value: object) -> bool:
    # RFC 3339's grammar: year 0000 and leap second 60 are valid, which Python's datetime (jsonschema's checker)
    # refuses.
    return not isinstance(value, str) or _RFC3339_DATE_TIME.fullmatch(value) is not None


def validate_json(text: str, schema: dict[str, Any]) -> Any:
    """Parse and validate (formats included); the parsed value."""
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=_FORMAT_CHECKER)
    return value
