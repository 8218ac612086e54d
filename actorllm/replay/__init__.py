"""``actorllm replay``: read a trace, check it against the spec, summarise, draw, re-drive.

Theory of operation. A trace (spec/README.md, "Traces") is a file of JSON lines: a
header per engine run, one line per state transition of a request, and the Scheduler's
records of what it was told and what it planned. The package reads it in four passes,
one module each, all driven by the one table in spec/lifecycle.toml:

- :mod:`.tracefile` parses the file into sessions and request *incarnations* (a rid's
  transitions ordered by time, cut where the rid is reused);
- :mod:`.check` walks each incarnation through the table (``Spec.step``) and checks invariants
  2 and 6 across incarnations;
- :mod:`.summary` computes queue time, TTFT, ITL, e2e, tokens and late drops;
- :mod:`.timeline` draws one row per request (HTML with inline SVG, or PNG);
- :mod:`.redrive` feeds the recorded inputs back into the real Scheduler and compares
  its decisions with the recorded ones.

:mod:`.report` ties them together for the command line (``replay_main``).
"""

from actorllm.replay.check import Violation, check_trace
from actorllm.replay.redrive import RedriveError, RedriveReport, redrive
from actorllm.replay.report import build_report, replay_main
from actorllm.replay.summary import RequestSummary, Summary, percentile, summarize
from actorllm.replay.timeline import TimelineError, build_timeline, write_timeline
from actorllm.replay.tracefile import Trace, TraceError, load_trace, parse_trace

__all__ = [
    "RedriveError",
    "RedriveReport",
    "RequestSummary",
    "Summary",
    "TimelineError",
    "Trace",
    "TraceError",
    "Violation",
    "build_report",
    "build_timeline",
    "check_trace",
    "load_trace",
    "parse_trace",
    "percentile",
    "redrive",
    "replay_main",
    "summarize",
    "write_timeline",
]
