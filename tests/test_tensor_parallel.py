"""Tensor parallelism (``--tensor-parallel-size``, actorllm/worker/ranks.py, model/parallel.py).

Two ranks over gloo on loopback must give transformers' greedy tokens and one rank's
tokens (greedy and seeded), also when the Scheduler preempts and chunks prefills; a
dead rank fails in-flight requests with ``engine_dead`` within 2 s and no process
outlives its driver (the driver runs in this process, or in an ``engine`` child that
is killed). The embedded model has 8 heads and 2 KV heads: 2 ranks split the
KV heads, 4 ranks replicate them (checked on the loaded shards).

A process holds one tensor-parallel group at a time (torch.distributed's default
group), so the in-process tests share one 2-rank runner (rebuilt after the test that
kills one of its ranks).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import hf_greedy, hf_model

from actorllm.cli import main as cli_main
from actorllm.config import EngineConfig, default_model_dir
from actorllm.engine.async_engine import Resources, open_engine
from actorllm.wire.messages import GenerateRequest, SamplingParams
from actorllm.wire.outputs import RequestError

torch = pytest.importorskip("torch")
MODEL = default_model_dir()
PROMPTS = [
    "def add(a, b):",
    "hello",
    "The state machine is a table you can read top to bottom, and so is this prompt.",
    "import os\nimport sys\n",
    "x = [1, 2, 3]",
]
NEW_TOKENS = 24
# 32 blocks of 4 tokens hold one 128-token sequence: five prompts at once must preempt.
CACHE = dict(num_kv_blocks=32, block_size=4, max_model_len=128, cpu_threads=1)


def _config(tp: int, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(MODEL), tensor_parallel_size=tp, **{**CACHE, **kw})


@pytest.fixture(scope="module")
def _tp2_holder() -> Iterator[dict[str, Resources]]:
    holder: dict[str, Resources] = {}
    yield holder
    if holder:
        ranks = holder["res"].runner.ranks
        killed = ranks.dead() is not None  # by the last test that used it
        holder["res"].runner.close()
        assert not [p for p in ranks.pids if _alive(p)]
        if not killed:  # told to stop, a rank exits 0: neither the closed stdin nor
            # the closed store reads as an orphaning, and the group's threads do not
            # abort the interpreter's exit
            assert [p.returncode for p in ranks.procs] == [0]


@pytest.fixture
def tp2(_tp2_holder: dict[str, Resources]) -> Resources:
    """The module's one 2-rank runner; rebuilt after a test killed one of its ranks."""
    res = _tp2_holder.get("res")
    if res is None or res.runner.ranks.dead() is not None:
        if res is not None:
            res.runner.close()
        res = _tp2_holder["res"] = Resources(_config(2))
    return res


@pytest.fixture(scope="module")
def tp1() -> Resources:
    return Resources(_config(1))


@pytest.fixture(scope="module")
def prompt_ids(tp1: Resources) -> list[list[int]]:
    return [tp1.hf_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def oracle(prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers ``generate``, greedy, on the same checkpoint."""
    model = hf_model(MODEL)
    model.generation_config.repetition_penalty = 1.0  # the checkpoint asks for 1.2
    return [hf_greedy(model, ids, NEW_TOKENS)[0] for ids in prompt_ids]


async def _generate(res: Resources, prompts: list[list[int]], params: SamplingParams,
                    **kw: Any) -> tuple[list[list[int]], int]:
    """Every prompt at once through an engine on ``res``; token ids and preemptions."""
    config = EngineConfig(**{**res.config.as_dict(), **kw})
    out: list[list[int]] = [[] for _ in prompts]
    async with open_engine(config, resources=res) as engine:

        async def one(i: int) -> None:
            req = GenerateRequest(f"tp-{i}", params, prompt_token_ids=tuple(prompts[i]))
            async for o in engine.generate(req):
                out[i].extend(o.outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        assert await engine.wait_drained() == []
        preempted = engine.frontend.stats.num_preemptions  # the Scheduler's latest total
    return out, preempted


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_a_rank_that_cannot_load_fails_start_up_with_its_reason(
        _tp2_holder: dict[str, Resources]) -> None:
    from actorllm.worker.ranks import RankGroup, RankSpec

    # First in the file, before the shared runner exists (one group per process); run
    # alone or later, it closes that runner, and the next test that needs it rebuilds it.
    if "res" in _tp2_holder:
        _tp2_holder["res"].runner.close()
    group = RankGroup(RankSpec("/nonexistent", 2, 4, 4, "float32", "cpu", "torch", 1))
    try:
        with pytest.raises(ValueError, match=r"^tensor-parallel rank 1 failed to start: "
                                             r"model directory '/nonexistent' does not exist"):
            group.connect(timeout=120)
    finally:
        group.close()
    assert not [p for p in group.pids if _alive(p)]


def _free_the_group(holder: dict[str, Resources]) -> None:
    """One torch.distributed group per process: close the shared runner's (the next test
    that needs it rebuilds it)."""
    if "res" in holder:
        holder["res"].runner.close()


_SPEC = ("/nonexistent", 2, 4, 4, "float32", "cpu", "torch", 1)


def _rank_impostor(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Local ranks run ``code`` (with the driver's environment) instead of ``actorllm rank``."""
    import subprocess
    import sys
    import types

    from actorllm.worker import ranks

    def popen(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], **kw)

    monkeypatch.setattr(ranks, "subprocess", types.SimpleNamespace(
        Popen=popen, PIPE=subprocess.PIPE, TimeoutExpired=subprocess.TimeoutExpired))


def test_a_rank_that_never_starts_is_named_and_close_kills_it(
        _tp2_holder: dict[str, Resources], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from actorllm.worker.ranks import RankGroup, RankSpec

    _free_the_group(_tp2_holder)
    # Hangs before it joins, and ignores both EOF on its stdin and SIGTERM: only the
    # SIGKILL that close() falls back to can end it.
    _rank_impostor(monkeypatch, "import signal, time\n"
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                "time.sleep(300)")
    group = RankGroup(RankSpec(*_SPEC))
    try:
        with pytest.raises(ValueError, match=r"^tensor-parallel rank 1 did not start within "
                                             r"1 s$"):
            group.connect(timeout=1.0)
    finally:
        group.close()
    (proc,) = group.procs
    assert proc.returncode == -signal.SIGKILL
    assert f"tensor-parallel rank (pid {proc.pid}) did not stop; killing it" in caplog.text


_NEVER_JOINS = """
import datetime, json, subprocess, sys, types
from actorllm.worker import ranks
from actorllm.worker.ranks import RankGroup, RankSpec

# Says "ready" in the store like a real rank, then never calls init_process_group.
FAKE = "\\n".join([
    "import os, sys",
    "from actorllm.wire.rendezvous import joined_key, rank_store, status_key",
    "store = rank_store(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), 30.0)",
    "store.set(joined_key(1), '1')",
    "store.set(status_key(1), 'ready')",
    "sys.stdin.buffer.read()",
])
ranks.subprocess = types.SimpleNamespace(
    Popen=lambda argv, **kw: subprocess.Popen([sys.executable, "-c", FAKE], **kw),
    PIPE=subprocess.PIPE, TimeoutExpired=subprocess.TimeoutExpired)
ranks.COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=2)
group = RankGroup(RankSpec("/nonexistent", 2, 4, 4, "float32", "cpu", "torch", 1))
try:
    group.connect(timeout=60.0)
    error = None
except ValueError as exc:
    error = str(exc)
finally:
    group.close()
print(json.dumps({"error": error, "code": group.procs[0].returncode}))
"""


def test_ranks_that_say_ready_but_never_join_the_group_are_a_start_up_error() -> None:
    import json
    import subprocess
    import sys

    # In a process of its own: a failed init_process_group leaves torch.distributed's
    # group numbering behind, and the next group of this process would never meet its
    # ranks (a driver whose group does not form exits anyway).
    out = subprocess.run([sys.executable, "-c", _NEVER_JOINS], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["error"].startswith(
        "the tensor-parallel group did not form: "), got
    assert got["code"] == 0  # the rank left when its stdin closed: no kill was needed


async def test_a_forward_that_raises_breaks_the_group_without_a_rank_dying(
        _tp2_holder: dict[str, Resources], monkeypatch: pytest.MonkeyPatch) -> None:
    from actorllm.worker import ranks
    from actorllm.worker.ranks import RankDied, RankGroup, RankSpec

    _free_the_group(_tp2_holder)
    # A rank that is alive and well (it waits for its stdin to close), and a step that
    # fails on the driver after the broadcast: the ranks may wait in an all-reduce the
    # driver never reaches, so the group must count as broken, naming the step's error.
    _rank_impostor(monkeypatch, "import sys; sys.stdin.buffer.read()")
    monkeypatch.setattr(ranks, "broadcast_batch", lambda batch: None)
    group = RankGroup(RankSpec(*_SPEC))

    def model(*args: Any) -> Any:
        raise RuntimeError("out of memory in layer 3")

    try:
        with pytest.raises(RuntimeError, match="out of memory in layer 3"):
            group.forward(model, None, [], None)  # type: ignore[arg-type]
        broken = "a tensor-parallel step failed: RuntimeError: out of memory in layer 3"
        assert group.broken == broken and group.dead() == broken  # no rank died
        with pytest.raises(RankDied, match="^" + broken + "$"):
            await group.check()  # no rank is seen dead: the step's own error is the cause
        with pytest.raises(RankDied, match="^" + broken + "$"):  # no later step runs
            group.forward(model, None, [], None)  # type: ignore[arg-type]
        assert all(p.poll() is None for p in group.procs)
    finally:
        group.close()


async def test_two_ranks_match_transformers_one_at_a_time(
        tp2: Resources, prompt_ids: list[list[int]], oracle: list[list[int]]) -> None:
    got, preempted = await _generate(tp2, prompt_ids, GREEDY, max_num_seqs=1)
    assert preempted == 0
    assert got == oracle


async def test_two_ranks_match_transformers_under_preemption(
        tp2: Resources, prompt_ids: list[list[int]], oracle: list[list[int]]) -> None:
    got, preempted = await _generate(tp2, prompt_ids, GREEDY)
    assert preempted > 0  # the small cache forced recomputation on both ranks
    assert got == oracle


async def test_two_ranks_match_transformers_with_chunked_prefill(
        tp2: Resources, prompt_ids: list[list[int]], oracle: list[list[int]]) -> None:
    assert max(len(p) for p in prompt_ids) > 8  # the long prompt takes several chunks
    got, _ = await _generate(tp2, prompt_ids, GREEDY, max_num_batched_tokens=8,
                             max_num_seqs=2)
    assert got == oracle


async def test_two_ranks_match_one_rank_greedy_and_seeded(
        tp1: Resources, tp2: Resources, prompt_ids: list[list[int]]) -> None:
    for params in (GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=7,
                                          max_tokens=NEW_TOKENS, ignore_eos=True)):
        one, _ = await _generate(tp1, prompt_ids, params, max_num_seqs=2)
        two, _ = await _generate(tp2, prompt_ids, params, max_num_seqs=2)
        assert one == two


def test_each_rank_loads_only_its_shard_and_replicates_scarce_kv_heads() -> None:
    from actorllm.model import load_model
    from actorllm.model.parallel import TensorParallel

    full = load_model(MODEL).model.layers[0]
    d, heads, kv, inter = 32, 8, 2, 704
    q, k, v = full.self_attn.qkv_proj.weight.split([heads * d, kv * d, kv * d])
    for world in (2, 4):
        for rank in range(world):
            layer = load_model(MODEL, tp=TensorParallel(rank, world)).model.layers[0]
            hq = heads // world
            first, n = rank * kv // world, max(1, kv // world)  # with 4 ranks: each KV head twice
            kv_rows = slice(first * d, (first + n) * d)
            want = torch.cat([q[rank * hq * d:(rank + 1) * hq * d], k[kv_rows], v[kv_rows]])
            assert torch.equal(layer.self_attn.qkv_proj.weight, want), (world, rank)
            cols = slice(rank * hq * d, (rank + 1) * hq * d)
            assert torch.equal(layer.self_attn.o_proj.weight, full.self_attn.o_proj.weight[:, cols])
            part = inter // world
            assert torch.equal(layer.mlp.down_proj.weight,
                               full.mlp.down_proj.weight[:, rank * part:(rank + 1) * part])


@pytest.mark.parametrize("command", [["run", "hi"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("topology", ["single", "engine"])
def test_a_size_that_does_not_divide_the_heads_is_a_one_line_cli_error(
        capsys: pytest.CaptureFixture[str], command: list[str], topology: str) -> None:
    code = cli_main([*command, "--tensor-parallel-size", "3", "--topology", topology])
    err = capsys.readouterr().err
    assert code == 2
    assert err.endswith("error: --tensor-parallel-size 3 does not divide the model's "
                        "8 attention heads\n")
    assert err.count("\n") == 1


# --- death and orphans (the driver in an `engine` child process) ---------------------


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


async def _wait_gone(pids: list[int], timeout: float) -> bool:
    with trio.move_on_after(timeout):
        while any(_alive(p) for p in pids):
            await trio.sleep(0.05)
        return True
    return False


async def _kill_mid_generation(engine: Any, pid: int) -> tuple[RequestError | None, int]:
    """Start a long request, SIGKILL ``pid`` once it has tokens; the error and how many
    tokens the request had (fewer than it asked for: the kill, not its end, stopped it)."""
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    col = await engine.submit(GenerateRequest("victim", params, prompt="hello there"))
    killed = False
    tokens = 0
    with trio.fail_after(60):  # a guard against a hang, not a latency bound
        try:
            async for out in col:
                tokens = len(out.outputs[0].token_ids)
                if tokens and not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
        except RequestError as exc:
            return exc, tokens
    return None, tokens


async def test_a_dead_rank_fails_requests_naming_the_rank_in_the_single_topology(
        tp2: Resources) -> None:
    (rank,) = tp2.runner.ranks.pids
    async with open_engine(tp2.config, resources=tp2) as engine:
        error, tokens = await _kill_mid_generation(engine, rank)
        assert error is not None and error.code == "engine_dead", error
        assert tokens < 100
        assert f"rank 1 (pid {rank}) exited with code -9 (killed by SIGKILL)" in str(error)
        assert not engine.alive
        with pytest.raises(RequestError, match="rank 1"):  # new requests are refused
            await engine.submit(GenerateRequest("late", GREEDY, prompt="x"))


async def test_a_dead_driver_process_fails_requests_and_leaves_no_orphan_rank() -> None:
    config = _config(2, topology="engine")
    res = Resources(config)
    async with open_engine(config, resources=res) as engine:
        assert engine.supervisor is not None
        driver = engine.supervisor.pids()["engine"]
        (rank,) = _children(driver)  # the driver's one rank
        error, tokens = await _kill_mid_generation(engine, driver)
        assert error is not None and error.code == "engine_dead", error
        assert tokens < 100
        assert "engine process exited with code -9 (killed by SIGKILL)" in str(error)
        # The rank notices at once (EOF on its stdin): no process outlives its driver.
        assert await _wait_gone([rank, driver], 30.0)
