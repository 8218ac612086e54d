"""The control messages of a multi-process topology (parent <-> child): process
supervision, not requests. Plain frozen attrs classes like every message; they live
apart from :mod:`actorllm.wire.messages` (which re-exports them and lists them in
``MESSAGE_TYPES``) only to keep that module small. See :mod:`actorllm.wire.transport`
for the handshake.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Hello:
    """First words on a control channel, each way: a peer built from other code is refused."""

    protocol: int  # actorllm.wire.handshake.PROTOCOL_VERSION
    codec: int  # actorllm.wire.codec.VERSION
    schema: str  # fingerprint of every message class and its fields
    role: str  # "parent", "engine" (or "engine0".. with data parallelism), "detokenizer"
    pid: int


@attrs.frozen
class Ready:
    """Child -> parent: resources loaded, actors running, inboxes bound."""

    role: str
    pid: int


@attrs.frozen
class StartFailed:
    """Child -> parent: it could not start (or, after Ready, an actor crashed); it exits next."""

    role: str
    message: str


@attrs.frozen
class MailboxStat:
    name: str
    depth: int
    high_water: int


@attrs.frozen
class Heartbeat:
    """Both ways, every half second; a child's carries its mailboxes' depths for /metrics."""

    role: str
    seq: int
    mailboxes: tuple[MailboxStat, ...] = ()


@attrs.frozen
class DrainQuery:
    """Parent -> child: report what your actors and mailboxes still hold (invariant 4)."""

    token: int


@attrs.frozen
class DrainReport:
    role: str
    token: int
    problems: tuple[str, ...] = ()
    rejected_frames: int = 0  # frames its sockets refused (garbage, wrong type) so far


@attrs.frozen
class Shutdown:
    """Parent -> child: stop the actors and exit 0."""

    reason: str = ""
