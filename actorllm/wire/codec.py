"""The one wire format: msgpack, versioned, driven by the messages' own type hints.

A frame is ``[VERSION, message]`` and a message is ``[type name, [field, ...]]``
with fields in declaration order. Decoding checks every field against its
annotation (tuples stay tuples, ints stay ints), so a frame either becomes the
exact message that was sent or raises :class:`CodecError`. There is no pickle
and no eval: only the classes in ``MESSAGE_TYPES`` can be built.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

import attrs
import msgpack

from actorllm.wire import messages
from actorllm.wire.messages import MESSAGE_TYPES

VERSION = 1

_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in MESSAGE_TYPES}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in attrs.fields(cls)) for cls in MESSAGE_TYPES}


class CodecError(ValueError):
    """A frame that is not a well-formed message of this codec version."""


def encode(msg: Any) -> bytes:
    """Serialize one registered message."""
    if type(msg) not in _FIELDS:
        raise CodecError(f"not a registered message type: {type(msg).__name__}")
    try:
        return msgpack.packb([VERSION, msg], use_bin_type=True, default=_to_wire)
    except TypeError as exc:  # a nested value the codec cannot carry
        raise CodecError(str(exc)) from None


def decode(data: bytes) -> Any:
    """Parse one frame; raises CodecError for anything but a valid message."""
    try:
        frame = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types; the caller needs one
        raise CodecError(f"not msgpack: {exc}") from None
    if not (isinstance(frame, list) and len(frame) == 2):
        raise CodecError("frame must be [version, message]")
    if frame[0] != VERSION or type(frame[0]) is not int:
        raise CodecError(f"codec version {frame[0]!r} is not {VERSION}")
    return _from_wire_message(frame[1], None)


def _to_wire(value: Any) -> Any:
    # msgpack's hook for what it cannot pack itself: called once per message object, and
    # msgpack (in C) packs the fields, tuples included, and calls it again for nested ones.
    names = _FIELDS.get(type(value))
    if names is None:
        raise TypeError(f"codec cannot carry {type(value).__name__}")
    return [type(value).__name__, [getattr(value, name) for name in names]]


@cache
def _field_decoders(cls: type) -> tuple[Callable[[Any], Any], ...]:
    hints = typing.get_type_hints(cls, vars(messages))
    return tuple(_decoder_for(hints[name]) for name in _FIELDS[cls])


def _from_wire_message(value: Any, expected: type | None) -> Any:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise CodecError("message must be [type name, fields]")
    name, fields = value
    cls = _BY_NAME.get(name)
    if cls is None:
        raise CodecError(f"unknown message type {name!r}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected {expected.__name__}, got {name}")
    decoders = _field_decoders(cls)
    if not isinstance(fields, list) or len(fields) != len(decoders):
        raise CodecError(f"{name} takes {len(decoders)} fields")
    return cls(*[d(v) for d, v in zip(decoders, fields, strict=False)])  # length checked


def _decoder_for(hint: Any) -> Callable[[Any], Any]:
    """Build a checker/converter for one annotation."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return _exact(type(None))
    if hint is bool:
        return _exact(bool)
    if hint is int:
        return _exact(int)
    if hint is str:
        return _exact(str)
    if hint is float:
        return _float
    if attrs.has(hint):
        return lambda v: _from_wire_message(v, hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        options = [_decoder_for(a) for a in args]
        # Fast paths, for the hot edges (a TokenBatch of 64 rids is ~1k unions): a value
        # of exactly one of the scalar types is itself; a message names its class.
        scalars = {a for a in args if a in (type(None), bool, int, str, float)}
        by_name = {a.__name__: a for a in args if attrs.has(a)}

        def union(v: Any) -> Any:
            kind = type(v)
            if kind in scalars:
                return v
            if by_name and kind is list and len(v) == 2 and type(v[0]) is str \
                    and v[0] in by_name:
                return _from_wire_message(v, by_name[v[0]])
            for option in options:
                try:
                    return option(v)
                except CodecError:
                    continue
            raise CodecError(f"{v!r:.40} matches no type in {hint}")

        return union
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] in (int, str, bool):
                return _scalars(args[0])
            item = _decoder_for(args[0])

            def homogeneous(v: Any) -> tuple[Any, ...]:
                if not isinstance(v, list):
                    raise CodecError("expected an array")
                return tuple([item(x) for x in v])

            return homogeneous
        items = [_decoder_for(a) for a in args]

        def fixed(v: Any) -> tuple[Any, ...]:
            if not isinstance(v, list) or len(v) != len(items):
                raise CodecError(f"expected an array of {len(items)}")
            return tuple([d(x) for d, x in zip(items, v, strict=False)])  # length checked

        return fixed
    raise TypeError(f"codec cannot carry {hint!r}")  # a bug in wire/messages.py, not bad input


def _exact(kind: type) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not kind:
            raise CodecError(f"expected {kind.__name__}, got {type(v).__name__}")
        return v

    return check


def _scalars(kind: type) -> Callable[[Any], Any]:
    # The hot edges carry token ids: one type test per item, no call per item.
    def check(v: Any) -> tuple[Any, ...]:
        if type(v) is not list:
            raise CodecError("expected an array")
        for x in v:
            if type(x) is not kind:
                raise CodecError(f"expected {kind.__name__}, got {type(x).__name__}")
        return tuple(v)

    return check


def _float(v: Any) -> float:
    if type(v) is float:
        return v
    if type(v) is int:  # msgpack packs 1.0 as a float, but peers may send ints
        return float(v)
    raise CodecError(f"expected float, got {type(v).__name__}")
