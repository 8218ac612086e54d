"""Reading a trace file: JSON lines, split into sessions, grouped into request incarnations.

The format is written by :mod:`actorllm.lifecycle.trace` and described in spec/README.md. Three
kinds of line matter here:

- the header (``"kind": "header"``), written when an engine starts. One file may hold
  several engine runs (``LLM.generate`` opens an engine per call and appends), so every
  header starts a new :class:`Session`; rids are only unique within one;
- transition lines (they have an ``"event"``), one per state change of one rid;
- records (``"kind"`` input / plan / result, written by the Scheduler) and hop lines
  (``"kind"`` send / recv, with ``--trace-hops``).

A rid may be reused once it is RELEASED, so the transitions of one rid are cut into
*incarnations*: a ``register`` after the previous one reached a final state starts a new
one. Everything downstream (the checker, the summary, the timeline) works on these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from actorllm.lifecycle.invariants import final_state
from actorllm.lifecycle.table import Spec


class TraceError(Exception):
    """The file cannot be read as a trace at all (missing, empty, not JSON lines)."""


def _str_field(line: Line, key: str) -> str | None:
    value: str | None = line.data.get(key)
    return value


@attrs.frozen
class Line:
    """One line of the file, parsed. ``no`` is its 1-based line number."""

    no: int
    data: dict[str, Any]

    @property
    def t(self) -> float:
        return float(self.data.get("t", 0.0))

    # Keys a line may carry, each read as an attribute (None where the line has none).
    kind = property(lambda self: _str_field(self, "kind"))
    rid = property(lambda self: _str_field(self, "rid"))
    event = property(lambda self: _str_field(self, "event"))
    actor = property(lambda self: _str_field(self, "actor"))

    @property
    def is_transition(self) -> bool:
        return "event" in self.data and "kind" not in self.data


@attrs.define
class Incarnation:
    """One incarnation of one rid: its transition lines ordered by time, and a display name."""

    session: int
    rid: str
    index: int  # 1 for the first incarnation of the rid in its session
    lines: list[Line] = attrs.Factory(list)
    name: str = ""

    @property
    def events(self) -> list[str]:
        return [str(line.event) for line in self.lines]

    @property
    def first_no(self) -> int:
        return min(line.no for line in self.lines)

    @property
    def is_parent(self) -> bool:
        """A ``n > 1`` request: it fans out instead of being dispatched."""
        return "fan_out" in self.events

    @property
    def children(self) -> list[str]:
        """The child rids named by the fan_out line (``{rid}-{i}``)."""
        for line in self.lines:
            if line.event == "fan_out":
                return [str(c) for c in line.data.get("children", [])]
        return []


@attrs.define
class Session:
    """Everything one engine run wrote: its header and the lines after it, in file order."""

    index: int
    header: dict[str, Any] | None
    lines: list[Line] = attrs.Factory(list)
    incarnations: list[Incarnation] = attrs.Factory(list)

    @property
    def config(self) -> dict[str, Any]:
        return dict((self.header or {}).get("config") or {})

    @property
    def t0(self) -> float | None:
        if self.header is not None and "t0" in self.header:
            return float(self.header["t0"])
        return self.lines[0].t if self.lines else None

    def records(self, *kinds: str) -> Iterator[Line]:
        """Record lines of the given kinds, in file order."""
        return (line for line in self.lines if line.kind in kinds)

    def incarnation_at(self, rid: str, no: int) -> Incarnation | None:
        """The incarnation of ``rid`` that a line at file line ``no`` belongs to (the latest one
        that began at or before it; the first one for anything earlier)."""
        found = None
        for incarnation in self.incarnations:
            if incarnation.rid != rid:
                continue
            if found is None or incarnation.first_no <= no:
                found = incarnation
        return found


@attrs.define
class Trace:
    """A parsed trace file."""

    path: str
    sessions: list[Session]
    problems: list[tuple[int, str]]  # (line number, what is wrong) for unreadable lines

    @property
    def incarnations(self) -> list[Incarnation]:
        return [incarnation for s in self.sessions for incarnation in s.incarnations]

    @property
    def num_lines(self) -> int:
        return sum(len(s.lines) + (s.header is not None) for s in self.sessions)


def load_trace(path: str | os.PathLike[str], spec: Spec) -> Trace:
    """Read ``path``. Raises TraceError if it is not a trace at all."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TraceError(f"cannot read {os.fspath(path)}: {exc.strerror}") from None
    return parse_trace(text.splitlines(), spec, path=os.fspath(path))


def parse_trace(lines: Iterable[str], spec: Spec, path: str = "<trace>") -> Trace:
    """Parse JSON lines into sessions and incarnations. A bad line is a problem, not an error:
    the rest of the file is still worth checking."""
    sessions: list[Session] = []
    problems: list[tuple[int, str]] = []
    current: Session | None = None
    for no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.append((no, f"not JSON ({exc.msg})"))
            continue
        if not isinstance(data, dict):
            problems.append((no, "not a JSON object"))
            continue
        if data.get("kind") == "header":
            current = Session(len(sessions), data)
            sessions.append(current)
            continue
        if current is None:  # lines before any header: a headerless session
            current = Session(len(sessions), None)
            sessions.append(current)
        line = Line(no, data)
        if line.is_transition and not isinstance(line.rid, str):
            problems.append((no, "transition line without a rid"))
            continue
        current.lines.append(line)
    if not sessions or not any(s.lines or s.header for s in sessions):
        if problems:
            raise TraceError(f"{path}: no trace lines (line {problems[0][0]}: {problems[0][1]})")
        raise TraceError(f"{path}: empty trace")
    for session in sessions:
        session.incarnations = _split_incarnations(session, spec)
    _name_incarnations(sessions)
    return Trace(path, sessions, problems)


def _split_incarnations(session: Session, spec: Spec) -> list[Incarnation]:
    """Group transitions by rid, order by time (file order breaks ties: one process writes
    its lines in order, several processes merge by their shared monotonic clock), and cut
    each rid's history where a ``register`` follows a final state."""
    by_rid: dict[str, list[Line]] = {}
    for line in session.lines:
        if line.is_transition:
            by_rid.setdefault(str(line.rid), []).append(line)
    incarnations: list[Incarnation] = []
    for rid, lines in by_rid.items():
        lines.sort(key=lambda x: (x.t, x.no))
        inc = Incarnation(session.index, rid, 1)
        for line in lines:
            # A new one begins where the last one ended legally in a final state (after an
            # illegal event the state is unknown, so the rest stays in that one).
            if line.event == "register" and final_state(spec, inc.events) in spec.final_states:
                incarnations.append(inc)
                inc = Incarnation(session.index, rid, inc.index + 1)
            inc.lines.append(line)
        incarnations.append(inc)
    incarnations.sort(key=lambda x: x.first_no)
    return incarnations


def _name_incarnations(sessions: list[Session]) -> None:
    """Display names: the rid, with ``#incarnation`` when reused and ``session:`` when the file
    holds several runs."""
    many = len(sessions) > 1
    for session in sessions:
        for inc in session.incarnations:
            name = inc.rid if inc.index == 1 else f"{inc.rid}#{inc.index}"
            inc.name = f"{session.index}:{name}" if many else name
