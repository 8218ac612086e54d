"""The same engine in one, two or three processes: identical results, clean deaths, no orphans.

``TOPOLOGIES`` and the ``topology`` fixture are meant for reuse: any end-to-end
test that takes ``topology`` runs once per placement. Starting a multi-process
engine costs a child interpreter that imports torch (seconds), so tests batch
several checks into one engine session.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import trio
import zmq
from helpers import greedy_expectations, pid_alive, wait_gone

from actorllm import cpus
from actorllm.config import EngineConfig
from actorllm.engine.async_engine import AsyncEngine, EngineStartError, Resources, open_engine
from actorllm.llm import LLM, collect, make_request
from actorllm.topology import supervisor as supervisor_module
from actorllm.topology.placement import (
    PLACEMENTS,
    child_roles,
    large_step_threads,
    worker_threads,
)
from actorllm.topology.supervisor import Supervisor
from actorllm.wire import codec
from actorllm.wire.handshake import PROTOCOL_VERSION, schema_fingerprint
from actorllm.wire.messages import GenerateRequest, SamplingParams
from actorllm.wire.outputs import RequestError
from actorllm.wire.transport import IpcDir

TOPOLOGIES = ("single", "engine", "pipeline")
MULTI = ("engine", "pipeline")

ENGINE_ARGS: dict[str, Any] = dict(num_kv_blocks=96, max_num_seqs=8)

PROMPTS = [
    "The river runs past the old mill",
    "Hello! How are you today?",
    "A small library stands on the corner",
]
MAX_TOKENS = 12


@pytest.fixture(params=TOPOLOGIES)
def topology(request: pytest.FixtureRequest) -> str:
    """Each placement of the actors in turn: single, engine, pipeline."""
    return str(request.param)


def greedy(n: int = 1, max_tokens: int = MAX_TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, tiny_tokenizer: Any) -> dict[str, Any]:
    """transformers' greedy continuation of each prompt, as ids and as text."""
    return greedy_expectations(tiny_llama_dir, tiny_tokenizer, PROMPTS, MAX_TOKENS)


# --- identical results in every topology ----------------------------------------------------


def test_llm_generate_matches_transformers(topology: str, tiny_llama_dir: Path,
                                           expected: dict[str, Any]) -> None:
    llm = LLM(model=str(tiny_llama_dir), topology=topology, **ENGINE_ARGS)
    if topology != "single":
        assert llm.resources.runner is None  # the weights live in the engine process only
    # A stop string from the middle of the greedy text of the first prompt.
    text0 = expected[PROMPTS[0]][1]
    stop = text0[len(text0) // 2:][:3]
    cut = text0.find(stop)
    prompts: list[Any] = [*PROMPTS, PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [greedy(), greedy(), greedy(),
              greedy(stop=(stop,)),
              greedy(n=3),
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                             ignore_eos=True)]
    results = llm.generate(prompts, params)
    assert [r.error for r in results] == [None] * len(prompts)
    for prompt, res in zip(PROMPTS, results[:3], strict=True):
        (out,) = res.outputs
        assert (out.token_ids, out.text) == expected[prompt]
        assert out.finish_reason == "length"
    (stopped,) = results[3].outputs
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text0[:cut]
    assert stopped.token_ids == expected[PROMPTS[0]][0][:len(stopped.token_ids)]
    fan = results[4].outputs
    assert [o.index for o in fan] == [0, 1, 2]
    assert all((o.token_ids, o.text) == expected[PROMPTS[1]] for o in fan)
    sampled = results[5].outputs
    assert [len(o.token_ids) for o in sampled] == [MAX_TOKENS, MAX_TOKENS]
    assert all(o.finish_reason == "length" for o in sampled)


async def _drain_or_fail(engine: AsyncEngine) -> None:
    problems = await engine.wait_drained(timeout=15)
    assert problems == []
    assert engine.drain_problems() == []


def _rogue_frames() -> list[bytes]:
    rng = random.Random(0)
    frames = [rng.randbytes(rng.randrange(0, 200)) for _ in range(150)]
    frames += [msgpack.packb([codec.VERSION, ["StepResult", [rng.random()]]]) for _ in range(25)]
    frames += [msgpack.packb([codec.VERSION + 1, ["AbortRequest", ["x"]]]), b"", b"\x92\x01"]
    return frames


async def test_stream_abort_and_drain(topology: str, tiny_llama_dir: Path,
                                      expected: dict[str, Any], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    config = EngineConfig(model=str(tiny_llama_dir), topology=topology, trace=str(trace),
                          **ENGINE_ARGS)
    async with open_engine(config) as engine:
        rogue: list[zmq.Socket[Any]] = []
        frames = _rogue_frames()
        if engine.supervisor is not None:
            # Codec fuzz at the socket: garbage pushed into a live child's inboxes.
            for name in ("scheduler", "detokenizer"):
                if PLACEMENTS[topology][name] != "main":
                    sock = zmq.Context.instance().socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 2000)
                    sock.connect(engine.supervisor.ipc.endpoint(f"{name}.sock"))
                    for frame in frames:
                        sock.send(frame)
                    rogue.append(sock)

        # 1. A stream read to the end equals transformers, while others are aborted.
        async def full() -> tuple[tuple[int, ...], str]:
            res = await collect(engine, "full", PROMPTS[2], greedy())
            return res.outputs[0].token_ids, res.outputs[0].text

        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            async def run_full() -> None:
                results["full"] = await full()

            nursery.start_soon(run_full)

            # 2. Abort mid-stream: the stream ends with finish_reason abort.
            collector = await engine.submit(make_request("mid", PROMPTS[0], greedy(
                max_tokens=200)))
            first = await collector.get()
            assert first.outputs[0].token_ids
            await engine.abort("mid")
            reasons = [o.finish_reason async for out in collector for o in out.outputs]
            assert reasons[-1] == "abort"

            # 3. Abort before the first token, and twice (idempotent).
            early = await engine.submit(make_request("early", PROMPTS[1], greedy(
                max_tokens=200)))
            await engine.abort("early")
            await engine.abort("early")
            outs = [o async for out in early for o in out.outputs]
            assert outs[-1].finish_reason == "abort"

            # 4. n > 1 aborted through its parent: every child ends.
            fan = await engine.submit(make_request("fan", PROMPTS[1], greedy(
                n=3, max_tokens=200)))
            await fan.get()
            await engine.abort("fan")
            ends = {o.index: o.finish_reason async for out in fan for o in out.outputs
                    if o.finish_reason}
            assert set(ends) <= {0, 1, 2} and set(ends.values()) <= {"abort", "length"}

            # 5. Leaving a generate() early aborts it.
            async for _ in engine.generate(make_request("left", PROMPTS[0], greedy(
                    max_tokens=200))):
                break

        assert results["full"] == expected[PROMPTS[2]]
        await _drain_or_fail(engine)
        assert engine.frontend.registry == {}
        engine.update_gauges()  # remote mailboxes' depths come with the heartbeats
        if engine.supervisor is not None:
            rejected = engine.supervisor.rejected_frames
            for sock in rogue:
                sock.close()
            roles = {PLACEMENTS[topology][n] for n in ("scheduler", "detokenizer")} - {"main"}
            assert rejected == dict.fromkeys(roles, len(frames))
    assert not engine.alive
    # Every process appended to the one trace file; only the parent wrote a header.
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [ln.get("kind") for ln in lines].count("header") == 1
    assert {"frontend", "scheduler"} <= {ln.get("actor") for ln in lines}
    # ... and the merged file is a legal history for every request (actorllm replay).
    from actorllm.lifecycle.table import load_spec
    from actorllm.replay.check import check_trace
    from actorllm.replay.tracefile import load_trace

    spec = load_spec()
    assert check_trace(load_trace(trace, spec), spec) == []


# --- supervision --------------------------------------------------------------------------


@pytest.mark.parametrize(("topology", "victim"), [("engine", "engine"),
                                                  ("pipeline", "detokenizer")])
async def test_killed_child_fails_live_requests_naming_the_process(
        topology: str, victim: str, tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), topology=topology, **ENGINE_ARGS)
    async with open_engine(config) as engine:
        assert engine.supervisor is not None
        pids = engine.supervisor.pids()
        ipc_path = engine.supervisor.ipc.path
        long = greedy(max_tokens=240)
        collectors = [await engine.submit(make_request(f"r{i}", "Hi", long)) for i in range(3)]
        for c in collectors:
            await c.get()  # every request is streaming
        os.kill(pids[victim], signal.SIGKILL)
        errors = []
        # The guard only stops a hang; the message below says the cause was the exit
        # itself, not a missed heartbeat or the requests running out of tokens.
        with trio.fail_after(60):
            for c in collectors:
                with pytest.raises(RequestError) as info:
                    async for _ in c:
                        pass
                errors.append(info.value)
        message = f"{victim} process exited with code -9 (killed by SIGKILL)"
        assert {(str(e), e.code) for e in errors} == {(message, "engine_dead")}
        assert not engine.alive and engine.dead_reason == message
        with pytest.raises(RequestError, match="exited with code -9") as refused:
            await engine.submit(make_request("late", "Hi", greedy()))
        assert refused.value.code == "engine_dead"
        assert engine.frontend.registry == {}
    assert wait_gone(list(pids.values()), 1.0) == []
    assert not os.path.exists(ipc_path)


async def test_bad_weights_fail_start_with_the_childs_error(tiny_llama_dir: Path,
                                                            tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"these are not weights")
    config = EngineConfig(model=str(broken), topology="engine", **ENGINE_ARGS)
    resources = Resources(config)  # tokenizer and config only: fine here
    with pytest.raises(EngineStartError, match=r"^engine process failed to start: ") as info:
        async with open_engine(config, resources=resources):
            pass
    assert "safetensors" in str(info.value).lower() or "header" in str(info.value).lower()


def _impostor(tmp_path: Path, body: str) -> list[str]:
    """A fake child: a short script run instead of ``python -m actorllm.topology``."""
    script = tmp_path / "impostor.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


async def _start_with(argv: list[str], tmp_path: Path, **kw: Any) -> tuple[Supervisor, Any]:
    config = EngineConfig(model=str(tmp_path), topology="engine")
    ipc = IpcDir()
    deaths: list[str] = []
    sup = Supervisor(config, ipc, on_death=deaths.append,
                     argv=lambda role: [*argv, ipc.endpoint("parent.ctl"),
                                        ipc.endpoint(f"{role}.ctl")], **kw)
    return sup, deaths


async def _expect_start_error(argv: list[str], tmp_path: Path, match: str) -> None:
    sup, _ = await _start_with(argv, tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            with pytest.raises(EngineStartError, match=match):
                await sup.start(nursery)
            await sup.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        sup.ipc.remove()
    assert all(not c.running for c in sup.children.values())


async def test_mismatched_child_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    fake = _impostor(tmp_path, f"""
        import os, sys, time, msgpack, zmq
        s = zmq.Context.instance().socket(zmq.PUSH)
        s.connect(sys.argv[1])
        hello = [{PROTOCOL_VERSION + 1}, {codec.VERSION}, "{schema_fingerprint()}",
                 "engine", os.getpid()]
        s.send(msgpack.packb([{codec.VERSION}, ["Hello", hello]]))
        time.sleep(60)
    """)
    await _expect_start_error(
        fake, tmp_path,
        f"engine process \\(pid \\d+\\) speaks transport protocol {PROTOCOL_VERSION + 1}, "
        f"this process speaks {PROTOCOL_VERSION}")


async def test_child_of_another_codec_version_is_refused(tmp_path: Path) -> None:
    fake = _impostor(tmp_path, f"""
        import os, sys, time, msgpack, zmq
        s = zmq.Context.instance().socket(zmq.PUSH)
        s.connect(sys.argv[1])
        s.send(msgpack.packb([{codec.VERSION + 1}, ["Hello", [1, 2, "x", "engine", 1]]]))
        time.sleep(60)
    """)
    await _expect_start_error(fake, tmp_path,
                              f"speaks codec version {codec.VERSION + 1}, this process speaks "
                              f"{codec.VERSION}")


async def test_child_that_dies_silently_during_start_up(tmp_path: Path) -> None:
    fake = _impostor(tmp_path, "import sys; sys.exit(7)")
    await _expect_start_error(fake, tmp_path,
                              "^engine process exited with code 7 during start-up$")


def test_real_child_refuses_a_mismatched_parent(tmp_path: Path) -> None:
    # The other direction: an impostor parent sends the real child a bad Hello.
    ipc = IpcDir()
    ctx = zmq.Context.instance()
    parent_in = ctx.socket(zmq.PULL)
    parent_in.bind(ipc.endpoint("parent.ctl"))
    config = EngineConfig(model=str(tmp_path), topology="engine")
    proc = subprocess.Popen([sys.executable, "-m", "actorllm.topology", "engine",
                             json.dumps(config.as_dict()), ipc.path, str(os.getpid())])
    try:
        assert parent_in.poll(60_000), "the child never said Hello"
        hello = codec.decode(parent_in.recv())
        assert hello.role == "engine" and hello.pid == proc.pid
        to_child = ctx.socket(zmq.PUSH)
        to_child.connect(ipc.endpoint("engine.ctl"))
        to_child.send(msgpack.packb([codec.VERSION, ["Hello", [
            PROTOCOL_VERSION, codec.VERSION, "not-our-schema", "parent", os.getpid()]]]))
        assert parent_in.poll(30_000)
        failed = codec.decode(parent_in.recv())
        assert failed.message.startswith("refused by the engine process: parent process")
        assert "message schema not-our-schema" in failed.message
        assert proc.wait(timeout=30) == 3
        to_child.close(linger=0)
    finally:
        proc.kill()
        proc.wait()
        parent_in.close(linger=0)
        ipc.remove()


READY_IMPOSTOR = """
import os, signal, sys, time
import trio
from actorllm.wire.messages import ControlMessage, Ready, StartFailed
from actorllm.wire.handshake import make_hello
from actorllm.wire.transport import ZmqInbox, ZmqOutbox

async def main():
    if sys.argv[1] == "stubborn":  # ignores Shutdown (never reads it) and SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctl_in = ZmqInbox("engine.ctl", ControlMessage, 16, sys.argv[-1])
    out = ZmqOutbox(sys.argv[-2], ControlMessage, name="out", linger_ms=1000)
    async with trio.open_nursery() as nursery:
        await out.send(make_hello("engine"))
        await ctl_in.receive()
        if sys.argv[1] == "never_ready":
            await trio.sleep(60)  # handshakes, then never says Ready
        await out.send(Ready("engine", os.getpid()))
        if sys.argv[1] == "crash":
            await trio.sleep(0.3)
            await out.send(StartFailed("engine", "RuntimeError: boom"))
            nursery.cancel_scope.cancel()
        else:
            await trio.sleep(60)  # silent: no heartbeat ever
    out.close()
    ctl_in.close()
    sys.exit(1)

trio.run(main)
"""


async def _run_until_death(argv: list[str], tmp_path: Path) -> list[str]:
    sup, deaths = await _start_with(argv, tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            await sup.start(nursery)
            with trio.fail_after(10):
                while not deaths:
                    await trio.sleep(0.05)
            await sup.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        sup.ipc.remove()
    return deaths


async def test_silent_child_is_killed_and_the_engine_declared_dead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "CHILD_TIMEOUT", 1.0)
    # Handshakes and reports ready like a real child, then never speaks again.
    deaths = await _run_until_death([*_impostor(tmp_path, READY_IMPOSTOR), "silent"], tmp_path)
    assert len(deaths) == 1
    assert deaths[0].startswith("engine process stopped responding (no heartbeat for 1.")


async def test_crashing_child_says_why(tmp_path: Path) -> None:
    deaths = await _run_until_death([*_impostor(tmp_path, READY_IMPOSTOR), "crash"], tmp_path)
    assert deaths == ["engine process exited with code 1 (RuntimeError: boom)"]


async def test_a_child_not_ready_in_time_fails_start_up_naming_it(tmp_path: Path) -> None:
    sup, _ = await _start_with([*_impostor(tmp_path, READY_IMPOSTOR), "never_ready"],
                               tmp_path, ready_timeout=1.0)
    try:
        async with trio.open_nursery() as nursery:
            with pytest.raises(EngineStartError, match=r"^engine process not ready after 1 s$"):
                await sup.start(nursery)
            with trio.fail_after(60):  # a guard: not ready, it is sent SIGTERM at once
                await sup.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        sup.ipc.remove()
    (child,) = sup.children.values()
    assert child.proc is not None and child.proc.returncode == -signal.SIGTERM


async def test_a_child_that_ignores_shutdown_and_sigterm_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from actorllm.topology import children as children_module

    monkeypatch.setattr(children_module, "SHUTDOWN_GRACE", 0.5)
    monkeypatch.setattr(supervisor_module, "CHILD_TIMEOUT", 600.0)  # silence is not death
    sup, deaths = await _start_with([*_impostor(tmp_path, READY_IMPOSTOR), "stubborn"],
                                    tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            await sup.start(nursery)
            with trio.fail_after(60):  # a guard against a hang
                await sup.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        sup.ipc.remove()
    (child,) = sup.children.values()
    # Shutdown, then SIGTERM, then SIGKILL: each step logged, and only the last ended it.
    assert child.proc is not None and child.proc.returncode == -signal.SIGKILL
    steps = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
    assert steps == ["engine process did not stop; sending SIGTERM",
                     "engine process did not stop; sending SIGKILL"]
    assert deaths == []  # a stop, not a death


# --- the parent process dies ---------------------------------------------------------------

PARENT_SCRIPT = """
import json, logging, sys
import trio
from actorllm.config import EngineConfig
from actorllm.engine.async_engine import open_engine
from actorllm.llm import make_request
from actorllm.wire.messages import SamplingParams

async def main():
    logging.basicConfig(level=logging.INFO)  # the children log their exits (shown on failure)
    config = EngineConfig(model=sys.argv[1], topology=sys.argv[2], num_kv_blocks=96)
    async with open_engine(config) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
        tokens = 0
        async for out in engine.generate(make_request("p", "Hello", params)):
            if tokens == 0:
                print(json.dumps({"pids": engine.supervisor.pids(),
                                  "ipc": engine.supervisor.ipc.path,
                                  "runner": "actorllm.worker.runner" in sys.modules}), flush=True)
            tokens += len(out.outputs[0].token_ids)
        print(f"done {tokens}", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def _start_parent(tmp_path: Path, model: Path, topology: str,
                  max_tokens: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(model), topology,
                             str(max_tokens)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the parent script failed (exit {proc.wait()})"
    return proc, json.loads(line)


def test_parent_sigkill_leaves_no_child_running(tmp_path: Path, tiny_llama_dir: Path) -> None:
    proc, info = _start_parent(tmp_path, tiny_llama_dir, "pipeline", 8)
    pids = list(info["pids"].values())
    try:
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        assert info["runner"] is False  # the API process never loads the model
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(pids, 5.0) == []
    deadline = time.monotonic() + 5
    while os.path.exists(info["ipc"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(info["ipc"])  # the orphans removed it on their way out


def test_parent_sigterm_drains_then_exits_cleanly(tmp_path: Path, tiny_llama_dir: Path) -> None:
    proc, info = _start_parent(tmp_path, tiny_llama_dir, "engine", 120)
    pids = list(info["pids"].values())
    try:
        proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still finish
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert "done 120" in out
    assert proc.returncode == -signal.SIGTERM
    assert wait_gone(pids, 1.0) == []
    assert not os.path.exists(info["ipc"])


# --- small pieces ---------------------------------------------------------------------------


def test_placements_cover_every_actor_once() -> None:
    for name, place in PLACEMENTS.items():
        assert set(place) == {"frontend", "tokenizer", "scheduler", "worker", "detokenizer"}
        assert place["frontend"] == "main" and place["scheduler"] == place["worker"]
        assert name in TOPOLOGIES
    assert child_roles("single") == ()
    assert child_roles("engine") == ("engine",)
    assert child_roles("pipeline") == ("engine", "detokenizer")


def test_detokenizer_child_decodes_like_the_parent(tiny_tokenizer: Any) -> None:
    # The detokenizer child rebuilds the tokenizer from the parent's serialized backend.
    import tokenizers

    backend = tiny_tokenizer.backend_tokenizer
    twin = tokenizers.Tokenizer.from_str(backend.to_str())
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(len(tiny_tokenizer)) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert twin.decode(ids, skip_special_tokens=skip) == \
                backend.decode(ids, skip_special_tokens=skip)


async def test_engine_refuses_requests_after_exit(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), **ENGINE_ARGS)
    async with open_engine(config) as engine:
        pass
    with pytest.raises(RequestError, match="shut down") as info:
        await engine.submit(GenerateRequest("x", greedy(), prompt="Hi"))
    assert info.value.code == "engine_dead"


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_worker_threads_leave_a_core_to_the_http_process(monkeypatch: pytest.MonkeyPatch,
                                                         cores: int) -> None:
    """A Worker with a process of its own on the CPU, or beside the loop of `actorllm serve`
    with one rank, gets one thread per core less one (at least one); beside an offline
    engine's loop it keeps torch's default; --cpu-threads wins."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(cpus, "cpu_quota", lambda root=None: None)  # a CI container's
    for topology in ("engine", "pipeline"):
        config = EngineConfig(model="m", topology=topology)
        assert worker_threads(config) == max(1, cores - 1)
        assert worker_threads(attrs.evolve(config, cpu_threads=3)) == 3
        assert worker_threads(attrs.evolve(config, device="cuda")) is None
        assert worker_threads(attrs.evolve(config, tensor_parallel_size=2)) == \
            max(1, (cores - 1) // 2)
    assert worker_threads(EngineConfig(model="m", topology="single")) is None
    assert worker_threads(EngineConfig(model="m", topology="single", cpu_threads=2)) == 2
    # `actorllm serve` in `single`: the loop beside the Worker serves HTTP.
    served = EngineConfig(model="m", topology="single", serving_http=True)
    assert worker_threads(served) == max(1, cores - 1)
    assert worker_threads(attrs.evolve(served, cpu_threads=2)) == 2
    assert worker_threads(attrs.evolve(served, tensor_parallel_size=2)) is None
    assert worker_threads(attrs.evolve(served, device="cuda")) is None


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_a_prefill_step_gets_the_core_left_to_http(monkeypatch: pytest.MonkeyPatch,
                                                   cores: int) -> None:
    """Where the Worker left a core to the HTTP process, a prefill-sized step may use it;
    --cpu-threads, tensor parallelism and a Worker beside an offline loop keep one count."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(cpus, "cpu_quota", lambda root=None: None)  # a CI container's
    for topology in ("engine", "pipeline"):
        config = EngineConfig(model="m", topology=topology)
        assert large_step_threads(config) == cores
        assert large_step_threads(attrs.evolve(config, cpu_threads=1)) is None
        assert large_step_threads(attrs.evolve(config, device="cuda")) is None
        assert large_step_threads(attrs.evolve(config, tensor_parallel_size=2)) is None
    assert large_step_threads(EngineConfig(model="m", topology="single")) is None
    served = EngineConfig(model="m", topology="single", serving_http=True)
    assert large_step_threads(served) == cores
    assert large_step_threads(attrs.evolve(served, tensor_parallel_size=2)) is None
