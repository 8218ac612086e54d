"""schemathesis over ``/openapi.json`` against a real server: no 5xx, and every answer
matches the schema (status code, content type, body). Issue 14, item 6.

Cases are generated from the schema (schema-valid requests), a bounded number per
operation. The server gets a short context (``--max-model-len``) and a low
``--max-pending``, so that any schema-valid request is answered in well under a second:
the point is the edge, not generation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from sim.profiles import examples
from test_server import ServerProcess, http

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = examples(25)  # per operation under ci; about 10 s in all on a busy 2-core machine
SEED = 33  # with derandomize: the same cases on every run (CI covers the same ground)
API_KEY = "sk-schema"

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def schema_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "24",
                        "--max-pending", "4", log_dir=tmp_path_factory.mktemp("schema"))
    yield from srv.serve_module()


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "24",
                        "--max-pending", "4", "--api-key", API_KEY,
                        log_dir=tmp_path_factory.mktemp("schema-key"))
    yield from srv.serve_module()


def _run_schemathesis(url: str, max_examples: int,
                      headers: dict[str, str] | None = None) -> list[str]:
    """Every operation, ``max_examples`` cases each (seeded, derandomized); their labels."""
    api = schemathesis.openapi.from_url(url + "/openapi.json")
    ran = []
    for result in api.get_all_operations():
        operation = result.ok()

        @seed(SEED)
        @given(case=operation.as_strategy())
        @settings(max_examples=max_examples, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            case.call_and_validate(base_url=url, checks=CHECKS, timeout=60, headers=headers)

        check()
        ran.append(operation.label)
    return ran


def test_schema_holds(schema_server: ServerProcess) -> None:
    ran = _run_schemathesis(schema_server.url, MAX_EXAMPLES)
    # Every route is covered, the generation ones included.
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
            "POST /detokenize", "GET /health"} <= set(ran), ran


def test_schema_holds_with_an_api_key(keyed_server: ServerProcess) -> None:
    ran = _run_schemathesis(keyed_server.url, MAX_EXAMPLES // 5,
                            headers={"Authorization": f"Bearer {API_KEY}"})
    assert "POST /v1/chat/completions" in ran


# --- the schema says what the server accepts (issue 33, item 8) ---------------------------


def _openapi(url: str) -> dict[str, Any]:
    status, _, body = http(url + "/openapi.json")
    assert status == 200
    return dict(json.loads(body))


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = http(url + path, "POST", body)
    return status, json.loads(raw)


def test_roles_are_an_enum_and_each_is_served(schema_server: ServerProcess) -> None:
    schemas = _openapi(schema_server.url)["components"]["schemas"]
    roles = schemas["ChatMessageIn"]["properties"]["role"]["enum"]
    assert "" not in roles and {"system", "user", "assistant"} <= set(roles)
    for role in roles:
        message: dict[str, Any] = {"role": role, "content": "Hi"}
        if role == "tool":
            message["tool_call_id"] = "call-1"
        status, body = _post(schema_server.url, "/v1/chat/completions", {
            "messages": [message], "max_tokens": 1})
        assert status == 200, (role, body)
    status, body = _post(schema_server.url, "/v1/chat/completions", {
        "messages": [{"role": "", "content": "Hi"}], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "messages[0].role", body


def test_integral_floats_are_integers(schema_server: ServerProcess) -> None:
    status, body = _post(schema_server.url, "/v1/completions", {
        "prompt": [1.0, 2.0], "n": 2.0, "max_tokens": 2.0})
    assert status == 200, body
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 4
    # Not an integer, and not a bool either: still refused.
    for bad in ({"n": 2.5}, {"n": True}, {"max_tokens": 1e30}):
        status, body = _post(schema_server.url, "/v1/completions", {"prompt": "x", **bad})
        assert status == 400, (bad, body)


def test_the_token_id_bound_is_the_vocabulary(schema_server: ServerProcess) -> None:
    schema = _openapi(schema_server.url)
    tokens = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    top = tokens["items"]["maximum"]
    assert tokens["items"]["minimum"] == 0
    assert _post(schema_server.url, "/detokenize", {"tokens": [top]})[0] == 200
    status, body = _post(schema_server.url, "/detokenize", {"tokens": [top + 1]})
    assert status == 400, body


def test_tokenize_takes_exactly_one_of_prompt_and_messages(
        schema_server: ServerProcess) -> None:
    one_of = _openapi(schema_server.url)["components"]["schemas"]["TokenizeRequest"]["oneOf"]
    assert sorted(b["required"] for b in one_of) == [["messages"], ["prompt"]]
    messages = [{"role": "user", "content": "Hi"}]
    assert _post(schema_server.url, "/tokenize", {"prompt": "Hi"})[0] == 200
    assert _post(schema_server.url, "/tokenize", {"messages": messages})[0] == 200
    for bad in ({}, {"prompt": "Hi", "messages": messages}):
        assert _post(schema_server.url, "/tokenize", bad)[0] == 400, bad


def test_an_unsupported_method_is_405_before_the_key(keyed_server: ServerProcess) -> None:
    for path in ("/v1/completions", "/v1/models", "/tokenize"):
        status, headers, body = http(keyed_server.url + path, "DELETE")
        assert status == 405, (path, status, body)
        assert headers.get("allow"), headers
    # A right method without the key is still refused.
    status, _, _ = http(keyed_server.url + "/v1/models")
    assert status == 401
