"""One HTTP request's engine work (:class:`Job`), and the states of the response that runs it.

``generation.GenerationResponse`` owns them; a route builds the jobs.
"""

from __future__ import annotations

import enum

import attrs

from actorllm.frontend.collector import OutputCollector
from actorllm.wire.messages import GenerateRequest
from actorllm.wire.outputs import EndOfOutput, RequestError, RequestOutput


class ClientGone(Exception):
    """The client disconnected (or was cut); stop quietly."""


def client_gone(exc: BaseException) -> bool:
    """``exc`` is ClientGone, or a group made only of them (trio groups task errors)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(ClientGone)[1] is None
    return isinstance(exc, ClientGone)


class Phase(enum.Enum):
    """How far the response has come; it only moves forward."""

    NEW = "new"  # nothing reserved, nothing sent
    ADMITTED = "admitted"  # sequences reserved and engine requests submitted; nothing sent
    SENT = "sent"  # the status line is out: an error now travels inside the body


class Ending(enum.Enum):
    """Why a response stops before its engine requests finish, by precedence (when two
    happen, the first listed is kept). The value is the abort reason the engine gets."""

    DRAIN_CUT = "drain_timeout"  # --drain-timeout ran out (ServerState.drain_expired)
    FAILED = "sibling_failed"  # one engine request failed: the others are not needed
    STREAM_TIMEOUT = "stream_timeout"  # the client took nothing for --stream-timeout
    CLIENT_GONE = "client_disconnect"


PRECEDENCE = {e: i for i, e in enumerate(Ending)}


@attrs.define(eq=False)
class Job:
    """One engine request of an HTTP request: its choices are ``index_base + i``."""

    request: GenerateRequest
    index_base: int = 0
    echo: str = ""  # completions with echo: text put before each choice's output
    collector: OutputCollector | None = None
    # The echo is a text prompt as given (its special tokens, like <|bos|>, not shown),
    # or the decoding of token ids with them: text_offset must know which.
    echo_skips_special: bool = True

    def client_took(self, t: float) -> None:
        """The client took bytes at ``t`` while a write waited: it reads, if slowly, so
        the Frontend's --stream-timeout rule (time since the last take from the collector;
        nothing is taken while a write waits) must not call it stalled."""
        if self.collector is not None:
            self.collector.reader_progressed(t)

    @property
    def cost(self) -> int:
        """Engine sequences it occupies (what the overload cap counts)."""
        return self.request.params.n

    async def next(self) -> RequestOutput | RequestError | None:
        """Its next output, the error it failed with, or None once it has ended."""
        assert self.collector is not None
        try:
            return await self.collector.get()
        except EndOfOutput:
            return None
        except RequestError as exc:
            return exc
