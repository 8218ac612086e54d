"""Model checking spec/lifecycle.pml with SPIN: the protocol holds, each planted bug is found,
and the model moves only as the table of spec/lifecycle.toml allows.

Each check is what spec/README.md ("Model checking") tells a person to run: ``spin -a``
writes the verifier ``pan.c``, gcc compiles it, ``pan`` explores every interleaving. The
correct model must give "errors: 0" on a complete search (assertions, invalid end states,
and each LTL formula); with one ``-DBUG_...`` defined, pan must report the violation of
the property that bug breaks. With -DCHECK_TABLE the model also asserts, at each event, that
spec/lifecycle_table.pml (generated from the TOML; tests/test_lifecycle.py checks it is
current) has a row for the move. Skipped only where spin or a C compiler is missing
(CI installs spin: ``apt-get install -y spin``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from actorllm.lifecycle.table import parse_spec

ROOT = Path(__file__).parents[1]
MODEL = ROOT / "spec" / "lifecycle.pml"
TABLE = ROOT / "spec" / "lifecycle_table.pml"
SPIN = shutil.which("spin")
CC = shutil.which("gcc") or shutil.which("cc")

pytestmark = pytest.mark.skipif(
    SPIN is None or CC is None, reason="needs spin (apt-get install -y spin) and gcc")

DEPTH = "-m200000"  # deeper than any path of the model: a truncated search is a failure
SAFETY = ["-DSAFETY", "-DNOCLAIM"]  # assertions and end states; no LTL claim compiled in
CHECK_TABLE = "-DCHECK_TABLE"  # every event the model fires is a move of the TOML table
LTL_FORMULAS = ("invariants", "drains")


def end_flags(defines: list[str]) -> list[str]:
    """pan's flags for a scenario: with -DDEATH the engine's processes halt wherever the
    death finds them (mid-send, by design), so pan's invalid-end-state check is off (-E);
    the Drain process still asserts what must hold of the Frontend and the clients."""
    return ["-E"] if "-DDEATH" in defines else []


def build(workdir: Path, defines: list[str], cflags: list[str], table: str | None = None
          ) -> Path:
    """``spin -a`` and gcc, in ``workdir``; returns the verifier. ``table``: the generated
    table to include instead of spec/lifecycle_table.pml."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL, workdir / MODEL.name)
    (workdir / TABLE.name).write_text(TABLE.read_text() if table is None else table)
    assert SPIN is not None and CC is not None
    _run([SPIN, "-a", *defines, MODEL.name], workdir)
    # -O0: gcc takes seconds at -O2 on pan.c and saves less than that on these searches.
    _run([CC, "-O0", "-w", *cflags, "-DMEMLIM=2048", "-o", "pan", "pan.c"], workdir)
    return workdir / "pan"


def verify(pan: Path, *args: str) -> str:
    """Run the verifier; returns what it printed."""
    done = subprocess.run([str(pan), DEPTH, *args], cwd=pan.parent, capture_output=True,
                          text=True, timeout=600)
    return done.stdout + done.stderr


def errors(out: str) -> int:
    found = re.search(r"errors: (\d+)", out)
    assert found, f"pan printed no verdict:\n{out}"
    return int(found.group(1))


def assert_holds(out: str, pan: Path, defines: list[str]) -> None:
    """errors: 0 on a complete search; otherwise show the counterexample."""
    complete = ("Search not completed" not in out and "max search depth too small" not in out
                and "out of memory" not in out)
    if errors(out) == 0 and complete:
        return
    trail = ""
    if (pan.parent / f"{MODEL.name}.trail").exists():
        assert SPIN is not None
        trail = _run([SPIN, "-t", "-p", *defines, MODEL.name], pan.parent, check=False)
    pytest.fail(f"spin: the model fails{' (incomplete search)' if not complete else ''}:\n"
                f"{out}\n--- counterexample (tail) ---\n{trail[-6000:]}")


def _run(cmd: list[str], cwd: Path, check: bool = True) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


# --- the correct model -------------------------------------------------------------------


@pytest.mark.parametrize("scenario", [[], ["-DREUSE_A"], ["-DONE_STEP"], ["-DDEATH"],
                                      ["-DREUSE_A", "-DDEATH"]],
                         ids=["fan-out", "rid-reuse", "one-step-in-flight", "engine-death",
                              "rid-reuse-engine-death"])
def test_model_holds(tmp_path: Path, scenario: list[str]) -> None:
    """Every assertion, no deadlock, the drain check in every final state, and every event
    a move of the table. With -DDEATH, at any moment the engine may die: every live
    request is then lost (the table's ``lose``) and answered once, nothing stays registered,
    and the parent is gathered."""
    pan = build(tmp_path, [CHECK_TABLE, *scenario], SAFETY)
    out = verify(pan, *end_flags(scenario))
    assert_holds(out, pan, [CHECK_TABLE, *scenario])
    if "-DDEATH" not in scenario:
        assert "invalid end states\t+" in out  # end states were checked too


def test_model_disagreeing_with_its_table_is_found(tmp_path: Path) -> None:
    """The table check can fail: a table without PREEMPTED -> RUNNING (the model does
    reschedule preempted leaves) makes the model's own moves illegal."""
    text = (ROOT / "spec" / "lifecycle.toml").read_text()
    narrow = text.replace('from = ["WAITING", "PREEMPTED"]\nto = "RUNNING"',
                          'from = ["WAITING"]\nto = "RUNNING"')
    assert narrow != text
    pan = build(tmp_path, [CHECK_TABLE], SAFETY, table=parse_spec(narrow).promela())
    out = verify(pan)
    assert errors(out) >= 1 and "assertion violated" in out, out
    assert SPIN is not None
    trail = _run([SPIN, "-t", "-p", CHECK_TABLE, MODEL.name], tmp_path, check=False)
    assert "assertion violated" in trail


@pytest.fixture(scope="module")
def ltl_pan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("spin-ltl"), [], [])


@pytest.mark.parametrize("formula", LTL_FORMULAS)
def test_ltl_formula_holds(ltl_pan: Path, formula: str) -> None:
    """Each formula, with acceptance cycles searched: ``drains`` is liveness (the model has
    no infinite behaviour, so it needs no fairness assumption)."""
    out = verify(ltl_pan, "-a", "-N", formula)
    assert f"ltl formula {formula}" in out
    assert_holds(out, ltl_pan, [])


def test_model_names_every_planted_bug() -> None:
    """The lists below and the model agree: no bug goes untested."""
    planted = set(re.findall(r"(?:#if(?:n?def|\s+defined\()|!defined\()\s*\(?(BUG_\w+)",
                             MODEL.read_text()))
    assert planted == {bug for bug, _, _ in BUGS} | {bug for bug, _ in LTL_BUGS}


# --- planted bugs ------------------------------------------------------------------------

# (define, scenario, a fragment of the assertion pan must report as violated)
BUGS = [
    ("BUG_FREE_BEFORE_FENCE", [], "(fm0|fm1)"),  # invariant 3
    ("BUG_FENCE_ONE_STEP", [], "(fm0|fm1)"),  # invariant 3, two steps in flight
    ("BUG_ABORT_BYPASS", ["-DREUSE_A"], "arrived[a]>=x"),  # the FIFO edge
    ("BUG_ABORT_BEFORE_DISPATCH", [], "arrived[a]>=x"),
    ("BUG_LATE_RESULT_COMMIT", [], "term[i]==0"),  # invariants 2 and 5
    ("BUG_FORGET_BEFORE_FREE", [], "released[1]&&released[2]"),  # invariant 6 / rid reuse
    ("BUG_GATHER_EARLY", [], "released[1]&&released[2]"),  # invariant 6
    ("BUG_REGISTER_AFTER_DISPATCH", ["-DREUSE_A"], "reg[r]"),  # invariant 1
    ("BUG_LAZY_CHILD_REGISTER", [], "released[1]&&released[2]"),  # invariant 6
    # the engine dies while a sibling waits for room; the lost child is sent anyway: a
    # dispatch the table has no row for (from RELEASED)
    ("BUG_SEND_LOST_CHILD", ["-DDEATH", CHECK_TABLE], "violated0("),
]


@pytest.mark.parametrize(("bug", "scenario", "violated"), BUGS, ids=[b[0] for b in BUGS])
def test_planted_bug_is_found(tmp_path: Path, bug: str, scenario: list[str],
                              violated: str) -> None:
    defines = [f"-D{bug}", *scenario]
    pan = build(tmp_path, defines, SAFETY)
    out = verify(pan, *end_flags(defines))
    assert errors(out) >= 1, f"spin found nothing with {bug}:\n{out}"
    assert "assertion violated" in out and violated in out.replace(" ", ""), out
    # The counterexample replays.
    assert SPIN is not None
    trail = _run([SPIN, "-t", "-p", *defines, MODEL.name], tmp_path, check=False)
    assert "assertion violated" in trail


def test_fence_bug_needs_two_steps_in_flight(tmp_path: Path) -> None:
    """BUG_FENCE_ONE_STEP frees a leaf when the first step that plans it returns: harmless
    with one step in flight, so the one-step model must not report it. (That the two-step
    model does is test_planted_bug_is_found.)"""
    pan = build(tmp_path, ["-DBUG_FENCE_ONE_STEP", "-DONE_STEP"], SAFETY)
    assert_holds(verify(pan), pan, ["-DBUG_FENCE_ONE_STEP", "-DONE_STEP"])


# (define, the formula it breaks): each is caught by that formula, not by an assertion. A
# safety formula's never claim is an assertion of its own (``!(!(...))`` in pan's report);
# a liveness one fails with an acceptance cycle.
LTL_BUGS = [
    ("BUG_TWO_ENDS", "invariants"),  # a late abort or stop ends a leaf a second time
    ("BUG_SPIN_AHEAD", "drains"),  # the planner retries an empty plan forever: never idle
]


@pytest.mark.parametrize(("bug", "formula"), LTL_BUGS, ids=[b for b, _ in LTL_BUGS])
def test_ltl_formula_finds_its_planted_bug(tmp_path: Path, bug: str, formula: str) -> None:
    pan = build(tmp_path, [f"-D{bug}"], [])
    out = verify(pan, "-a", "-N", formula)
    assert errors(out) >= 1, f"spin found nothing with {bug}:\n{out}"
    if formula == "drains":
        assert "acceptance cycle" in out, out
    else:  # the claim's own assertion, not one of the model's
        assert "assertion violated  !( !(" in out and "term[1]<=1" in out, out
    assert SPIN is not None
    trail = _run([SPIN, "-t", "-p", f"-D{bug}", MODEL.name], tmp_path, check=False)
    # The counterexample replays: the cycle (drains), or the claim failing (invariants).
    assert ("START OF CYCLE" if formula == "drains" else "assertion violated") in trail, trail
