"""schemathesis over ``/openapi.json`` against a real server: no 5xx, and every answer
matches the schema (status code, content type, body). Issue 14, item 6.

Cases are generated from the schema (schema-valid requests), a bounded number per
operation. The server gets a short context (``--max-model-len``) and a low
``--max-pending``, so that any schema-valid request is answered in well under a second:
the point is the edge, not generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from sim.profiles import examples
from test_server import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = examples(25)  # per operation under ci; about 10 s in all on a busy 2-core machine

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def schema_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "24",
                        "--max-pending", "4", log_dir=tmp_path_factory.mktemp("schema"))
    yield from srv.serve_module()


def test_schema_holds(schema_server: ServerProcess) -> None:
    api = schemathesis.openapi.from_url(schema_server.url + "/openapi.json")
    ran = []
    for result in api.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            case.call_and_validate(base_url=schema_server.url, checks=CHECKS, timeout=60)

        check()
        ran.append(operation.label)
    # Every route is covered, the generation ones included.
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
            "POST /detokenize", "GET /health"} <= set(ran), ran
