"""The handshake between two processes of one engine, and a frame's claimed version.

The handshake (:func:`make_hello`, :func:`check_hello`) runs on the control
channel between a parent and each child (:mod:`actorllm.topology`): both sides
send a :class:`~actorllm.wire.messages.Hello` with the transport protocol version, the
codec version and a fingerprint of every message class, and each refuses a peer
whose Hello differs, with an error that says which.

:func:`frame_version` lets a receiver that rejects a frame tell "a peer of another
version" from plain garbage.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache

import attrs
import msgpack

from actorllm.wire import codec
from actorllm.wire.messages import MESSAGE_TYPES, Hello

PROTOCOL_VERSION = 1
"""Bump when the transport's framing, endpoints or control protocol change."""


class HandshakeError(Exception):
    """A peer process runs different actorllm code; the two refuse each other."""


@cache
def schema_fingerprint() -> str:
    """A short hash of every message class, field name and field annotation, in order."""
    parts = []
    for cls in MESSAGE_TYPES:
        fields = ",".join(f"{f.name}:{f.type}" for f in attrs.fields(cls))
        parts.append(f"{cls.__name__}({fields})")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


def make_hello(role: str) -> Hello:
    """This process's Hello."""
    return Hello(PROTOCOL_VERSION, codec.VERSION, schema_fingerprint(), role, os.getpid())


def check_hello(peer: Hello, expect_role: str | None = None) -> None:
    """Raise :class:`HandshakeError` unless ``peer`` runs the same protocol, codec and schema."""
    who = f"{peer.role} process (pid {peer.pid})"
    if peer.protocol != PROTOCOL_VERSION:
        raise HandshakeError(f"{who} speaks transport protocol {peer.protocol}, this process "
                             f"speaks {PROTOCOL_VERSION}: mismatched actorllm installations")
    if peer.codec != codec.VERSION:
        raise HandshakeError(f"{who} speaks codec version {peer.codec}, this process speaks "
                             f"{codec.VERSION}: mismatched actorllm installations")
    if peer.schema != schema_fingerprint():
        raise HandshakeError(f"{who} has message schema {peer.schema}, this process has "
                             f"{schema_fingerprint()}: mismatched actorllm installations")
    if expect_role is not None and peer.role != expect_role:
        raise HandshakeError(f"expected the {expect_role} process, got the {who}")


def frame_version(data: bytes) -> int | None:
    """The codec version a frame claims (``[version, message]``), or None if it claims none.

    Lets a receiver tell "a peer of another version" from plain garbage.
    """
    try:
        frame = msgpack.unpackb(data, raw=False)
    except Exception:  # msgpack raises many types for garbage
        return None
    if isinstance(frame, list) and len(frame) == 2 and type(frame[0]) is int:
        return frame[0]
    return None
