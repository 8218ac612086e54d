"""Data-parallel replicas on other hosts (actorllm/topology/remote.py, ``actorllm replica``).

Every test plays both hosts on loopback: the main host (this process, or an ``actorllm
serve`` the test starts) runs with ``--data-parallel-size 2
--data-parallel-local-replicas 1`` and ``MASTER_ADDR``/``MASTER_PORT``, and the test
starts replica 1 itself as the README tells a second host to: ``python -m actorllm
replica`` with ``RANK`` and ``WORLD_SIZE`` in its environment, not a child of the main
host, which has no process handle on it. What is checked: its greedy tokens equal
transformers', requests spread over both replicas and drain; a second process with the
same RANK is refused; a clean stop ends it with 0; its SIGKILL with ``stay`` fails only
its requests within the heartbeat timeout while the engine serves on; the main host's
death makes it leave (4); a replica that never comes, or comes with the wrong
``WORLD_SIZE``, is a one-line start-up error on both sides; one inbox hears ipc and TCP
edges, each in order. What is not: two real hosts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import collect_all, free_port, greedy_expectations, other_host, wait_exit
from test_data_parallel import MAX_TOKENS, PROMPTS, _outcome, _streaming, dp_config, greedy, sample

from actorllm import cli
from actorllm.config import EngineConfig
from actorllm.engine.async_engine import open_engine
from actorllm.llm import collect, make_request
from actorllm.topology import EngineStartError
from actorllm.wire.messages import AbortRequest, SchedulerInput
from actorllm.wire.outputs import RequestError
from actorllm.wire.transport import IpcDir, ZmqInbox, ZmqOutbox

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


async def test_one_inbox_hears_ipc_and_tcp_edges_each_in_order_and_a_late_connect() -> None:
    # The main host's Detokenizer inbox: local replicas over ipc, remote ones over TCP
    # (bound on any port, read back), and an outbox made before it knows where to send.
    ipc = IpcDir()
    inbox: ZmqInbox[Any] = ZmqInbox("detokenizer", SchedulerInput, 8, ipc.endpoint("d.sock"))
    tcp = inbox.bind("tcp://0.0.0.0:0")
    assert re.fullmatch(r"tcp://0\.0\.0\.0:\d+", tcp) and not tcp.endswith(":0")
    near = ZmqOutbox(ipc.endpoint("d.sock"), SchedulerInput, name="near")
    far = ZmqOutbox(None, SchedulerInput, name="far")
    far.connect(tcp.replace("0.0.0.0", "127.0.0.1"))
    sent = {box.name: [AbortRequest(f"{box.name}{i}") for i in range(200)]
            for box in (near, far)}
    try:
        async with trio.open_nursery() as nursery:
            for box in (near, far):
                async def produce(box: ZmqOutbox[Any] = box) -> None:
                    for m in sent[box.name]:
                        await box.send(m)
                nursery.start_soon(produce)
            got = [await inbox.receive() for _ in range(400)]
            nursery.cancel_scope.cancel()
        for name, msgs in sent.items():  # each edge FIFO, whatever the interleaving
            assert [m for m in got if m.rid.startswith(name)] == msgs
    finally:
        near.close()
        far.close()
        inbox.close()
        ipc.remove()


def _config(model: Path, **kw: Any) -> EngineConfig:
    """Replica 0 here, replica 1 from the other host."""
    return dp_config(model, **{"data_parallel_local_replicas": 1,
                               "data_parallel_timeout": 60.0, **kw})


def _replica(port: int, log: Path, model: Path, **kw: Any) -> subprocess.Popen[bytes]:
    return other_host("replica", port, log, model, **kw)


async def test_a_replica_on_another_host_serves_like_a_local_one_and_stops_with_0(
        port: int, tmp_path: Path, cleanup: list[Any], tiny_llama_dir: Path,
        tiny_tokenizer: Any) -> None:
    # Two processes say RANK=1: the store lets one in, the other leaves at once.
    twins = [_replica(port, tmp_path / f"replica{i}.log", tiny_llama_dir) for i in (0, 1)]
    cleanup.extend(twins)
    # transformers' (before the engine: it would stall its event loop)
    wants = greedy_expectations(tiny_llama_dir, tiny_tokenizer, PROMPTS, MAX_TOKENS)
    async with open_engine(_config(tiny_llama_dir)) as engine:
        assert engine.supervisor is not None
        assert list(engine.supervisor.pids()) == ["engine0"]  # replica 1 is nobody's child
        results = await collect_all(engine, PROMPTS, greedy())
        assert [sample(engine, "replica_requests_routed_total", replica=str(r))
                for r in (0, 1)] == [2.0, 2.0]
        assert sample(engine, "replica_engine_steps_total", replica="1") > 0
        for prompt, res in zip(PROMPTS, results, strict=True):
            (out,) = res.outputs
            assert (tuple(out.token_ids), out.text) == wants[prompt]
        assert await engine.wait_drained(timeout=15) == []  # the remote one answers too
        with trio.fail_after(30):  # the loser may still be importing torch
            while all(t.poll() is None for t in twins):
                await trio.sleep(0.1)
        (loser,) = [i for i, t in enumerate(twins) if t.poll() is not None]
        assert twins[loser].returncode == 2
        assert (f"actorllm: error: data-parallel replica 1 has already joined the main host "
                f"at 127.0.0.1:{port}") in (tmp_path / f"replica{loser}.log").read_text()
    winner = twins[1 - loser]
    code = await trio.to_thread.run_sync(wait_exit, winner, 10.0)
    assert code == 0, (tmp_path / f"replica{1 - loser}.log").read_text()[-2000:]


async def test_a_killed_remote_replica_fails_only_its_requests_with_stay(
        port: int, tmp_path: Path, cleanup: list[Any], tiny_llama_dir: Path) -> None:
    replica = _replica(port, tmp_path / "replica.log", tiny_llama_dir)
    cleanup.append(replica)
    async with open_engine(_config(tiny_llama_dir, on_engine_death="stay")) as engine:
        collectors = await _streaming(engine, 4)
        on = {rid: engine.frontend.registry[rid].replica for rid in collectors}
        assert sorted(on.values()) == [0, 0, 1, 1]
        replica.kill()  # no process handle on the main host's side: only silence
        with trio.fail_after(60):  # a guard against a hang; the message names the cause
            outcomes = {rid: await _outcome(col) for rid, col in collectors.items() if on[rid]}
        ((message, code),) = {(str(e), e.code) for e in outcomes.values() if e}
        assert all(outcomes.values()) and code == "engine_dead"
        assert re.fullmatch(r"engine1 \(remote, on \S+ 127\.0\.0\.1\) stopped responding \(no "
                            r"heartbeat for \d+\.\d s\): it died, hung or lost the network",
                            message), message
        for rid, col in collectors.items():
            if not on[rid]:
                assert await _outcome(col) is None
        assert engine.alive
        res = await collect(engine, "after", PROMPTS[0], greedy())
        assert res.error is None and len(res.outputs[0].token_ids) == MAX_TOKENS
        assert sample(engine, "replica_up", replica="1") == 0.0
        assert sample(engine, "replica_deaths_total") == 1.0
        assert await engine.wait_drained(timeout=15) == []


async def test_a_stopped_remote_replica_without_stay_kills_the_engine(
        port: int, tmp_path: Path, cleanup: list[Any], tiny_llama_dir: Path) -> None:
    replica = _replica(port, tmp_path / "replica.log", tiny_llama_dir)
    cleanup.append(replica)
    async with open_engine(_config(tiny_llama_dir)) as engine:
        collectors = await _streaming(engine, 2)
        (rid,) = [r for r in collectors if engine.frontend.registry[r].replica == 1]
        replica.send_signal(signal.SIGSTOP)  # hung, not dead: its sockets stay open
        error = await _outcome(collectors[rid])
        assert error is not None and error.code == "engine_dead"
        assert str(error).startswith("engine1 (remote, on ")
        assert not engine.alive  # (replica 0's request may have finished by then)
        with pytest.raises(RequestError, match=r"^engine1 \(remote, on "):
            await engine.submit(make_request("late", PROMPTS[0], greedy()))
    replica.kill()


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return int(r.status)
    except OSError:
        return None


def test_the_remote_replica_leaves_when_the_main_host_dies(
        port: int, tmp_path: Path, cleanup: list[Any], tiny_llama_dir: Path) -> None:
    replica = _replica(port, tmp_path / "replica.log", tiny_llama_dir)
    cleanup.append(replica)
    http = free_port()
    with (tmp_path / "main.log").open("wb") as log:  # the README's command for host A
        main = subprocess.Popen(
            [sys.executable, "-m", "actorllm", "serve", "--model", str(tiny_llama_dir),
             "--port", str(http), "--data-parallel-size", "2",
             "--data-parallel-local-replicas", "1", "--num-kv-blocks", "96"],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    cleanup.append(main)
    deadline = time.monotonic() + 90
    while _health(http) != 200:
        assert main.poll() is None, (tmp_path / "main.log").read_text()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    main.send_signal(signal.SIGKILL)
    assert wait_exit(replica, 10.0) == 4, (tmp_path / "replica.log").read_text()[-2000:]
    assert "the main host is gone" in (tmp_path / "replica.log").read_text()


async def test_a_replica_that_never_comes_is_a_start_up_error_after_the_timeout(
        port: int, tiny_llama_dir: Path) -> None:
    # The message names the configured timeout as the cause.
    with pytest.raises(EngineStartError, match=(
            rf"^data-parallel replica 1 did not join the rendezvous at 127.0.0.1:{port} "
            r"within 2 s \(start `actorllm replica` with RANK=1 WORLD_SIZE=2 on its host\)$")):
        async with open_engine(_config(tiny_llama_dir, data_parallel_timeout=2.0)):
            pass


async def test_a_replica_with_another_world_size_is_refused_on_both_sides(
        port: int, tmp_path: Path, cleanup: list[Any], tiny_llama_dir: Path) -> None:
    replica = _replica(port, tmp_path / "replica.log", tiny_llama_dir, world=3)
    cleanup.append(replica)
    with pytest.raises(EngineStartError, match=r"^data-parallel replica 1 failed to start: "
                                               r"WORLD_SIZE=3, but the main host runs 2 "
                                               r"replicas$"):
        async with open_engine(_config(tiny_llama_dir)):
            pass
    assert await trio.to_thread.run_sync(wait_exit, replica, 10.0) == 2
    lines = [x for x in (tmp_path / "replica.log").read_text().splitlines() if "error:" in x]
    assert lines == ["actorllm: error: WORLD_SIZE=3, but the main host runs 2 replicas"]


def test_a_replica_with_the_rank_of_a_local_one_is_refused_on_both_sides(
        port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The main host's side without its processes: its store, endpoints and config.
    from actorllm.topology.placement import MAIN, Wiring
    from actorllm.topology.remote import RemoteReplicas, serve_replica

    config = EngineConfig(topology="engine", data_parallel_size=3,
                          data_parallel_local_replicas=2)
    ipc = IpcDir()
    wiring = Wiring(MAIN, "engine", 8, ipc, replicas=3, local_replicas=2)
    ctl: ZmqInbox[Any] = ZmqInbox("parent.ctl", SchedulerInput, 8, ipc.endpoint("p.ctl"))
    try:
        remote = RemoteReplicas(config, wiring, ctl)
        assert sorted(wiring.deferred) == ["scheduler2.sock"]  # replica 2 is remote
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "3")
        want = ("RANK=1 is a replica the main host runs itself "
                "(--data-parallel-local-replicas 2): give RANK in [2, 2]")
        with pytest.raises(ValueError, match=rf"^{re.escape(want)}$"):
            serve_replica(timeout=5.0)
        assert remote.failed(1) == f"data-parallel replica 1 failed to start: {want}"
        assert not remote.joined(2)
        remote.close()
    finally:
        wiring.close()
        ctl.close()
        ipc.remove()


@pytest.mark.parametrize(("flags", "want"), [
    (["--data-parallel-size", "2", "--data-parallel-local-replicas", "3"],
     "--data-parallel-local-replicas must be in [1, 2] (--data-parallel-size), got 3"),
    (["--data-parallel-size", "2", "--data-parallel-local-replicas", "0"],
     "--data-parallel-local-replicas must be in [1, 2] (--data-parallel-size), got 0"),
    (["--data-parallel-local-replicas", "2"],
     "--data-parallel-local-replicas must be in [1, 1] (--data-parallel-size), got 2"),
    (["--data-parallel-size", "2", "--data-parallel-timeout", "0"],
     "--data-parallel-timeout must be positive, got 0"),
    (["--data-parallel-size", "2", "--data-parallel-local-replicas", "1",
      "--tensor-parallel-size", "2"],
     "--data-parallel-size and --tensor-parallel-size cannot both be above 1 yet"),
])
def test_bad_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str], flags: list[str],
                                       want: str) -> None:
    assert cli.main(["run", "hi", *flags]) == 2
    assert capsys.readouterr().err == f"actorllm: error: {want}\n"


@pytest.mark.parametrize(("env", "want"), [
    ({}, "set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (torch.distributed's rendezvous"),
    ({"RANK": "0", "WORLD_SIZE": "2"},
     "RANK must be in [1, WORLD_SIZE-1] (replica 0 runs on the main host, `actorllm serve`)"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "no data-parallel main host answered at 127.0.0.1:"),
])
def test_the_replica_refuses_a_bad_rendezvous_in_one_line(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: str) -> None:
    from actorllm.topology.remote import serve_replica

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if env:  # nobody listens at that port
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        serve_replica(timeout=0.5)
    assert str(err.value).startswith(want) and "\n" not in str(err.value)
