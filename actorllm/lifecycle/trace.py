"""Trace files: one JSON object per line for every transition (and, optionally, hop).

The format is in ``spec/lifecycle.toml`` ([trace]) and spec/README.md. Times are
``time.monotonic()``, which every process on a Linux machine shares, so the files
of several processes merge by time. With tracing off, actors hold ``None`` instead
of a Tracer and pay one ``is not None`` test per transition.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

import attrs


def _rids(msg: Any) -> list[str]:
    """The rids a message concerns, for hop lines (best effort, no deep walk)."""
    rid = getattr(msg, "rid", None)
    if isinstance(rid, str):
        return [rid]
    rids = getattr(msg, "rids", None)  # a columnar step message (plan, token or output batch)
    if rids:
        return list(rids)
    for field in ("tokens", "finished"):
        items = getattr(msg, field, None)
        if items:
            return [x.rid for x in items]
    return []


class Tracer:
    """Appends trace lines to one file; safe to share by actors of one process."""

    def __init__(self, path: str | os.PathLike[str], *, hops: bool = False) -> None:
        self.path = os.fspath(path)
        self.hops = hops
        # O_APPEND: lines from several processes interleave whole, never torn.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def header(self, model: str, config: dict[str, Any], spec_version: int) -> None:
        """Write the header line (once, by the process that created the file)."""
        self._write({"kind": "header", "spec_version": spec_version, "model": model,
                     "config": config, "t0": time.monotonic(), "pid": os.getpid()})

    def transition(self, actor: str, rid: str, event: str, before: str, after: str,
                   details: dict[str, object] | None = None) -> None:
        line: dict[str, Any] = {"t": time.monotonic(), "actor": actor, "rid": rid,
                                "event": event, "from": before, "to": after}
        if details:
            line.update(details)
        self._write(line)

    def hop(self, actor: str, mailbox: str, kind: str, msg: Any) -> None:
        if self.hops:
            self._write({"t": time.monotonic(), "kind": kind, "actor": actor, "mailbox": mailbox,
                         "message": type(msg).__name__, "rids": _rids(msg)})

    def record(self, kind: str, **fields: Any) -> None:
        """A non-transition fact the replay tool uses (late drops, step timings, inputs)."""
        self._write({"t": time.monotonic(), "kind": kind, **fields})

    def _write(self, obj: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(obj, default=_jsonable) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _jsonable(obj: Any) -> Any:
    if attrs.has(type(obj)):
        return attrs.asdict(obj)
    if isinstance(obj, Iterable):
        return list(obj)
    return str(obj)
