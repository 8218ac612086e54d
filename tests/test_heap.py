"""The Worker's process keeps its heap between steps (``worker/sizing.keep_heap``): set once,
on glibc, and never over a choice the user made (MALLOC_* variables, another allocator
preloaded, ``ACTORLLM_KEEP_HEAP=0``). Each case runs in a fresh interpreter, since the
setting is per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import torch
from actorllm.worker.sizing import keep_heap
first = keep_heap(torch.device("cpu"))
print(first, keep_heap(torch.device("cpu")), keep_heap(torch.device("meta")))
"""


def _probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "ACTORLLM_KEEP_HEAP")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_heap_is_kept_once_per_process_on_the_cpu():
    # Set by the first call only; a second (another runner in the process) changes nothing.
    assert _probe() == ["True", "False", "False"]


@pytest.mark.parametrize("env", [{"ACTORLLM_KEEP_HEAP": "0"}, {"MALLOC_ARENA_MAX": "2"},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"}])
def test_a_users_own_malloc_settings_are_left_alone(env: dict[str, str]):
    assert _probe(**env) == ["False", "False", "False"]


def test_another_allocator_preloaded_is_left_alone(tmp_path):
    # The name is what counts; an empty file is not loaded (the loader warns and goes on).
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    fake.write_bytes(b"")
    assert _probe(LD_PRELOAD=str(fake))[0] == "False"


def test_a_frozen_block_thaws_after_and_leaves_an_earlier_freeze_alone():
    import gc

    from actorllm.engine.heap import frozen_heap

    assert gc.get_freeze_count() == 0, "pytest's process starts with nothing frozen"
    with frozen_heap():
        inside = gc.get_freeze_count()
    assert inside > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # as settle_heap leaves a server
    try:
        before = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == before, "an earlier freeze is not thawed"
    finally:
        gc.unfreeze()


def test_generate_runs_on_a_frozen_heap_and_thaws_it(tiny_llama_dir):
    import gc

    from actorllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32)
    counts: list[int] = []
    llm.generate(["a b c", "d e"], SamplingParams(max_tokens=3, temperature=0.0),
                 on_done=lambda _: counts.append(gc.get_freeze_count()))
    assert len(counts) == 2 and min(counts) > 0, "frozen while the engine ran"
    assert gc.get_freeze_count() == 0, "and thawed after"
