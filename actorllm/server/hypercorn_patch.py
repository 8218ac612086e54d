"""The one way this server replaces a method of hypercorn's (``protocol_errors``, ``timeouts``).

Both patches share a shape: find a private method of a third-party class, check that it
and what the replacement relies on exist, replace it once (a second install is a no-op),
and otherwise leave hypercorn alone, logging what the server goes without. Each has a
test that fails if a hypercorn upgrade makes it stop working.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_MARK = "_actorllm"


def replace_method(cls: type, name: str, make: Callable[[Any], Callable[..., Any]], *,
                   needs: tuple[str, ...] = (), without: str) -> bool:
    """Set ``cls.name`` to ``make(current)``; False, logging ``without``, if it cannot.

    ``needs``: further attributes of ``cls`` the replacement calls. ``without``: what
    the server lacks when the method is missing (for the warning).
    """
    current = getattr(cls, name, None)
    if getattr(current, _MARK, False):
        return True
    missing = [n for n in (name, *needs) if not hasattr(cls, n)]
    if missing:
        log.warning("%s: this hypercorn has no %s.%s", without, cls.__name__, missing[0])
        return False
    replacement = make(current)
    setattr(replacement, _MARK, True)
    setattr(cls, name, replacement)
    return True
