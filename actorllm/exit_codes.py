"""How the command line leaves on a user's error (one line, exit 2), and how a child
process's exit code reads in an error message (children and TP ranks)."""

from __future__ import annotations

import signal
import sys

EXIT_USAGE = 2  # a user's error: bad flags, a model that cannot load, a bad trace file


def say_error(problem: object) -> None:
    """The command line's one error line, on stderr (``run``, ``serve``, ``replay``,
    ``rank``): ``actorllm: error: <problem>``."""
    sys.stderr.write(f"actorllm: error: {problem}\n")
    sys.stderr.flush()


def describe_exit(code: int) -> str:
    """``1``, or ``-9 (killed by SIGKILL)``."""
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)
