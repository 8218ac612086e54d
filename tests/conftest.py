"""Session-wide fixtures: a tiny BPE tokenizer and two tiny random-weight checkpoints.

``tokenizer_dir``: byte-level BPE (~400 ids; ``<|bos|>`` = 0, ``<|eos|>`` = 1, then
``<|user|>``, ``<|assistant|>``, ``<|system|>``, ``<|end|>``) with a chat template.
``tiny_llama_dir``: Llama, GQA 4/2 heads, head_dim 16, 2 layers, untied embeddings.
``tiny_qwen2_dir``: Qwen2, qkv bias, tied embeddings. Both hold the tokenizer files and a
generation config, so each is a complete model directory. Builders live in ``helpers.py``.

``port`` and ``cleanup``: for tests that play other hosts on loopback.

``resources`` (per module) and ``engine`` (per test): the tiny Llama behind a single-topology
engine; leaving ``engine`` asserts the engine drained (invariant 4) unless the test killed it.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_tiny_model, build_tokenizer, free_port, hf_greedy
from hypothesis import settings
from sim.profiles import register_profiles
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from actorllm.config import EngineConfig, default_model_dir
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.ops.cpu_backend import CpuKernelError, build_kernel
from actorllm.ops.op_library import build_op_library

# The tiny models are all per-op overhead: one intra-op thread is ~5x faster than two
# threads spinning against each other on a busy 2-core box (and right under pytest-xdist).
torch.set_num_threads(1)

# The C decode kernel and the one-op decode step are compiled on first use (~10 s here);
# build them now, so that no test's deadline pays for it. Without a compiler nothing is
# built here, and the tests of the two (test_ops_cpu, test_cpu_step) fail saying why.
with contextlib.suppress(CpuKernelError):
    build_kernel()
    build_op_library()

# `ci` unless --hypothesis-profile names another (hypothesis's plugin may load that one
# before or after this module is imported; either way it wins).
register_profiles()
if settings.get_current_profile_name() == "default":
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Every test starts on the one thread set above, whatever ran before it in this
    process: a ModelRunner given a thread count sets torch's (process-wide) count and
    leaves it so (``worker/sizing.torch_threads``), and under pytest-xdist which tests
    ran before is the scheduler's choice. Results that hold bit for bit only on one
    thread depended on that order."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the tiny tokenizer."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    """The tiny tokenizer, loaded with ``AutoTokenizer``."""
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def default_tokenizer() -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer, loaded with ``AutoTokenizer``."""
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="session")
def default_hf() -> Any:
    """The embedded model in transformers, float32, in eval mode (treat as read-only)."""
    return AutoModelForCausalLM.from_pretrained(default_model_dir(),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Llama checkpoint directory (treat as read-only)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer_dir=tokenizer_dir
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Qwen2 checkpoint directory (treat as read-only)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tokenizer_dir=tokenizer_dir, seed=1
    )


@pytest.fixture(scope="session")
def hf_greedy_fn() -> Callable[..., tuple[list[int], list[float]]]:
    """``hf_greedy(model_dir, prompt_ids, max_new_tokens) -> (new_ids, logprobs)``."""
    return hf_greedy


@pytest.fixture(scope="module")
def resources(tiny_llama_dir: Path) -> Resources:
    """The tiny Llama's loaded weights and tokenizer, shared by the engines of one module."""
    return Resources(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=128))


@pytest.fixture
async def engine(resources: Resources) -> AsyncIterator[AsyncEngine]:
    """An engine over ``resources``; on exit it must hold nothing (unless a test killed it)."""
    async with open_engine(resources.config, resources=resources) as eng:
        yield eng
        # A dead engine fails its requests rather than draining them; the tests that
        # kill it check that themselves.
        if not eng.died.is_set():
            assert await eng.wait_drained(30.0) == []


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> int:
    """The rendezvous of a driver (or main host) here with ranks (replicas) elsewhere:
    ``MASTER_ADDR``/``MASTER_PORT`` on loopback, a free port."""
    p = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(p))
    return p


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Things to close and processes to kill after the test, whatever it did."""
    things: list[Any] = []
    yield things
    for t in things:
        if isinstance(t, subprocess.Popen):
            if t.poll() is None:
                t.kill()
                t.wait()
        else:
            t.close()


@pytest.fixture
def hub(tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding ``tiny-org/tiny-llama`` (main and v2), offline."""
    from test_hub import fill_cache  # the layout huggingface_hub writes

    cache = tmp_path / "hub"
    fill_cache(cache, tmp_path, tokenizer_dir)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache
