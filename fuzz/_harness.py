"""What every fuzz harness here shares: how it runs under atheris, and where its inputs live.

Each ``fuzz/fuzz_*.py`` defines ``TestOneInput(data: bytes) -> None`` that imports and runs
without atheris, so ``tests/test_fuzz_regressions.py`` replays the seed corpus
(``fuzz/corpus/<name>/``) and every crash regression (``fuzz/crashes/<name>/``) through it
with plain pytest. Under atheris (``python fuzz/fuzz_x.py [libFuzzer flags] DIR...``),
:func:`main` instruments everything already imported and hands ``TestOneInput`` to
libFuzzer; a crash writes the input that caused it, which then belongs in
``fuzz/crashes/<name>/`` (with the fix).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
ROOT = FUZZ_DIR.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere in a checkout
    sys.path.insert(0, str(ROOT))


def corpus_dir(name: str) -> Path:
    return FUZZ_DIR / "corpus" / name


def crashes_dir(name: str) -> Path:
    return FUZZ_DIR / "crashes" / name


def main(test_one_input: Callable[[bytes], None]) -> None:
    """Fuzz ``test_one_input`` with atheris (``pip install atheris``)."""
    import atheris

    atheris.instrument_all()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
