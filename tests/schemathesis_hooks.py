"""schemathesis hooks (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks): a request the schema allows may be refused only
for a reason /openapi.json documents (openapi.SEMANTIC_400_REASONS); schemathesis's own check would flag them all."""
from __future__ import annotations

import re

import schemathesis

from raylm.cluster.openai.openapi import SEMANTIC_400_REASONS


@schemathesis.check
def rejected_without_documented_reason(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                                       case: schemathesis.Case) -> bool | None:
    meta = case.meta
    positive = schemathesis.GenerationMode.POSITIVE
    if meta is None or meta.generation.mode != positive or any(
            component.mode != positive for component in meta.components.values()):
        return None
    if response.status_code != 400:
        return None
    message = response.json()["error"]["message"]
    if not any(re.search(pattern, message) for _, pattern in SEMANTIC_400_REASONS):
        raise AssertionError(f"a schema-valid request was refused for an undocumented reason: {message}")
    return None
