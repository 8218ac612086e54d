"""The one-op decode step (ops/cpu_step.py, kernels/cpu_decode_step.cpp) against the model.

The op runs the ops of ``LlamaForCausalLM.forward`` in the same order on the same
tensors, so its hidden states and the K/V it writes must be *equal* to the module's, not
merely close; greedy parity with transformers through the runner is checked on top, for
windowed models too (contexts past the window: prompts longer than it, decoding beyond).
The op is built with the machine's C++ compiler against torch's headers (g++ is part of
the project's machines); where it cannot be built the runner keeps the module, which
the last tests check.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_model, hf_greedy, hf_model, vector_body
from steps import Plans, execute
from test_models_families import build_family

from actorllm.model import ForwardBatch
from actorllm.model.llama import LlamaForCausalLM
from actorllm.ops import TorchBackend, cpu_step, op_library
from actorllm.ops.cpu_backend import CpuKernelError, build_library
from actorllm.ops.cpu_linear import PackedLinear
from actorllm.ops.cpu_step import DecodeStep, load_decode_step, why_not
from actorllm.wire.messages import NewSeqData, SamplingParams, ScheduledSeq, StepPlan
from actorllm.worker.packing import every_token_a_row
from actorllm.worker.runner import ModelRunner

BLOCK = 4
# Under the tests' longest contexts (12 in the bit-for-bit test, 30 in the parity one) and
# not a multiple of BLOCK, so a window starts inside a block.
WINDOW = 5
cpu_step.load_op_library()  # raises, saying why, where the op cannot be built here


def _decode_batch(lens: list[int], tables: list[list[int]], vocab: int, seed: int
                  ) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    width = max(len(t) for t in tables)
    pos = [n - 1 for n in lens]
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (len(lens),), generator=g),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK
                                   for t, p in zip(tables, pos, strict=True)]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32),
        sample_indices=torch.arange(len(lens)),
        max_seqlen_q=1, max_seqlen_k=max(lens), slots_valid=True)


def _random_caches(runner: ModelRunner, seed: int, copies: int
                   ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The runner's K/V caches' shapes filled with seeded noise, and ``copies`` clones."""
    g = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(k.shape, generator=g), torch.randn(v.shape, generator=g))
              for k, v in runner.kv_caches]
    return [caches] + [[(k.clone(), v.clone()) for k, v in caches] for _ in range(copies)]


@contextlib.contextmanager
def _num_threads(n: int) -> Iterator[None]:
    """The calling thread's torch thread count set to ``n`` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Mistral: Llama's shape with a sliding window on every layer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral",
                            tokenizer_dir=tokenizer_dir, seed=2, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def tiny_qwen2_windowed_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
                            ) -> Path:
    """Qwen2 whose ``layer_types`` window the second layer only."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-window"), "qwen2",
                            tokenizer_dir=tokenizer_dir, seed=3, use_sliding_window=True,
                            sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_qwen3_windowed_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
                            ) -> Path:
    """Qwen3 (q and k normed per head, random norm weights), second layer windowed."""
    return build_family(tmp_path_factory.mktemp("tiny-qwen3-window"), "qwen3", tokenizer_dir,
                        seed=4, use_sliding_window=True, sliding_window=WINDOW,
                        max_window_layers=1)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir",
                                        "tiny_qwen2_windowed_dir", "tiny_qwen3_windowed_dir"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    """Llama (no biases, untied), Qwen2 (qkv bias, tied embeddings), Mistral (every layer
    windowed), Qwen2 with one windowed layer and Qwen3 (q/k norms) with one."""
    return ModelRunner(request.getfixturevalue(request.param), num_blocks=200,
                       block_size=BLOCK)


def test_the_op_takes_each_layers_window(runner: ModelRunner) -> None:
    """The windows the op passes are the module's, layer by layer (0 for none)."""
    assert runner.decode_step is not None
    windows = [layer.self_attn.sliding_window for layer in runner.model.model.layers]
    assert runner.decode_step.windows == [w or 0 for w in windows]
    name = Path(runner._model_dir).name
    want = {"mistral": [WINDOW, WINDOW], "window": [None, WINDOW]}
    assert windows == next((w for key, w in want.items() if key in name), [None, None])
    assert len(runner.decode_step.qk_norms) == (4 if "qwen3" in name else 0)  # two a layer


@pytest.mark.parametrize("num_seqs", [1, 7, 9, 64, 65, 97])  # 9 and 65 pad to a bucket;
# 65 and 97 cross the op's blocks of 32 rows for the LM head and the draw (both teams)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_step_equals_the_module_bit_for_bit(runner: ModelRunner, num_seqs: int,
                                                   threads: int) -> None:
    _check_bit_for_bit(runner, num_seqs, threads)


@pytest.mark.parametrize("num_seqs", [2, 7, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_step_equals_the_module_on_the_avx2_body(runner: ModelRunner, num_seqs: int,
                                                        threads: int) -> None:
    """Capped at AVX2, as on a CPU without AVX-512: 2 to 32 rows take the op's own GEMM
    (kernels/cpu_small_mm.h) in the op and, through actorllm::linear, in the module."""
    with vector_body(1):
        _check_bit_for_bit(runner, num_seqs, threads)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def panel_runner(request: pytest.FixtureRequest) -> ModelRunner:
    """A runner loaded while the op's widest body is AVX2 (as on a CPU without AVX-512):
    its fp32 linears in panels (ops/cpu_linear.py), so an AVX-512 host runs them too.
    Llama (untied, no biases) and Qwen2 (qkv bias, tied embeddings)."""
    with vector_body(1):
        runner = ModelRunner(request.getfixturevalue(request.param), num_blocks=200,
                             block_size=BLOCK)
    linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.panels for m in linears)  # every width here is a multiple of 16
    return runner


@pytest.mark.parametrize("num_seqs", [1, 7, 33, 97])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_step_in_panels_equals_the_module(panel_runner: ModelRunner, num_seqs: int,
                                                 threads: int) -> None:
    """Weights in panels: every row count takes the op's panel GEMM, in the op (the LM
    head's blocks of rows included) and, through actorllm::linear, in the module; the
    body is the host's widest again, which the layout does not depend on."""
    _check_bit_for_bit(panel_runner, num_seqs, threads)


def test_panels_match_transformers(panel_runner: ModelRunner) -> None:
    """Greedy through a runner in panels (its prefill in the module, at many rows) against
    transformers' generate, and a prefill step in the op."""
    test_the_runner_runs_decode_steps_in_the_op_and_matches_transformers(panel_runner)
    test_prefill_in_the_op_a_row_per_token_matches_the_module(panel_runner, 2)


def _check_bit_for_bit(runner: ModelRunner, num_seqs: int, threads: int) -> None:
    assert runner.decode_step is not None
    rng = random.Random(num_seqs)
    blocks = list(range(runner.num_blocks))
    rng.shuffle(blocks)
    lens = [rng.randint(1, 12) for _ in range(num_seqs)]
    tables = []
    for n in lens:
        tables.append(blocks[:-(-n // BLOCK)])
        del blocks[:len(tables[-1])]
    batch = _decode_batch(lens, tables, runner.vocab_size, seed=num_seqs)
    caches, copies, more = _random_caches(runner, 1, copies=2)
    with _num_threads(threads), torch.inference_mode():
        want = runner.model(batch, caches, runner.backend)
        got = runner.decode_step(batch, copies)
        want_logits = runner.model.compute_logits(want)
        got_logits = runner.decode_step(batch, more, logits=True)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    assert runner.decode_step.makes_logits
    assert torch.equal(got_logits, want_logits)  # the final norm and LM head in the op
    # ... and the draw: the same uniforms from torch's generator, so the same tokens.
    temps = torch.tensor([0.0, 1.0, 0.7] * num_seqs)[:num_seqs]
    torch.manual_seed(num_seqs)
    with torch.inference_mode():
        drawn = runner.decode_step(batch, [(k.clone(), v.clone()) for k, v in caches],
                                   logits=True, temperature=temps, greedy_below=1e-5)
    torch.manual_seed(num_seqs)
    assert torch.equal(drawn, cpu_step.sample_rows(want_logits, temps, 1e-5))
    for (k, v), (k2, v2) in zip(caches, copies, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)  # the same K/V, in the same slots
    # ... and with the helper asked for (it shares the attention, the head and the draw
    # on a team of one; a team of two ignores it).
    torch.manual_seed(num_seqs)
    with _num_threads(threads), torch.inference_mode():
        shared = runner.decode_step(batch, [(k.clone(), v.clone()) for k, v in caches],
                                    logits=True, temperature=temps, greedy_below=1e-5,
                                    helper=True)
    assert torch.equal(shared, drawn)


def _helper_case(runner: ModelRunner, num_seqs: int = 100
                 ) -> tuple[ForwardBatch, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """A decode batch of ``num_seqs`` rows of random lengths (two blocks each at most),
    caches of noise and a temperature a row."""
    rng = random.Random(num_seqs)
    lens = [rng.randint(1, 2 * BLOCK) for _ in range(num_seqs)]
    tables = [[2 * i, 2 * i + 1][:-(-n // BLOCK)] for i, n in enumerate(lens)]
    batch = _decode_batch(lens, tables, runner.vocab_size, seed=num_seqs)
    (caches,) = _random_caches(runner, 5, copies=0)
    return batch, caches, torch.tensor([0.0, 1.0, 0.7, 2.0] * num_seqs)[:num_seqs]


def test_the_helper_changes_no_token_however_the_blocks_fall(tiny_llama_dir: Path) -> None:
    """The op's helper (kernels/cpu_step_helper.h) takes blocks of the attention, the head
    and the draw only if it wakes in time, so each call divides the rows differently:
    the hidden states and the tokens are those of the step thread alone every time."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=200, block_size=BLOCK)
    assert runner.decode_step is not None
    batch, caches, temps = _helper_case(runner)
    with _num_threads(1), torch.inference_mode():
        hidden = runner.decode_step(batch, caches)
        for _ in range(10):  # the attention's rows shared: the hidden states bit for bit
            assert torch.equal(runner.decode_step(batch, caches, helper=True), hidden)
        for seed in range(30):
            torch.manual_seed(seed)
            alone = runner.decode_step(batch, caches, logits=True, temperature=temps,
                                       greedy_below=1e-5)
            torch.manual_seed(seed)
            shared = runner.decode_step(batch, caches, logits=True, temperature=temps,
                                        greedy_below=1e-5, helper=True)
            assert torch.equal(shared, alone), seed


def test_an_error_in_a_shared_block_is_raised_and_the_helper_serves_on(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that throws, on the step thread or the helper, raises from the op call
    (the process lives), and the next call is served as before."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=200, block_size=BLOCK)
    step = runner.decode_step
    assert step is not None
    batch, caches, temps = _helper_case(runner)
    head = step.lm_head
    with _num_threads(1), torch.inference_mode():
        torch.manual_seed(0)
        want = step(batch, caches, logits=True, temperature=temps, greedy_below=1e-5)
        monkeypatch.setattr(step, "lm_head", torch.zeros(head.shape[0] + 1, head.shape[1]))
        for _ in range(5):
            with pytest.raises(RuntimeError):
                step(batch, caches, logits=True, temperature=temps, greedy_below=1e-5,
                     helper=True)
        monkeypatch.setattr(step, "lm_head", head)
        torch.manual_seed(0)
        got = step(batch, caches, logits=True, temperature=temps, greedy_below=1e-5,
                   helper=True)
    assert torch.equal(got, want)


def test_a_forked_child_gets_a_helper_of_its_own(tiny_llama_dir: Path) -> None:
    """The helper thread does not survive a fork: the child's first shared step makes it
    a new one instead of posting to a thread that is not there (or to a lock it held)."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=200, block_size=BLOCK)
    step = runner.decode_step
    assert step is not None
    batch, caches, temps = _helper_case(runner)

    def draw() -> torch.Tensor:
        torch.manual_seed(0)
        with _num_threads(1), torch.inference_mode():
            return step(batch, caches, logits=True, temperature=temps, greedy_below=1e-5,
                        helper=True)

    want = draw()  # the parent's helper exists from here on
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a deadlock ends at the alarm, not in a hung test
        signal.alarm(120)
        ok = torch.equal(draw(), want) and torch.equal(draw(), want)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and answer == b"1", (status, answer)


def test_the_runner_runs_decode_steps_in_the_op_and_matches_transformers(
        runner: ModelRunner) -> None:
    """Greedy through the runner (every step by the op, the prefill a row per token)
    against transformers' generate on the same weights."""
    model_dir = runner._model_dir
    hf = hf_model(model_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = {"a": [0, *range(30, 47)], "b": [0, 9, 200, 7]}
    want = {rid: hf_greedy(hf, p, 12)[0] for rid, p in prompts.items()}
    free = list(range(runner.num_blocks))
    random.Random(3).shuffle(free)
    tables = {rid: [free.pop() for _ in range(-(-(len(p) + 12) // BLOCK))]
              for rid, p in prompts.items()}
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    before, before_logits = runner.one_op_steps, runner.logits_in_op_steps
    before_drawn = runner.drawn_in_op_steps
    plans = Plans()
    for step in range(12):
        seqs = []
        for rid, p in prompts.items():
            if step == 0:
                seqs.append(ScheduledSeq(rid, tuple(p), 0, tuple(tables[rid]), True,
                                         NewSeqData(greedy, tuple(p))))
            else:
                seqs.append(ScheduledSeq(rid, (got[rid][-1],), len(p) + step - 1,
                                         tuple(tables[rid]), True, None))
        result = execute(runner, step + 1, seqs, plans=plans)
        assert result.error is None, result.error
        for t in result.tokens:
            got[t.rid].append(t.token_id)
    runner.execute(StepPlan(13, drop=tuple(prompts)))
    assert runner.one_op_steps - before == 12  # the prefill too
    assert runner.logits_in_op_steps - before_logits == 11  # LM head in it after the prefill
    assert runner.drawn_in_op_steps - before_drawn == 11  # ... and the argmax
    assert got == want


def _prefill_batch(starts: list[int], chunks: list[int], tables: list[list[int]], vocab: int
                   ) -> ForwardBatch:
    """Rows of ``chunks[i]`` tokens from position ``starts[i]`` (a cached prefix before it)."""
    g = torch.Generator().manual_seed(len(chunks))
    width = max(len(t) for t in tables)
    pos = [p for s, c in zip(starts, chunks, strict=True) for p in range(s, s + c)]
    row = [i for i, c in enumerate(chunks) for _ in range(c)]
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + c)
    seq_lens = torch.tensor(starts, dtype=torch.int32) + torch.tensor(chunks, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (len(pos),), generator=g),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK
                                   for i, p in zip(row, pos, strict=True)]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        seq_lens=seq_lens,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        sample_indices=torch.tensor(cu[1:]) - 1,
        max_seqlen_q=max(chunks), max_seqlen_k=int(seq_lens.max()),
        slots_valid=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_in_the_op_a_row_per_token_matches_the_module(runner: ModelRunner,
                                                              threads: int) -> None:
    """A mixed step (prompt chunks, one after a cached prefix, and a decode row) through the
    op, every token a row, against the module. Its attention sums in another order than
    the module's SDPA, so close rather than equal; the K/V it writes, the hidden states
    and the greedy tokens."""
    assert runner.decode_step is not None
    starts, chunks = [0, 8, 0, 11], [13, 9, 1, 1]  # 13 and 9 cross the window of 5
    blocks = list(range(runner.num_blocks))
    random.Random(5).shuffle(blocks)
    tables = []
    for s, c in zip(starts, chunks, strict=True):
        tables.append(blocks[:-(-(s + c) // BLOCK)])
        del blocks[:len(tables[-1])]
    batch = _prefill_batch(starts, chunks, tables, runner.vocab_size)
    rows = every_token_a_row(batch)
    assert DecodeStep.applies(rows) and not DecodeStep.applies(batch)
    assert rows.seq_lens.tolist() == (batch.positions + 1).tolist()
    caches, copies = _random_caches(runner, 2, copies=1)
    with _num_threads(threads), torch.inference_mode():
        want = runner.model(batch, caches, runner.backend)
        got = runner.decode_step(rows, copies)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (k, v), (k2, v2) in zip(caches, copies, strict=True):
        torch.testing.assert_close(k2, k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v2, v, rtol=1e-4, atol=1e-4)
    logits = runner.model.compute_logits
    assert torch.equal(logits(got[batch.sample_indices]).argmax(-1),
                       logits(want[batch.sample_indices]).argmax(-1))


def test_only_one_token_per_sequence_batches_with_valid_slots_apply() -> None:
    batch = _decode_batch([3, 5], [[0], [1, 2]], 100, seed=0)
    assert DecodeStep.applies(batch)
    prefill = ForwardBatch(**{**batch.__dict__, "max_seqlen_q": 2})
    assert not DecodeStep.applies(prefill)
    unchecked = ForwardBatch(**{**batch.__dict__, "slots_valid": False})
    assert not DecodeStep.applies(unchecked)


def test_models_the_op_does_not_cover_keep_the_module(tiny_llama_dir: Path) -> None:
    torch_runner = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=BLOCK,
                               attention_backend="torch")
    assert torch_runner.decode_step is None
    assert "not 'cpu'" in why_not(torch_runner.model, TorchBackend())
    bf16 = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=BLOCK,
                       dtype=torch.bfloat16)
    assert bf16.decode_step is None
    assert isinstance(bf16.model, LlamaForCausalLM)
    with pytest.raises(ValueError, match="cannot run this model"):
        DecodeStep(torch_runner.model, TorchBackend())  # type: ignore[arg-type]


def test_a_failed_build_keeps_the_module(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    """No C++ compiler: the build says so in one line, and the runner runs the module."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("ACTORLLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(CpuKernelError, match="no-such-c"):
        op_library.build_op_library()

    def no_library() -> Path:
        raise CpuKernelError("no C++ compiler found")

    monkeypatch.setattr(cpu_step, "load_op_library", no_library)
    with caplog.at_level("INFO", logger="actorllm.ops.cpu_step"):
        runner = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=BLOCK)
    assert runner.decode_step is None
    assert "no C++ compiler" in caplog.text
    assert load_decode_step(runner.model, runner.backend) is None


def test_a_compile_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "broken.cpp").write_text("int f() { return undefined_name; }\n")
    monkeypatch.setenv("ACTORLLM_KERNEL_DIR", str(kernels))
    with pytest.raises(CpuKernelError, match=r"broken\.cpp: .*undefined_name") as info:
        build_library("broken.cpp", "g++", ["-shared", "-fPIC"], cache_dir=tmp_path / "c")
    assert "\n" not in str(info.value)
