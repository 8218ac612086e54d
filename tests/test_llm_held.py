"""``LLM`` holds one engine open across ``generate`` calls (``actorllm/engine/held.py``).

The children of a multi-process topology start once, at the first call, and stop at
``close()``, the end of a ``with`` block, or the object's collection. An exception on the
caller's thread mid-call (Ctrl-C, ``on_done`` raising) aborts that call's requests and
leaves the engine serving; a dead engine is replaced at the next call.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import pid_alive, wait_gone

from actorllm.engine.async_engine import AsyncEngine
from actorllm.llm import LLM
from actorllm.wire.messages import SamplingParams

ARGS: dict[str, Any] = dict(num_kv_blocks=96, max_num_seqs=8)
PROMPTS = ["The river runs past the old mill", "Hello! How are you today?"]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def texts(results: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(r.outputs[0].token_ids), r.outputs[0].text) for r in results]


def on_engine(llm: LLM, fn: Any) -> Any:
    """``await fn(engine)`` on the LLM's held engine (opening it if need be)."""

    async def run(engine: AsyncEngine, _send: Any) -> Any:
        return await fn(engine)

    return llm._engine().call(run)


async def child_pids(engine: AsyncEngine) -> dict[str, int]:
    assert engine.supervisor is not None
    return dict(engine.supervisor.pids())


async def drained(engine: AsyncEngine) -> list[str]:
    return await engine.wait_drained(timeout=30.0)


def test_the_children_start_once_and_stop_at_close(tiny_llama_dir: Path) -> None:
    llm = LLM(model=str(tiny_llama_dir), topology="engine", **ARGS)
    first = llm.generate(PROMPTS, greedy())
    pids = on_engine(llm, child_pids)
    second = llm.generate(PROMPTS, greedy())
    assert on_engine(llm, child_pids) == pids, "the second call used the same children"
    assert texts(second) == texts(first)
    assert [r.rid for r in second] == ["llm-1-0", "llm-1-1"]  # unique across calls
    ipc = on_engine(llm, lambda e: _ipc_path(e))
    llm.close()
    assert wait_gone(list(pids.values()), 1.0) == [], "close() stopped and reaped them"
    assert not os.path.exists(ipc)
    # A later call opens a new engine, with new children.
    assert texts(llm.generate(PROMPTS, greedy())) == texts(first)
    again = on_engine(llm, child_pids)
    assert set(again.values()).isdisjoint(pids.values())
    del llm
    gc.collect()
    assert wait_gone(list(again.values()), 1.0) == [], "collected: its engine closed"


async def _ipc_path(engine: AsyncEngine) -> str:
    assert engine.supervisor is not None
    return str(engine.supervisor.ipc.path)


def test_a_dead_engine_is_replaced_at_the_next_call(tiny_llama_dir: Path) -> None:
    with LLM(model=str(tiny_llama_dir), topology="engine", **ARGS) as llm:
        expected = texts(llm.generate(PROMPTS, greedy()))
        pids = on_engine(llm, child_pids)
        os.kill(pids["engine"], signal.SIGKILL)

        async def death(engine: AsyncEngine) -> str | None:
            await engine.died.wait()
            return engine.dead_reason

        assert on_engine(llm, death) == "engine process exited with code -9 (killed by SIGKILL)"
        results = llm.generate(PROMPTS, greedy())
        assert [r.error for r in results] == [None, None] and texts(results) == expected
        assert on_engine(llm, child_pids)["engine"] != pids["engine"]


def test_a_failed_start_raises_and_the_next_call_starts_again(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    from actorllm.engine.async_engine import EngineStartError

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(b"these are not weights")
    with LLM(model=str(model), topology="engine", **ARGS) as llm:  # (no weights read here)
        with pytest.raises(EngineStartError, match=r"^engine process failed to start: "):
            llm.generate(PROMPTS, greedy())
        (model / "model.safetensors").write_bytes(weights)
        results = llm.generate(PROMPTS, greedy())
        assert [r.error for r in results] == [None, None]


class Stop(Exception):
    pass


def test_on_done_raising_aborts_the_call_and_the_engine_serves_on(
        tiny_llama_dir: Path) -> None:
    with LLM(model=str(tiny_llama_dir), **ARGS) as llm:
        expected = texts(llm.generate(PROMPTS, greedy()))
        done: list[str] = []

        def stop_at_the_first(result: Any) -> None:
            done.append(result.rid)
            raise Stop

        # One short prompt finishes first; the long ones are mid-generation then.
        prompts = ["Hi", *PROMPTS, *PROMPTS]
        params = [greedy(1)] + [greedy(200)] * 4
        with pytest.raises(Stop):
            llm.generate(prompts, params, on_done=stop_at_the_first)
        assert done == ["llm-1-0"]
        # Every request of that call was aborted and its KV blocks freed.
        assert on_engine(llm, drained) == []
        assert on_engine(llm, lambda e: _aborted(e)) == 4
        assert texts(llm.generate(PROMPTS, greedy())) == expected


def total(counter: Any) -> float:
    """A prometheus counter's count, summed over its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples
               if s.name.endswith("_total"))


async def _aborted(engine: AsyncEngine) -> int:
    return int(total(engine.metrics.aborted_requests))


def test_two_threads_share_one_engine(tiny_llama_dir: Path) -> None:
    with LLM(model=str(tiny_llama_dir), **ARGS) as llm:
        alone = [texts(llm.generate([p], greedy())) for p in PROMPTS]
        got: dict[int, Any] = {}

        def run(i: int) -> None:
            got[i] = texts(llm.generate([PROMPTS[i]] * 3, greedy()))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {i: alone[i] * 3 for i in range(2)}


CTRL_C = """
import json, os, signal, sys
from actorllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], topology="engine", num_kv_blocks=96, max_num_seqs=8)

async def pids(engine, _send):
    return dict(engine.supervisor.pids())

async def drained(engine, _send):
    return await engine.wait_drained(timeout=30.0)

def interrupt(result):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, on this (the main) thread

long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
try:
    llm.generate(["Hi", "a b c", "d e f"], [SamplingParams(max_tokens=1), long, long],
                 on_done=interrupt)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    held = llm._engine()
    print(json.dumps({"pids": held.call(pids), "left": held.call(drained)}), flush=True)
out = llm.generate(["a b c"], SamplingParams(temperature=0.0, max_tokens=4))
print(json.dumps({"error": out[0].error, "tokens": len(out[0].outputs[0].token_ids)}),
      flush=True)
# Left without close(): the interpreter's exit closes the engine.
"""


def test_ctrl_c_aborts_the_call_and_exit_closes_the_engine(tiny_llama_dir: Path,
                                                           tmp_path: Path) -> None:
    import json

    script = tmp_path / "ctrl_c.py"
    script.write_text(textwrap.dedent(CTRL_C))
    proc = subprocess.run([sys.executable, str(script), str(tiny_llama_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (json.loads(line) for line in proc.stdout.splitlines())
    assert first["left"] == [], "the interrupted call's requests were aborted"
    assert second == {"error": None, "tokens": 4}, "and the engine served on"
    assert "Traceback" not in proc.stderr
    assert not [p for p in first["pids"].values() if pid_alive(p)]


def test_a_prefix_cached_by_one_call_is_a_hit_for_the_next(tiny_llama_dir: Path) -> None:
    async def hits(engine: AsyncEngine) -> float:
        engine.update_gauges()  # (the Scheduler's latest stats into the metrics)
        return total(engine.metrics.prefix_cache_hits)

    prompt = [5 + i % 40 for i in range(64)]
    with LLM(model=str(tiny_llama_dir), block_size=16, **ARGS) as llm:
        first = llm.generate([prompt], greedy())
        assert on_engine(llm, hits) == 0
        assert texts(llm.generate([prompt], greedy())) == texts(first)
        # The last prompt token is always computed again (its logits are needed).
        assert on_engine(llm, hits) == 48


def cut_after(cut: int | None, seen: list[Any]) -> Any:
    """An ``on_done`` that keeps each result in ``seen`` and raises at result ``cut``."""

    def on_done(result: Any) -> None:
        if len(seen) == cut:
            raise Stop
        seen.append(result)

    return on_done


WORDS = ["The river", "Hello there", "A small library", "one two three", "Why not"]


def test_calls_cut_short_anywhere_leave_nothing_held(tiny_llama_dir: Path) -> None:
    """Calls on one held engine, some cut short by ``on_done`` raising after any number
    of results, on a cache small enough to preempt: after each call nothing is held
    (no request, block or mailbox message), and every whole call still gives each prompt
    the tokens it gets alone. (That a cut call's requests are aborted, rather than left
    to finish, is the test above's.)"""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from sim.profiles import examples

    call = st.tuples(
        st.lists(st.tuples(st.integers(0, len(WORDS) - 1), st.integers(1, 24)),
                 min_size=1, max_size=5),
        st.none() | st.integers(0, 4))  # how many results come before on_done raises

    # A small cache (16 blocks of 4: four sequences of 24 tokens need 24 or more), so that
    # calls preempt and a leaked block soon starves a later call.
    with LLM(model=str(tiny_llama_dir), num_kv_blocks=16, block_size=4, max_model_len=64,
             max_num_seqs=4) as llm:
        alone: dict[tuple[int, int], Any] = {}

        def reference(word: int, n: int) -> Any:
            if (word, n) not in alone:
                alone[word, n] = texts(llm.generate([WORDS[word]], greedy(n)))[0]
            return alone[word, n]

        @settings(max_examples=examples(10))
        @given(st.lists(call, min_size=1, max_size=3))
        def run(calls: list[Any]) -> None:
            for work, cut in calls:
                expected = [reference(w, n) for w, n in work]
                seen: list[Any] = []
                on_done = cut_after(cut, seen)
                prompts = [WORDS[w] for w, _ in work]
                params = [greedy(n) for _, n in work]
                if cut is None or cut >= len(work):
                    results = llm.generate(prompts, params, on_done=on_done)
                    assert [r.error for r in results] == [None] * len(work)
                    assert texts(results) == expected
                else:
                    with pytest.raises(Stop):
                        llm.generate(prompts, params, on_done=on_done)
                    assert len(seen) == cut
                assert on_engine(llm, drained) == []

        run()

        async def preemptions(engine: AsyncEngine) -> float:
            engine.update_gauges()
            return total(engine.metrics.num_preemptions)

        assert on_engine(llm, preemptions) > 0
