"""What the routes share (:class:`ServerState`), and the one mapping of admission to API errors.

A route finds the state on its request (``state_of(request)``, set by ``build_app``);
nothing here imports a route or the app. Admission is asked once per request, in
:meth:`ServerState.reserve` (``engine/admission.py`` checks the gate and the limits in
that one call), and its refusal becomes an API error in :func:`refusal_error` only.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import trio
from fastapi import Request

from actorllm.engine.admission import Refused
from actorllm.engine.async_engine import AsyncEngine
from actorllm.server.errors import APIError
from actorllm.server.features import Features
from actorllm.server.logprobs import TokenTexts
from actorllm.server.pacing import WritePacer
from actorllm.server.response_store import ResponseStore
from actorllm.tokenizer.actor import PromptEncoder
from actorllm.topology.placement import waits_for_loop
from actorllm.wire.messages import InvalidRequest, RefusalCode

DEFAULT_MAX_PENDING = 1024
_MAX_REQUEST_ID = 256
# Sent with an answer given before the body was read: the unread body would otherwise
# be taken for the next request on the connection, so hypercorn closes it; say so.
CLOSE = {"connection": "close"}
_T = TypeVar("_T")


def refusal_error(refused: Refused) -> APIError:
    """The API error for an admission refusal: 503, except a request that can never fit."""
    if refused.code == RefusalCode.ENGINE_DEAD:
        return APIError(503, f"the engine is dead: {refused}; the server must be restarted",
                        code="engine_dead")
    if refused.code == RefusalCode.SHUTTING_DOWN:
        return APIError(503, "the server is shutting down", code="shutting_down",
                        headers=CLOSE)
    if refused.code == RefusalCode.TOO_LARGE:  # could never run: retrying would not help
        return APIError(400, str(refused), param="n", code="invalid_request")
    return APIError(503, str(refused), code=str(refused.code))


class ServerState:
    """What the routes share: the engine, the settings, and the live-request count;
    ``features``: the settings of reasoning, the Responses API and embeddings."""

    def __init__(self, engine: AsyncEngine, *, served_model_name: str, api_key: str | None,
                 max_request_bytes: int, max_pending: int,
                 tool_call_parser: str = "json", body_timeout: float | None = None,
                 features: Features | None = None) -> None:
        self.engine = engine
        self.features = features or Features()
        # The Responses API's finished responses, for previous_response_id.
        self.response_store = ResponseStore(self.features.store_size, self.features.store_ttl)
        self.tool_call_parser = tool_call_parser  # a key of server.tools.PARSERS
        self.body_timeout = body_timeout  # --body-timeout: 408 for a body that stalls
        self.model_name = served_model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        # The engine's one gate: SIGINT/SIGTERM drain it (new work refused, /health 503);
        # each HTTP request reserves its sequences on it, up to --max-pending.
        self.admission = engine.admission
        self.admission.capacity = max_pending
        # Set when --drain-timeout runs out: requests still running end with an error.
        self.drain_expired = trio.Event()
        # Generation responses still sending (their engine work may be done, their client
        # still reading): the drain waits for these too.
        self.responding = 0
        # The streamed responses' share of the loop (server/pacing.py), taken only while
        # the engine waits for the loop: the Scheduler's latest stats say whether a
        # Worker waited for its plan (by message, so the same in every topology).
        self.pacer = WritePacer(engine_waits=functools.partial(
            waits_for_loop, lambda: engine.frontend.stats, engine.mailboxes))
        self.created = int(time.time())
        self.texts = TokenTexts(engine.tokenizer)
        # /tokenize refuses and templates exactly as the Tokenizer actor does.
        self.encoder = PromptEncoder(engine.tokenizer, engine.info)
        # /tokenize and /detokenize run the tokenizer in threads; this many at once.
        self.tokenizer_threads = trio.CapacityLimiter(2)

    def refusal(self) -> APIError | None:
        """Why a new request would be refused now (503), or None while serving."""
        refused = self.admission.refusal()
        return None if refused is None else refusal_error(refused)

    def health(self) -> APIError | None:
        """What ``/health`` answers besides 200: a refusal (draining, dead), or a 503
        ``engine_unresponsive`` while a child process's heartbeats are late."""
        refusal = self.refusal()
        if refusal is not None:
            return refusal
        late = self.engine.unresponsive
        if late is not None:
            return APIError(503, f"the engine is not responding: {late}",
                            code="engine_unresponsive")
        return None

    def reserve(self, cost: int) -> None:
        """Hold ``cost`` engine sequences for a request; raises the API error if refused."""
        try:
            self.admission.reserve(cost)
        except Refused as refused:
            raise refusal_error(refused) from None

    def release(self, cost: int) -> None:
        """Give back what :meth:`reserve` held."""
        self.admission.release(cost)

    async def in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run tokenizer work off the event loop (a 1 MB prompt takes about a second)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.tokenizer_threads)

    def check_model(self, model: str | None) -> None:
        """A request may omit ``model``; naming another one is a 404."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def check_vocab(self, ids: tuple[int, ...], param: str) -> None:
        """Every id is in the model's vocabulary (400 naming ``param`` otherwise)."""
        size = self.engine.info.vocab_size
        bad = [t for t in ids if not 0 <= t < size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is not in the vocabulary (size {size})",
                                 param)

    async def decode(self, ids: tuple[int, ...]) -> str:
        """The text of ``ids``, special tokens included (in a thread)."""
        return await self.in_thread(_decode, self.engine, ids)


def _decode(engine: AsyncEngine, ids: tuple[int, ...]) -> str:
    return str(engine.tokenizer.decode(list(ids), skip_special_tokens=False))


def state_of(request: Request) -> ServerState:
    """The state ``build_app`` put on the app that serves ``request``."""
    state = request.app.state.server
    assert isinstance(state, ServerState)
    return state


def request_id(request: Request) -> str:
    """The client's X-Request-Id, checked, or a fresh one."""
    given = request.headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not given or len(given) > _MAX_REQUEST_ID or not all(33 <= ord(c) < 127 for c in given):
        raise APIError(400, f"X-Request-Id must be 1 to {_MAX_REQUEST_ID} visible ASCII "
                       "characters", param="X-Request-Id", code="invalid_request")
    return given
