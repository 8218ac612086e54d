"""Flag checks of the ``actorllm`` command that need no model: run right after parsing,
before logging is set up or anything slow is imported, so that a mistyped flag costs one
line and exit code 2 instead of a traceback after the model has loaded.

What needs the model (``--max-model-len`` against the checkpoint, a prompt's length)
stays with the engine's own checks; what argparse can say (a choice, an int) stays with
argparse. Each check names its flag.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Flags whose value must be > 0 (a count or a limit with no "off"); EngineConfig checks
# the engine's own counts (--max-num-seqs, --block-size, ...) before loading as well.
_POSITIVE = ("max_request_bytes", "max_pending", "kv_cache_memory")
# Flags whose value must be >= 0 (0 turns the limit off, or means "at once").
_NOT_NEGATIVE = ("drain_timeout", "stream_timeout", "max_stream_hold", "body_timeout",
                 "keep_alive_timeout", "max_pending_bytes_per_request", "max_pending_bytes")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _number_problems(args: argparse.Namespace) -> Iterator[str]:
    for names, ok, need in ((_POSITIVE, lambda v: v > 0, "positive"),
                            (_NOT_NEGATIVE, lambda v: v >= 0, "0 or more")):
        check: Callable[[Any], bool] = ok
        for name in names:
            value = getattr(args, name, None)
            if value is None:
                continue
            if value != value or not check(value):  # NaN fails every comparison
                yield f"{_flag(name)} must be {need}, got {value}"


def _log_level_problem(args: argparse.Namespace) -> str | None:
    level = getattr(args, "log_level", None)
    if level is None:
        return None
    names = [n for n in logging.getLevelNamesMapping() if n not in ("NOTSET", "WARN", "FATAL")]
    if str(level).upper() not in names:
        return f"--log-level must be one of {', '.join(names)} (any case), got {level!r}"
    return None


def _trace_problem(args: argparse.Namespace) -> str | None:
    trace = getattr(args, "trace", None)
    if not trace:
        return None
    path = Path(trace)
    if path.is_dir():
        return f"--trace {trace}: is a directory, not a file"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"--trace {trace}: the directory {parent} does not exist"
    if path.exists() and not os.access(path, os.W_OK):
        return f"--trace {trace}: the file is not writable"
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"--trace {trace}: cannot create a file in {parent}"
    return None


def flag_error(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` that needs no model, as one line; None if none."""
    for problem in (_log_level_problem(args), _trace_problem(args),
                    next(_number_problems(args), None)):
        if problem is not None:
            return problem
    return None
