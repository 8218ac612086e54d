"""The HTTP layer's small state: admission refusals mapped to API errors in one place,
the response's endings by precedence, and the one way hypercorn's methods are replaced."""

from __future__ import annotations

import logging

import pytest

from actorllm.engine.admission import Admission, Refused
from actorllm.server.generation import GenerationResponse
from actorllm.server.hypercorn_patch import replace_method
from actorllm.server.job import Ending, Phase
from actorllm.server.state import refusal_error
from actorllm.wire.messages import RefusalCode


@pytest.mark.parametrize("code,status", [
    (RefusalCode.ENGINE_DEAD, 503), (RefusalCode.SHUTTING_DOWN, 503),
    (RefusalCode.OVERLOADED, 503), (RefusalCode.TOO_LARGE, 400)])
def test_every_refusal_has_one_api_error(code: RefusalCode, status: int) -> None:
    err = refusal_error(Refused(code, "why"))
    assert err.status == status
    # A request that can never fit is the client's to change (the `n` it asked for).
    assert err.code == ("invalid_request" if code is RefusalCode.TOO_LARGE else code.value)


def test_reserve_raises_what_the_health_check_reports() -> None:
    adm = Admission(capacity=2)
    adm.drain()
    with pytest.raises(Refused) as refused:
        adm.reserve(1)
    assert refused.value.code == RefusalCode.SHUTTING_DOWN
    health = adm.refusal()
    assert health is not None
    assert refusal_error(refused.value).body() == refusal_error(health).body()


def test_the_first_ending_by_precedence_is_kept() -> None:
    resp = GenerationResponse(None, [], None, stream=True,  # type: ignore[arg-type]
                              include_usage=False, request_id="r")
    assert resp.phase is Phase.NEW and resp.ending is None
    resp._end(Ending.CLIENT_GONE)
    resp._end(Ending.STREAM_TIMEOUT)  # the write timed out: the client did not leave
    assert resp.ending is Ending.STREAM_TIMEOUT
    resp._end(Ending.CLIENT_GONE)
    assert resp.ending is Ending.STREAM_TIMEOUT
    resp._end(Ending.FAILED)
    resp._end(Ending.DRAIN_CUT)
    resp._end(Ending.FAILED)
    assert resp.ending is Ending.DRAIN_CUT and resp.ending.value == "drain_timeout"


class _Target:
    def method(self) -> str:
        return "original"


class _Other:
    def method(self) -> str:
        return "original"


def test_replace_method_wraps_once_and_leaves_a_changed_class_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def make(original: object) -> object:
        calls.append(original)

        def method(self: _Target) -> str:
            return "patched " + original(self)  # type: ignore[operator]

        return method

    assert replace_method(_Target, "method", make, without="nothing")
    assert replace_method(_Target, "method", make, without="nothing")  # a no-op
    assert len(calls) == 1 and _Target().method() == "patched original"
    with caplog.at_level(logging.WARNING):
        assert not replace_method(_Target, "gone", make, without="no gone")
        assert not replace_method(_Other, "method", make, needs=("helper",), without="x")
    assert not hasattr(_Target, "gone") and len(calls) == 1
    assert _Other().method() == "original"
    assert "no gone: this hypercorn has no _Target.gone" in caplog.text
