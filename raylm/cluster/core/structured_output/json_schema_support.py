"""Which JSON-schema keywords each backend enforces. xgrammar accepts many keywords it then ignores, which would let
through output that does not validate: those schemas go to guidance (backend auto) or get a 400 (backend xgrammar).
(llguidance refuses what it does not implement by itself.)"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords xgrammar 0.2 parses but does not enforce (or enforces wrongly), found by checking its output with jsonschema.
XGRAMMAR_UNSUPPORTED_KEYWORDS = frozenset({
    "allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
    "contains", "minContains", "maxContains", "minProperties", "maxProperties", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "multipleOf",
})
XGRAMMAR_FORMATS = frozenset({"date-time", "date", "time", "email", "uuid", "uri"})
# Keywords whose value is a map of names to schemas, not a schema: their keys are property names, not keywords.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def xgrammar_unsupported(schema: Any) -> list[str]:
    """What xgrammar would not enforce in a schema: keywords, and string formats it does not check."""
    found: list[str] = []
    for node in _subschemas(schema):
        found += sorted(XGRAMMAR_UNSUPPORTED_KEYWORDS & node.keys())
        pattern = node.get("pattern")
        if isinstance(pattern, str) and any(look in pattern for look in ("(?=", "(?!", "(?<=", "(?<!")):
            found.append("look-around in pattern")
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in XGRAMMAR_FORMATS:
            found.append(f"format {fmt!r}")
    return list(dict.fromkeys(found))


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    if isinstance(schema, list):
        for item in schema:
            yield from _subschemas(item)
        return
    if not isinstance(schema, dict):
        return
    yield schema
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                yield from _subschemas(sub)
        elif key not in ("enum", "const", "default", "examples", "required") and isinstance(value, (dict, list)):
            yield from _subschemas(value)
