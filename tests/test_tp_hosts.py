"""Tensor-parallel ranks on other hosts (actorllm/wire/rendezvous.py, ``actorllm rank``).

Every test here plays both hosts on loopback: the driver (this process, or an
``engine`` child) runs with ``--tensor-parallel-local-ranks 1`` (``EngineConfig.
tensor_parallel_local_ranks``) and ``MASTER_ADDR``/``MASTER_PORT``, and the test starts
rank 1 itself, as a second host would: ``python -m actorllm rank`` with ``RANK`` and
``WORLD_SIZE`` in its environment, not a child of the driver and not watched by it
through a process handle. What is checked: the tokens equal one rank's; the driver's
clean close, and its death, leave no rank behind; a rank that is killed mid-step, or
stopped while the engine idles, kills the engine with ``engine_dead`` naming it; a rank
that never comes, or comes with the wrong ``WORLD_SIZE``, is a one-line start-up error
within the configured time. What is not: two real hosts, NCCL across hosts.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import free_port, other_host, wait_exit

from actorllm.config import EngineConfig, default_model_dir
from actorllm.engine.async_engine import Resources, open_engine
from actorllm.wire.messages import GenerateRequest, SamplingParams
from actorllm.wire.outputs import RequestError

torch = pytest.importorskip("torch")
MODEL = default_model_dir()
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def add(a, b):", "hello", "import os\nimport sys\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
CACHE = dict(num_kv_blocks=64, block_size=4, max_model_len=128, cpu_threads=1)


def _second_host(port: int, log: Path, *, world: int = 2, timeout: float = 60.0
                 ) -> subprocess.Popen[bytes]:
    """Rank 1 started the way the README tells a second host to start it."""
    return other_host("rank", port, log, MODEL, world=world, timeout=timeout)


def _config(tp: int, **kw: Any) -> EngineConfig:
    """With tp > 1, rank 0 here and the others from elsewhere (the second host)."""
    remote = dict(tensor_parallel_local_ranks=1, tensor_parallel_timeout=60.0) if tp > 1 \
        else {}
    return EngineConfig(model=str(MODEL), tensor_parallel_size=tp, **{**CACHE, **remote, **kw})


async def _generate(res: Resources, params: SamplingParams) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in PROMPTS]
    async with open_engine(res.config, resources=res) as engine:

        async def one(i: int) -> None:
            req = GenerateRequest(f"h-{i}", params, prompt=PROMPTS[i])
            async for o in engine.generate(req):
                out[i].extend(o.outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    return out


async def test_a_rank_on_another_host_gives_one_ranks_tokens_and_leaves_with_the_driver(
        port: int, tmp_path: Path, cleanup: list[Any]) -> None:
    rank = _second_host(port, tmp_path / "rank.log")  # before the driver: it waits for it
    cleanup.append(rank)
    two = Resources(_config(2))
    cleanup.append(two.runner)
    assert two.runner.ranks.pids == []  # the driver started no rank itself
    got = await _generate(two, GREEDY)
    one = Resources(_config(1))
    assert got == await _generate(one, GREEDY)
    assert all(len(t) == GREEDY.max_tokens for t in got)
    two.runner.close()
    assert wait_exit(rank, 10.0) == 0, (tmp_path / "rank.log").read_text()[-2000:]


async def test_killing_the_remote_rank_mid_step_fails_requests_with_engine_dead(
        port: int, tmp_path: Path, cleanup: list[Any]) -> None:
    rank = _second_host(port, tmp_path / "rank.log")
    cleanup.append(rank)
    res = Resources(_config(2))
    cleanup.append(res.runner)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    async with open_engine(res.config, resources=res) as engine:
        col = await engine.submit(GenerateRequest("victim", params, prompt="hello there"))
        killed = False
        tokens = 0
        # The guard only stops a hang; the message names the cause (the heartbeat that
        # stopped), and the request ended short of its 100 tokens.
        with trio.fail_after(60), pytest.raises(RequestError) as err:
            async for out in col:
                tokens = len(out.outputs[0].token_ids)
                if tokens and not killed:
                    rank.kill()  # no process handle on the driver's side
                    killed = True
        assert err.value.code == "engine_dead"
        assert f"tensor-parallel rank 1 (remote, at 127.0.0.1:{port}) sent no heartbeat" \
            in str(err.value)
        assert tokens < 100
        assert not engine.alive


async def test_a_stopped_remote_rank_kills_an_idle_engine(
        port: int, tmp_path: Path, cleanup: list[Any]) -> None:
    rank = _second_host(port, tmp_path / "rank.log")
    cleanup.append(rank)
    res = Resources(_config(2))
    cleanup.append(res.runner)
    async with open_engine(res.config, resources=res) as engine:
        rank.send_signal(signal.SIGSTOP)  # hung, not dead: its sockets stay open
        with trio.fail_after(60):  # a guard against a hang, not a latency bound
            while engine.alive:
                await trio.sleep(0.05)
        # Hung, not exited: only the missing heartbeat can have told the driver.
        assert f"tensor-parallel rank 1 (remote, at 127.0.0.1:{port}) sent no heartbeat" \
            in (engine.dead_reason or "")
        with pytest.raises(RequestError, match="rank 1"):
            await engine.submit(GenerateRequest("late", GREEDY, prompt="x"))
    rank.kill()


async def test_a_dead_driver_leaves_no_remote_rank_behind(
        port: int, tmp_path: Path, cleanup: list[Any]) -> None:
    # Two processes say RANK=1: the store lets one in, the other leaves at once.
    twins = [_second_host(port, tmp_path / f"rank{i}.log") for i in (0, 1)]
    cleanup.extend(twins)
    config = _config(2, topology="engine")  # the driver in a child: killable
    async with open_engine(config, resources=Resources(config)) as engine:
        assert engine.supervisor is not None
        driver = engine.supervisor.pids()["engine"]
        async for _ in engine.generate(GenerateRequest("warm", GREEDY, prompt="hi")):
            pass  # the group has run steps; now it idles in a broadcast
        with trio.fail_after(30):  # the loser may still be importing torch
            while all(t.poll() is None for t in twins):
                await trio.sleep(0.1)
        (twin,) = [i for i, t in enumerate(twins) if t.poll() is not None]
        assert twins[twin].returncode == 2
        assert f"actorllm: error: rank 1 has already joined the driver at 127.0.0.1:{port}" \
            in (tmp_path / f"rank{twin}.log").read_text()
        rank = twins[1 - twin]
        os.kill(driver, signal.SIGKILL)
        code = await trio.to_thread.run_sync(wait_exit, rank, 10.0)
        assert code == 4, (tmp_path / f"rank{1 - twin}.log").read_text()[-2000:]


def test_a_remote_rank_that_never_comes_is_a_start_up_error_naming_the_timeout(
        port: int) -> None:
    # The message names the configured timeout as the cause.
    with pytest.raises(ValueError, match=(
            rf"^tensor-parallel rank 1 did not join the rendezvous at 127.0.0.1:{port} "
            r"within 2 s \(start `actorllm rank` with RANK=1 WORLD_SIZE=2 on its host\)$")):
        Resources(_config(2, tensor_parallel_timeout=2.0))


def test_a_remote_rank_that_stops_while_loading_fails_start_up_by_its_heartbeat(
        port: int, tmp_path: Path, cleanup: list[Any]) -> None:
    from actorllm.wire.rendezvous import joined_key, rank_store

    rank = _second_host(port, tmp_path / "rank.log")
    cleanup.append(rank)
    errors: list[str] = []

    def driver() -> None:
        try:
            cleanup.append(Resources(_config(2)).runner)
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=driver)
    thread.start()
    # Read the driver's store as any client may; stop the rank once it has joined (its
    # shard then takes a second or so to load).
    store = rank_store("127.0.0.1", port, 60.0)
    while not store.check([joined_key(1)]):
        time.sleep(0.005)
    rank.send_signal(signal.SIGSTOP)
    thread.join(120.0)  # a guard against a hang
    assert not thread.is_alive()
    # The heartbeat, not the 60 s rendezvous timeout, ended the start-up.
    assert errors == [f"tensor-parallel rank 1 (remote, at 127.0.0.1:{port}) joined, then "
                      "sent no heartbeat for 3 s while loading"]


def test_a_remote_rank_with_another_world_size_is_refused_by_name(
        port: int, tmp_path: Path, cleanup: list[Any]) -> None:
    rank = _second_host(port, tmp_path / "rank.log", world=3)
    cleanup.append(rank)
    with pytest.raises(ValueError, match=r"^tensor-parallel rank 1 failed to start: "
                                         r"WORLD_SIZE=3, but the driver runs 2 ranks$"):
        Resources(_config(2))
    assert wait_exit(rank, 10.0) == 2  # and it says so on its own host, in one line
    lines = [x for x in (tmp_path / "rank.log").read_text().splitlines() if "error:" in x]
    assert lines == ["actorllm: error: WORLD_SIZE=3, but the driver runs 2 ranks"]


@pytest.mark.parametrize(("env", "want"), [
    ({}, "set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (torch.distributed's rendezvous"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK must be in [1, WORLD_SIZE-1] (rank 0 is the driver"),
    ({"RANK": "1", "WORLD_SIZE": "x"}, "MASTER_PORT, RANK and WORLD_SIZE must be integers"),
])
def test_the_rank_refuses_an_incomplete_rendezvous_environment(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: str) -> None:
    from actorllm.worker.rank_process import serve_rank

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if env:
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        serve_rank(timeout=0.1)
    assert str(err.value).startswith(want)


def test_the_rank_command_without_a_driver_fails_in_one_line_after_its_timeout() -> None:
    env = dict(os.environ)
    port = free_port()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "actorllm", "rank", "--timeout", "1"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    errors = [x for x in proc.stderr.splitlines() if x.startswith("actorllm: error: ")]
    assert errors == [f"actorllm: error: no tensor-parallel driver answered at "
                      f"127.0.0.1:{port} within 1 s"], proc.stderr


@pytest.mark.parametrize(("flags", "want"), [
    (["--tensor-parallel-local-ranks", "3"],
     "--tensor-parallel-local-ranks must be in [1, 2] (--tensor-parallel-size), got 3"),
    (["--tensor-parallel-timeout", "0"], "--tensor-parallel-timeout must be positive, got 0"),
])
def test_rendezvous_flags_out_of_range_are_one_line_cli_errors(
        capsys: pytest.CaptureFixture[str], flags: list[str], want: str) -> None:
    from actorllm.cli import main as cli_main

    assert cli_main(["run", "hi", "--tensor-parallel-size", "2", *flags]) == 2
    assert capsys.readouterr().err == f"actorllm: error: {want}\n"


def test_a_rendezvous_port_in_use_is_a_one_line_error() -> None:
    from actorllm.wire.rendezvous import Rendezvous, driver_store

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^cannot listen for tensor-parallel ranks on "
                                             rf"port {taken}: .*address already in use"):
            driver_store(Rendezvous("127.0.0.1", taken, 1, 5.0))


@pytest.mark.parametrize(("local", "timeout", "env", "want"), [
    (None, 300.0, {"MASTER_PORT": "4321"}, ("127.0.0.1", 0, 2, 300.0)),  # all local: any port
    (2, 300.0, {"MASTER_PORT": "4321"}, ("127.0.0.1", 0, 2, 300.0)),
    (1, 300.0, {}, ("127.0.0.1", 29500, 1, 300.0)),  # torchrun's default port
    (1, 9.0, {"MASTER_PORT": "1234"}, ("127.0.0.1", 1234, 1, 9.0)),
    (0, 300.0, {}, "--tensor-parallel-local-ranks must be in [1, 2]"),
    (1, 0.0, {}, "--tensor-parallel-timeout must be positive"),
    (1, 300.0, {"MASTER_PORT": "x"}, "MASTER_PORT must be an integer"),
])
def test_the_drivers_rendezvous_comes_from_its_settings_and_master_port(
        local: int | None, timeout: float, env: dict[str, str],
        want: tuple[Any, ...] | str) -> None:
    from actorllm.wire.rendezvous import Rendezvous

    if isinstance(want, str):
        with pytest.raises(ValueError, match=rf"^{re.escape(want)}"):
            Rendezvous.for_driver(2, local, timeout, env)
    else:
        r = Rendezvous.for_driver(2, local, timeout, env)
        assert (r.addr, r.port, r.local_ranks, r.timeout) == want
