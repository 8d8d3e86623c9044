"""/openapi.json describes what the server does: its error bodies (400, 404, 500, 503; no 422), streams and their
error event, /metrics as text/plain, 405 with Allow, and the rules it enforces (OpenAI's message roles and their
required fields, a non-empty prompt, top_logprobs only with logprobs). schemathesis (run against a real server,
a hundred cases per generation route from a fixed seed) finds no undocumented status or content type, no 5xx, no
schema-violating request accepted, and no schema-valid request refused for a reason the document does not give
(tests/schemathesis_hooks.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http_server import Server, served_engine

ROOT = Path(__file__).resolve().parent.parent
MAX_EXAMPLES = 100  # per generation route: past what found the last findings (60), at half the time of 200


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[Server]:
    with served_engine(llama_path, max_model_len=64, enable_auto_tool_choice=True,
                       tool_call_parser="hermes") as (server, _):
        yield server


def test_document_matches_the_responses(server: Server) -> None:
    status, document = server.request("GET", "/openapi.json")
    assert status == 200
    for path, operations in document["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "500", "503"} <= chat.keys() and "text/event-stream" in chat["200"]["content"]
    assert "error event" in chat["200"]["description"] and "failed" in chat["500"]["description"]
    assert "max_model_len" in chat["400"]["description"]
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "content" not in document["paths"]["/health"]["get"]["responses"]["200"]
    schemas = document["components"]["schemas"]
    properties = schemas["ChatCompletionRequest"]["properties"]
    assert {"response_format", "structured_outputs", "guided_json", "tools", "tool_choice"} <= properties.keys()
    roles = {ref["$ref"].rsplit("/", 1)[1]: schemas[ref["$ref"].rsplit("/", 1)[1]]["properties"]["role"]["const"]
             for ref in properties["messages"]["items"]["oneOf"]}
    assert sorted(roles.values()) == ["assistant", "developer", "system", "tool", "user"]
    assert "content" in schemas["UserMessage"]["required"] and "tool_call_id" in schemas["ToolMessage"]["required"]
    rules = schemas["ChatCompletionRequest"]["allOf"]
    assert {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}} in rules
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt
    assert properties["use_beam_search"]["anyOf"] == [{"const": False}, {"type": "null"}]
    status, reply = server.request("DELETE", "/v1/models")
    assert status == 405 and reply["error"]["code"] == 405


def schemathesis(server: Server, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "schemathesis"), "run", f"http://127.0.0.1:{server.port}/openapi.json",
               "--url", f"http://127.0.0.1:{server.port}", "--checks", "all",
               # positive_data_acceptance is replaced by rejected_without_documented_reason, which knows the
               # documented reasons. The response-time limit (10 s by default) is the request timeout: times
               # measure this shared 2-core machine, not the API.
               "--exclude-checks", "positive_data_acceptance", "--seed", "1",
               "--request-timeout", "120", "--max-response-time", "120", "--no-color", *args]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
    # Run in a scratch folder: schemathesis keeps its crash cache (.schemathesis/) in the working directory.
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_schemathesis_finds_nothing(server: Server, tmp_path: Path) -> None:
    # At a size that finds things (at 60 cases it found a role-less message accepted and rules the schema did not
    # state): MAX_EXAMPLES cases per generation route, fewer for the others, two at a time; about 30 s in CI (2
    # cores). The coverage phase (every boundary value of every field; it crashes inside schemathesis 4.32 on the chat
    # schema) is run by hand, see docs/structured-output.md; what it found has its own test
    # (test_the_smallest_repetition_penalty_...).
    phases = ("--phases", "examples,fuzzing,stateful", "--workers", "2")
    for args in (("--include-path", "/v1/completions", *phases, "--max-examples", str(MAX_EXAMPLES)),
                 ("--include-path", "/v1/chat/completions", *phases, "--max-examples", str(MAX_EXAMPLES)),
                 ("--exclude-path", "/v1/completions", "--exclude-path", "/v1/chat/completions", *phases,
                  "--max-examples", "20")):
        result = schemathesis(server, tmp_path, *args)
        summary = result.stdout[result.stdout.rfind("SUMMARY"):]
        findings = [line for line in result.stdout.splitlines() if line.startswith(("- ST", "    `{", "    a "))]
        assert result.returncode == 0, "\n".join(findings[:20]) + summary[-2000:] + result.stderr[-2000:]
        assert "generated" in summary
