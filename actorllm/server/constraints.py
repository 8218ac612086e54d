"""Output constraints at the edge: a request's structured-output fields -> one
:class:`~actorllm.wire.messages.StructuredOutput` (or a 400 naming the field).

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and
its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` all
become the same message; the Tokenizer compiles it (off the loop) and refuses a grammar
that does not compile, naming the field it came from.
"""

from __future__ import annotations

import json
from typing import Any

from actorllm.server.schemas import ChatCompletionRequest, CompletionRequest
from actorllm.text.structured import check_schema_numbers
from actorllm.wire.messages import InvalidRequest, StructuredOutput


def _json_spec(schema: Any, param: str) -> StructuredOutput:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{param}: the schema is not JSON: {exc}", param) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object", param)
    # Here, before json.dumps: Python writes infinity as `Infinity`, which no JSON reader
    # after it would refuse by name.
    check_schema_numbers(schema, param)
    return StructuredOutput("json", json.dumps(schema, ensure_ascii=False), param)


def structured_output(body: ChatCompletionRequest | CompletionRequest
                      ) -> StructuredOutput | None:
    """The one output constraint a request asks for (OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` or its older ``guided_*``), or None. Two at once is a 400.
    Whether the grammar compiles is the Tokenizer's to say (it compiles it, off the loop)."""
    found: list[StructuredOutput] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutput("json", '{"type": "object"}', "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest("response_format: type json_schema needs json_schema.schema",
                                 "response_format")
        found.append(_json_spec(fmt.json_schema.schema_, "response_format"))
    so = body.structured_outputs
    if so is not None:
        given = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar), ("json_object", so.json_object))
                 if v is not None and v is not False]
        if len(given) != 1:
            raise InvalidRequest("structured_outputs: give exactly one of json, regex, choice, "
                                 f"grammar, json_object (got {given or 'none'})",
                                 "structured_outputs")
        found.append(_structured(given[0], so.json_, so.regex, so.choice, so.grammar,
                                 "structured_outputs"))
    for kind, value in (("json", body.guided_json), ("regex", body.guided_regex),
                        ("choice", body.guided_choice), ("grammar", body.guided_grammar)):
        if value is not None:
            found.append(_structured(kind, value, value, value, value, f"guided_{kind}"))
    if len(found) > 1:
        raise InvalidRequest(f"{found[1].param}: only one output constraint per request "
                             f"(also given: {found[0].param})", found[1].param)
    return found[0] if found else None


def _structured(kind: str, schema: Any, regex: Any, choice: Any, grammar: Any,
                param: str) -> StructuredOutput:
    if kind == "json":
        return _json_spec(schema, param)
    if kind == "json_object":
        return StructuredOutput("json", '{"type": "object"}', param)
    if kind == "regex":
        return StructuredOutput("regex", regex, param)
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(choice, ensure_ascii=False), param)
    return StructuredOutput("grammar", grammar, param)
