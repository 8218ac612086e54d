"""What a Worker takes of a shared host's CPUs (actorllm/cpus.py, issue 33): the OpenMP
spin every process gets, the cgroup quota, and the team cut to what others leave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actorllm import cpus
from actorllm.cpus import CpuShare, cpu_quota, usable_cpus, worker_share
from actorllm.ops.threads import (
    DRAFT_STEP_TOKENS,
    LARGE_STEP_TOKENS,
    PREFILL_STEP_TOKENS,
    SMALL_STEP_TOKENS,
    StepThreads,
)

USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", cpus.ADAPT_ENV)

# A user's program: the library entry (`from actorllm import LLM`), then an engine whose
# Worker has a process of its own; prints what that process was started with.
ENGINE_CHILD_ENV = """
import json, os, sys
from actorllm import LLM
import trio
from actorllm.engine.async_engine import open_engine

async def main():
    llm = LLM(model=sys.argv[1], topology="engine", num_kv_blocks=32)
    async with open_engine(llm.config, resources=llm.resources) as engine:
        pid = engine.supervisor.pids()["engine"]
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        print(json.dumps({k: env.get(k) for k in KNOBS}))

KNOBS = sys.argv[2].split(",")
trio.run(main)
"""


@pytest.mark.parametrize("given,want", [
    ({}, {"GOMP_SPINCOUNT": "10000"}),
    ({"GOMP_SPINCOUNT": "0", cpus.ADAPT_ENV: "0"}, {"GOMP_SPINCOUNT": "0", cpus.ADAPT_ENV: "0"}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_the_engine_child_of_a_library_user_gets_the_spin_unless_the_user_chose(
        tmp_path: Path, tiny_llama_dir: Path, given: dict[str, str],
        want: dict[str, str]) -> None:
    """``LLM`` (no CLI in sight) sets the short spin before torch loads, and the engine's
    child process starts with it; a spin, a wait policy or the adapt switch the user set
    reaches the child unchanged, and nothing else is added."""
    script = tmp_path / "user.py"
    script.write_text(ENGINE_CHILD_ENV)
    env = {k: v for k, v in os.environ.items() if k not in USER_KNOBS}
    env.update(given)
    out = subprocess.run([sys.executable, str(script), str(tiny_llama_dir),
                          ",".join(USER_KNOBS)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {k: want.get(k) for k in USER_KNOBS}


@pytest.mark.parametrize("module", ["actorllm.worker.runner", "actorllm.topology.child",
                                    "actorllm.worker.rank_process"])
def test_every_entry_module_sets_the_spin_before_torch_loads(module: str) -> None:
    """``LLM``'s Worker, the child (``python -m actorllm.topology``) and a rank (``actorllm
    rank``) load torch through these modules; the package's ``__init__`` runs first and
    sets the spin before that import (libgomp reads it once, when it loads)."""
    code = ("import builtins, os, sys\n"
            "real = builtins.__import__\n"
            "seen = []\n"
            "def spy(name, *a, **k):\n"
            "    if name == 'torch' and not seen:\n"
            "        seen.append(os.environ.get('GOMP_SPINCOUNT'))\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = spy\n"
            f"import {module}\n"
            "import torch  # where the module itself loads it later\n"
            "print(seen)\n")
    env = {k: v for k, v in os.environ.items() if k not in USER_KNOBS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['10000']"]


def test_cgroup_quota_v2_v1_and_none(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(v1) == 0.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1) is None
    assert cpu_quota(tmp_path / "none") is None


def test_usable_cpus_is_the_affinity_cut_to_the_quota() -> None:
    eight = frozenset(range(8))
    assert usable_cpus(quota=1.5, cpus=eight) == 2
    assert usable_cpus(quota=0.2, cpus=eight) == 1
    assert usable_cpus(quota=32.0, cpus=eight) == 8
    assert usable_cpus(quota=0, cpus=frozenset({3})) == 1


class Host:
    """A fake host: ticks every CPU was busy, by this process (and its parent) or others."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0
        self.own: dict[int, int] = {1: 0, 2: 0}

    def advance(self, seconds: float, *, ours: float, parent: float = 0.0,
                others: float = 0.0) -> None:
        """``seconds`` pass with ``ours``, ``parent`` and ``others`` cores busy (100 Hz)."""
        ticks = round(seconds * 100)
        self.now += seconds
        self.own[1] += round(ticks * ours)
        self.own[2] += round(ticks * parent)
        self.busy += round(ticks * (ours + parent + others))

    def share(self, cpus: int = 2) -> CpuShare:
        return CpuShare(frozenset(range(cpus)), ours=(1, 2), interval=0.5,
                        clock=lambda: self.now, busy=lambda _c: self.busy,
                        own=lambda pid: self.own[pid], hz=100.0)


def test_cpu_share_counts_what_other_processes_take() -> None:
    host = Host()
    share = host.share()
    assert share.taken() == 0  # nothing measured yet
    host.advance(1.0, ours=2.0)  # this process alone, on both cores
    assert share.taken() == 0
    host.advance(1.0, ours=1.3, others=0.7)  # a busy neighbour pushed in
    assert share.taken() == 1
    host.advance(0.2, ours=1.0, others=0.0)
    assert share.taken() == 1  # not re-measured within the interval
    host.advance(1.0, ours=1.0, others=1.0)  # team cut to one: the neighbour has a core
    assert share.taken() == 1
    host.advance(1.0, ours=1.0, others=0.0)  # it left
    assert share.taken() == 0
    host.advance(1.0, ours=0.4, parent=1.6)  # the HTTP process (the parent) is ours
    assert share.taken() == 0
    host.advance(1.0, ours=0.1, others=0.3)  # light neighbours do not count
    assert share.taken() == 0
    host.advance(1.0, ours=1.0, others=5.0)  # never more than there are
    assert share.taken() == 2


def test_a_team_is_cut_only_while_others_take_cpus() -> None:
    host = Host()
    share = host.share(cpus=4)
    host.advance(1.0, ours=3.0)
    assert [share.cap(n) for n in (1, 2, 4, 8)] == [1, 2, 4, 8]  # quiet: as configured
    host.advance(1.0, ours=2.0, others=1.0)
    assert [share.cap(n) for n in (1, 2, 4, 8)] == [1, 2, 3, 3]
    host.advance(1.0, ours=1.0, others=4.0)
    assert [share.cap(n) for n in (1, 2, 4, 8)] == [1, 1, 1, 1]


def test_the_step_team_is_cut_by_the_share() -> None:
    class Fixed:
        def __init__(self, free: int) -> None:
            self.free = free

        def cap(self, wanted: int) -> int:
            return min(wanted, self.free)

    share = Fixed(1)
    threads = StepThreads("cpu", full=2, large=4, share=share)
    assert [threads.for_tokens(t) for t in (8, 64, LARGE_STEP_TOKENS)] == [1, 1, 1]
    share.free = 3
    assert [threads.for_tokens(t) for t in (8, 64, LARGE_STEP_TOKENS)] == [1, 2, 3]
    share.free = 8
    assert [threads.for_tokens(t) for t in (8, 64, LARGE_STEP_TOKENS)] == [1, 2, 4]
    assert StepThreads("cuda", full=2, share=share).share is None


def test_a_step_that_prefills_takes_the_large_team_however_few_its_tokens() -> None:
    """Tokens past one per row are prefill (or drafts): compute for the team, with little
    output for the event loop; a decode step of as many tokens keeps the ordinary team."""
    threads = StepThreads("cpu", full=1, large=2)
    p = PREFILL_STEP_TOKENS
    assert p + 8 < LARGE_STEP_TOKENS
    assert threads.for_tokens(p + 8, rows=8) == 2  # 8 decode rows beside a chunk of p
    assert threads.for_tokens(p + 7, rows=8) == 1  # one token short
    assert threads.for_tokens(p + 8, rows=p + 8) == 1  # as many decode rows
    assert threads.for_tokens(p + 8) == 1  # rows not given: counted as decode rows
    assert threads.for_tokens(LARGE_STEP_TOKENS, rows=LARGE_STEP_TOKENS) == 2


def test_a_verify_step_of_one_row_takes_the_whole_team() -> None:
    """A small step carrying drafts (tokens past one per row) is compute, not the loop's
    wake-up cost: the ordinary team, not one thread; a small decode step keeps one."""
    threads = StepThreads("cpu", full=2, large=2)
    d = DRAFT_STEP_TOKENS
    assert 1 + d < SMALL_STEP_TOKENS
    assert threads.for_tokens(1 + d, rows=1) == 2  # one row and its d drafts
    assert threads.for_tokens(d, rows=1) == 1  # one draft fewer
    assert threads.for_tokens(1 + d, rows=1 + d) == 1  # as many decode rows
    assert threads.for_tokens(SMALL_STEP_TOKENS, rows=SMALL_STEP_TOKENS) == 2


def test_the_adapt_switch_turns_the_measure_off() -> None:
    assert isinstance(worker_share({}), CpuShare)
    for off in ("0", "false", "OFF", "no"):
        assert worker_share({cpus.ADAPT_ENV: off}) is None
    assert isinstance(worker_share({cpus.ADAPT_ENV: "1"}), CpuShare)


def test_a_cpu_worker_measures_its_share(tiny_llama_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The ModelRunner's step thread reads a CpuShare unless the user turned it off."""
    from actorllm.worker.runner import ModelRunner

    runner = ModelRunner(tiny_llama_dir, num_blocks=8, num_threads=2)
    assert isinstance(runner.threads.share, CpuShare)
    monkeypatch.setenv(cpus.ADAPT_ENV, "0")
    runner = ModelRunner(tiny_llama_dir, num_blocks=8, num_threads=2)
    assert runner.threads.share is None
