"""Replay every fuzz seed and every crash the fuzzers found through the harnesses, with plain
pytest (no atheris needed): a fixed crash stays fixed, and the harnesses keep running.

Each ``fuzz/fuzz_<name>.py`` exposes ``TestOneInput``; its inputs live in
``fuzz/corpus/<name>/`` (seeds) and ``fuzz/crashes/<name>/`` (regressions).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
HARNESSES = ("codec", "lifecycle", "request", "detokenizer")

# Crash inputs whose bug is not fixed yet: name -> what is wrong. Fix it, then delete the
# entry (a strict xfail that starts passing fails the run, as a reminder).
KNOWN_CRASHES: dict[str, str] = {}


def _harness(name: str) -> Callable[[bytes], None]:
    if str(FUZZ) not in sys.path:
        sys.path.insert(0, str(FUZZ))
    return importlib.import_module(f"fuzz_{name}").TestOneInput  # type: ignore[no-any-return]


def _inputs() -> list[object]:
    cases: list[object] = []
    for name in HARNESSES:
        for kind in ("corpus", "crashes"):
            folder = FUZZ / kind / name
            for path in sorted(folder.iterdir()) if folder.is_dir() else ():
                key = f"{name}/{path.name}"
                marks = ([pytest.mark.xfail(reason=KNOWN_CRASHES[key], strict=True)]
                         if key in KNOWN_CRASHES else [])
                cases.append(pytest.param(name, path, id=f"{kind}/{key}", marks=marks))
    return cases


def test_every_harness_has_seeds() -> None:
    for name in HARNESSES:
        assert (FUZZ / f"fuzz_{name}.py").is_file()
        assert any((FUZZ / "corpus" / name).iterdir()), f"no seeds for {name}"
    assert set(k.split("/")[0] for k in KNOWN_CRASHES) <= set(HARNESSES)


@pytest.mark.parametrize(("name", "path"), _inputs())
def test_input_replays_cleanly(name: str, path: Path) -> None:
    _harness(name)(path.read_bytes())
