"""What a request constrains its output to (vLLM's StructuredOutputsParams): exactly one of a JSON schema, any JSON
object, a regex, a choice of strings, a grammar (EBNF or Lark) or a structural tag."""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any, Literal

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[StructuredOutputKind, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (as text or parsed)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect) or Lark (llguidance)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # vLLM's structural tag, as JSON text
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond what the schema needs
    whitespace_pattern: str | None = None  # JSON: a regex of the whitespace allowed between tokens (guidance only)
    disable_fallback: bool = False  # the first of the engine's backends or an error, never the next one
    # Filled in when the request is checked (StructuredOutputManager's validation): the backend that compiles it.
    _backend: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {list(KINDS)}; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
        if self.whitespace_pattern is not None:
            if self.kind not in ("json", "json_object"):
                raise ValueError(f"whitespace_pattern applies to JSON output (json or json_object), not to "
                                 f"{self.kind}")
            if self.disable_any_whitespace:
                raise ValueError("whitespace_pattern and disable_any_whitespace contradict each other: give one")

    @property
    def kind(self) -> StructuredOutputKind:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one text: the cache key of its compiled grammar (with kind and options)."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return ""
        if isinstance(value, (dict, list)):
            return jsonlib.dumps(value, sort_keys=True)
        return str(value)
