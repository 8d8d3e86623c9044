"""schemathesis hooks (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks): a request the schema allows may be refused only
for a reason /openapi.json documents (openapi.SEMANTIC_400_REASONS); schemathesis's own check would flag them all. And
what a schema-valid request costs is bounded, so that hundreds of them run in CI: a few sequences of a few tokens
each (n up to 128 of max_model_len tokens each is the engine's work, not the API's)."""
from __future__ import annotations

import re
from typing import Any

import schemathesis

from raylm.cluster.entrypoints.openai.openapi import SEMANTIC_400_REASONS

# Per positive case: the most sequences, and the most tokens each (min_tokens too, to stay <= max_tokens).
_CAPS = {"n": 2, "best_of": 2, "max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4}


def _positive(case: schemathesis.Case) -> bool:
    meta = case.meta
    positive = schemathesis.GenerationMode.POSITIVE
    return meta is not None and meta.generation.mode == positive and all(
        component.mode == positive for component in meta.components.values())


@schemathesis.hook
def before_call(ctx: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    """Caps the cost of a schema-valid request, keeping it schema-valid (every capped field's minimum is at most its
    cap, and a best_of equal to n stays equal)."""
    if not _positive(case) or not isinstance(case.body, dict):
        return
    if case.path == "/v1/chat/completions" and case.body.get("max_tokens") is None:
        # Chat's default is all of max_model_len: a token budget the schema allows (vLLM's), no different to the API.
        case.body.setdefault("max_completion_tokens", _CAPS["max_completion_tokens"])
    for name, cap in _CAPS.items():
        value = case.body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
            case.body[name] = cap


@schemathesis.check
def rejected_without_documented_reason(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                                       case: schemathesis.Case) -> bool | None:
    if not _positive(case) or response.status_code != 400:
        return None
    message = response.json()["error"]["message"]
    if not any(re.search(pattern, message) for _, pattern in SEMANTIC_400_REASONS):
        raise AssertionError(f"a schema-valid request was refused for an undocumented reason: {message}")
    return None
