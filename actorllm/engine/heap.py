"""What start-up built, kept out of the cyclic garbage collector's way while serving.

Loading leaves a large heap of long-lived containers (the model's modules, the
tokenizer, transformers, the app's routes and schemas: ~400,000 tracked objects for
the embedded model). A full collection walks all of it, and a busy engine's small
per-token objects trigger one every second or so: ~175 ms each, measured during an
offline ``generate`` of 256 sequences (13 % of that run), and 13 % of the loop's time
in a py-spy profile of ``single`` at saturation. Frozen, a collection walks only what
the engine made since.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def settle_heap() -> None:
    """Collect once and freeze what is left, for good (a server, after start-up)."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap for a block and thaw it after (``LLM.generate``): a library call
    must not keep the caller's objects from ever being collected. Nothing is thawed that
    was frozen before the block (by ``settle_heap`` or the caller)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
