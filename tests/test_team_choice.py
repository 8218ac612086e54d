"""The decode step's team chosen from measured costs (actorllm/ops/team.py): the rules,
driven with made-up costs (no clock), and an engine that uses them."""

from __future__ import annotations

from pathlib import Path

import torch

from actorllm import LLM, SamplingParams
from actorllm.ops import team
from actorllm.ops.team import TeamChooser, explore_interval, pick_team
from actorllm.ops.threads import LARGE_STEP_TOKENS, SMALL_STEP_TOKENS, StepThreads


def test_the_cheaper_team_wins_and_a_tie_goes_to_the_smaller() -> None:
    assert pick_team({1: 10.0, 2: 8.0}) == 2
    assert pick_team({1: 8.0, 2: 10.0}) == 1
    assert pick_team({1: 9.0, 2: 9.0}) == 1


def test_the_dearer_team_is_tried_the_rarer_the_dearer_it_was() -> None:
    assert explore_interval(10.0, 10.5) == team.MIN_EXPLORE_EVERY  # 5 %: the floor
    assert explore_interval(10.0, 12.0) == 20  # 20 % dearer: once in 20 steps
    assert explore_interval(10.0, 100.0) == team.MAX_EXPLORE_EVERY
    assert explore_interval(10.0, 9.0) == team.MIN_EXPLORE_EVERY


def run(chooser: TeamChooser, cost: dict[int, float], steps: int, rows: int = 256
        ) -> list[int]:
    """``steps`` steps, each costing ``cost[size]`` seconds per row on the size chosen."""
    sizes = []
    for _ in range(steps):
        size = chooser.choose(rows)
        chooser.record(size, cost[size] * rows, rows)
        sizes.append(size)
    return sizes


def test_the_chooser_measures_both_then_keeps_the_cheaper() -> None:
    chooser = TeamChooser((1, 2))
    sizes = run(chooser, {1: 10e-6, 2: 15e-6}, 2 * team.MIN_SAMPLES)
    assert sorted(sizes) == [1] * team.MIN_SAMPLES + [2] * team.MIN_SAMPLES
    later = run(chooser, {1: 10e-6, 2: 15e-6}, 200)
    assert later.count(2) == 200 // explore_interval(10.0, 15.0)  # 50 % dearer: 1 in 50
    chooser = TeamChooser((1, 2))
    later = run(chooser, {1: 15e-6, 2: 10e-6}, 200)
    assert later.count(2) > 190


def test_the_chooser_follows_a_change_in_the_costs() -> None:
    """A neighbour that starts (or a batch that grows) changes which team is cheaper: the
    occasional step on the other team sees it and the choice moves."""
    chooser = TeamChooser((1, 2))
    run(chooser, {1: 15e-6, 2: 10e-6}, 100)
    later = run(chooser, {1: 10e-6, 2: 20e-6}, 200)
    assert later[-50:].count(1) >= 45


def test_costs_are_compared_only_between_steps_of_about_as_many_rows() -> None:
    """A run's tail, its batch draining, costs more per row on whichever size runs it (the
    loop's turn and the op's fixed costs shared by fewer rows). The next run, back at 256
    rows, must start from the 256-row costs, not from the tail's: mixed, they made it run
    the dearer size for most of its steps."""
    chooser = TeamChooser((1, 2))
    steady = {1: 10e-6, 2: 15e-6}
    run(chooser, steady, 100)
    for rows in (240, 100, 40):  # the tail: 4x the steady cost per row
        size = chooser.choose(rows)
        chooser.record(size, 4 * steady[size] * rows, rows)
    assert chooser.medians(256) == {1: 10e-6, 2: 15e-6}
    later = run(chooser, steady, 100)
    assert later.count(2) <= 100 // explore_interval(10.0, 15.0) + 1
    assert chooser.medians(40)[1] > chooser.medians(256)[1]  # the tail's own class


def test_a_cycle_into_the_next_engine_is_not_a_cost() -> None:
    """The last chosen step of a run is costed at the next step's start; once its engine
    is gone (``end_run``, from ``ModelRunner.drop_all``) that start is another run's."""
    threads = StepThreads("cpu", full=2, large=2, choose=True)
    assert threads.chooser is not None
    threads.use_for(256, 256, 0.0)
    threads.end_run()
    threads.use_for(256, 256, 0.5)  # (under MAX_CYCLE_S: it would count)
    assert sum(threads.chooser.measured.values()) == 0
    threads.use_for(256, 256, 0.501)
    assert sum(threads.chooser.measured.values()) == 1


def test_an_idle_gap_is_not_a_cost() -> None:
    chooser = TeamChooser((1, 2))
    chooser.record(1, team.MAX_CYCLE_S * 2, 256)
    chooser.record(2, 0.0, 256)
    chooser.record(2, 1e-3, 0)
    assert chooser.medians(256) == {}


def test_step_threads_choose_only_a_decode_step_of_many_rows() -> None:
    """A small step stays on one thread and a prefill-sized one on the large team; the
    cost of a chosen step is the time to the next step's start, given by the caller."""
    threads = StepThreads("cpu", full=2, large=2, choose=True)
    assert threads.chooser is not None
    assert not threads.chosen(SMALL_STEP_TOKENS - 1)
    assert threads.chosen(SMALL_STEP_TOKENS)
    assert not threads.chosen(LARGE_STEP_TOKENS)
    assert not threads.chosen(SMALL_STEP_TOKENS + 8, rows=SMALL_STEP_TOKENS)  # drafts
    clock = 0.0
    for _ in range(40):  # one thread costs 1 ms a step, two threads 2 ms
        threads.use_for(256, 256, clock)
        clock += 1e-3 * (threads.current or 1)
        threads.use_for(8, 8, clock)  # a small step between: not a chosen one
        clock += 1e-3
    assert threads.chooser.medians(256)[1] < threads.chooser.medians(256)[2]
    assert threads.chooser.measured[1] > threads.chooser.measured[2]
    assert StepThreads("cpu", full=2).chooser is None  # only where asked for
    assert StepThreads("cpu", full=1, large=2, choose=True).chooser is None  # no choice
    assert StepThreads("cuda", full=2, choose=True).chooser is None


class FixedShare:
    """Other processes leave ``free`` CPUs (``actorllm.cpus.CpuShare`` measures it)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def cap(self, wanted: int) -> int:
        return max(1, min(wanted, self.free))


def test_the_helper_joins_only_a_chosen_step_on_one_thread_with_a_core_free() -> None:
    """The op's helper (kernels/cpu_step_helper.h) may share a chosen decode step's
    attention, head and draw when that step runs on one thread, the team could be bigger
    and no other process takes the other core; never a small, prefill-sized or
    two-thread step."""
    threads = StepThreads("cpu", full=2, large=2, choose=True)
    assert threads.chooser is not None
    threads.chooser.choose = lambda rows: 1  # type: ignore[method-assign]
    threads.use_for(256, 256, 0.0)
    assert threads.current == 1 and threads.helper
    threads.use_for(8, 8, 1.0)
    assert threads.current == 1 and not threads.helper  # small: not a chosen step
    threads.use_for(LARGE_STEP_TOKENS, 4, 2.0)
    assert threads.current == 2 and not threads.helper
    threads.chooser.choose = lambda rows: 2  # type: ignore[method-assign]
    threads.use_for(256, 256, 3.0)
    assert threads.current == 2 and not threads.helper
    busy = StepThreads("cpu", full=2, large=2, share=FixedShare(1), choose=True)
    busy.use_for(256, 256, 0.0)
    assert busy.current == 1 and not busy.helper  # a neighbour has the other core
    beside_loop = StepThreads("cpu", full=1, large=2, choose=True)  # serve's single
    beside_loop.use_for(256, 256, 0.0)
    assert beside_loop.current == 1 and not beside_loop.helper


def test_an_engine_costs_its_decode_steps_and_keeps_its_greedy_tokens(
        tiny_llama_dir: Path) -> None:
    """``LLM.generate`` with a 2-thread team: the chooser costs the decode steps of 32 rows
    or more, and the greedy tokens are those of the fixed whole team."""
    llm = LLM(model=str(tiny_llama_dir), cpu_threads=2, num_kv_blocks=256, max_num_seqs=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [f"prompt number {i} says" for i in range(40)]
    threads = llm.resources.runner.threads
    assert threads.chooser is not None
    chosen = llm.generate(prompts, params)
    chooser = threads.chooser
    assert sum(chooser.measured.values()) >= 8
    threads.chooser = None  # the whole team for every such step, as before
    fixed = llm.generate(prompts, params)
    assert [r.outputs[0].token_ids for r in chosen] == [r.outputs[0].token_ids for r in fixed]
    assert all(len(r.outputs[0].token_ids) == 12 for r in chosen)
    before = torch.get_num_threads()  # (use_for sizes the calling thread's team: this one)
    try:
        threads.chooser = chooser
        threads.use_for(256, 256, 0.0)  # a chosen step open when the engine ends ...
        llm.resources.runner.drop_all()  # (as the next engine's Worker does first)
        measured = dict(chooser.measured)
        threads.use_for(256, 256, 0.5)
        assert chooser.measured == measured  # ... is not costed into the next run
    finally:
        torch.set_num_threads(before)
