"""The whole engine on a GPU: the cuda attention backend gives the torch backend's tokens.

Skipped, with the reason shown, where torch sees no GPU or CuPy cannot be imported.
Greedy decoding in bf16 and fp16 on a small random Llama with head_dim 64 (a size the kernels
serve); both runs use the same weights on the same GPU, so only attention differs. The same
in bf16 for models that use the kernels' sliding window and soft-cap (issue 30): Gemma 2 and
Gemma 3 on the transformers path, windowed Mistral on the native one, with prompts longer
than the window.

Half-precision attention that sums in another order may flip a greedy pick where two tokens
are nearly tied, and after a flip the continuations differ for good. So the test does not
count agreeing tokens: where a prompt's two outputs differ, the first differing pick must be
a near-tie of the model itself: under transformers in fp32 the two tokens' logits must lie
within the error that the same model makes in the run's half precision at that position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_tiny_model, hf_model
from test_models_families import build_family
from transformers import AutoTokenizer

from actorllm import LLM, SamplingParams


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        return f"cupy is not importable: {type(exc).__name__}: {exc}"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

WINDOW = 16  # one block; shorter than two of the prompts
PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog " * 3, "a", "x y z " * 20]


def near_tie(
    model_dir: Path, ids: list[int], a: int, b: int, dtype: torch.dtype, device: str = "cuda"
) -> tuple[float, float]:
    """fp32 logit gap between tokens ``a`` and ``b`` after ``ids``, and the largest logit
    error of the same model run in ``dtype`` there (eager attention: the transformers
    implementation that applies every model's window and soft-cap)."""
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        ref = hf_model(model_dir, "eager").to(device)(x).logits[0, -1].float()
        half = hf_model(model_dir, "eager").to(device, dtype)(x).logits[0, -1].float()
    return abs(float(ref[a] - ref[b])), float((half - ref).abs().max())


def run_backends(model: Path, dtype: str, backends: tuple[str, ...], device: str = "cuda",
                 max_tokens: int = 32) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """The prompts' ids, and each backend's greedy tokens for them."""
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for backend in backends:
        llm = LLM(model=str(model), device=device, dtype=dtype, attention_backend=backend,
                  block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
        assert llm.resources.runner.backend_name == backend
        outs[backend] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
    return prompts, outs


def assert_same_or_near_tie(model: Path, prompts: list[list[int]], xs: list[list[int]],
                            ys: list[list[int]], dtype: str, device: str = "cuda") -> None:
    """Each prompt's two outputs are equal, or first differ at a near-tie of the model."""
    for ids, x, y in zip(prompts, xs, ys, strict=True):
        assert len(x) == len(y)
        if x == y:
            continue
        i = next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
        gap, noise = near_tie(model, ids + x[:i], x[i], y[i], getattr(torch, dtype), device)
        assert gap <= noise, f"token {i}: picks {x[i]} vs {y[i]} are {gap:.4f} apart in fp32, " \
                             f"beyond the {dtype} model's own error {noise:.4f}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_backend_matches_torch_backend_end_to_end(tmp_path: Path, tokenizer_dir: Path,
                                                       dtype: str) -> None:
    model = build_tiny_model(tmp_path / "m", "llama", tokenizer_dir=tokenizer_dir,
                             hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, intermediate_size=512)
    prompts, outs = run_backends(model, dtype, ("torch", "cuda"))
    assert all(len(x) == 32 for x in outs["torch"] + outs["cuda"])
    assert_same_or_near_tie(model, prompts, outs["torch"], outs["cuda"], dtype)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_window_and_softcap_models_cuda_matches_torch(tmp_path: Path, tokenizer_dir: Path,
                                                      family: str) -> None:
    """The kernels' sliding window and soft-cap inside whole models, against the torch
    backend: Gemma 2 (window, attention and final soft-caps) and Gemma 3 (window and full
    layers interleaved) through the transformers path, Mistral through the native one."""
    model = build_family(tmp_path / family, family, tokenizer_dir, hidden_size=256,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512, sliding_window=WINDOW)
    prompts, outs = run_backends(model, "bfloat16", ("torch", "cuda"))
    assert sum(len(p) > WINDOW for p in prompts) >= 2
    assert_same_or_near_tie(model, prompts, outs["torch"], outs["cuda"], "bfloat16")
