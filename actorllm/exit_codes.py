"""How a child process's exit code reads in an error message (children and TP ranks)."""

from __future__ import annotations

import signal


def describe_exit(code: int) -> str:
    """``1``, or ``-9 (killed by SIGKILL)``."""
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)
