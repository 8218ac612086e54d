"""The whole engine on a GPU: the cuda attention backend gives the torch backend's tokens.

Skipped, with the reason shown, where torch sees no GPU or CuPy cannot be imported.
Greedy decoding in bf16 and fp16 on a small random Llama with head_dim 64 (a size the kernels
serve); both runs use the same weights on the same GPU, so only attention differs.

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

PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog " * 3, "a", "x y z " * 20]


def near_tie(
    model_dir: Path, ids: list[int], a: int, b: int, dtype: torch.dtype
) -> tuple[float, float]:
    """fp32 logit gap between tokens ``a`` and ``b`` after ``ids``, and the largest logit
    error of the same model run in ``dtype`` there."""
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        ref = hf_model(model_dir).to("cuda")(x).logits[0, -1].float()
        half = hf_model(model_dir).to("cuda", dtype)(x).logits[0, -1].float()
    return abs(float(ref[a] - ref[b])), float((half - ref).abs().max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_backend_matches_torch_backend_end_to_end(tmp_path: Path, tokenizer_dir: Path,
                                                       dtype: str) -> None:
    model = build_tiny_model(tmp_path / "m", "llama", tokenizer_dir=tokenizer_dir,
                             hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, intermediate_size=512)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cuda"):
        llm = LLM(model=str(model), device="cuda", dtype=dtype, attention_backend=backend,
                  block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
        assert llm.resources.runner.backend_name == backend
        outs[backend] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
    for ids, x, y in zip(prompts, outs["torch"], outs["cuda"], strict=True):
        assert len(x) == len(y) == 32
        if x == y:
            continue
        i = next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
        gap, noise = near_tie(model, ids + x[:i], x[i], y[i], getattr(torch, dtype))
        assert gap <= noise, f"token {i}: picks {x[i]} vs {y[i]} are {gap:.4f} apart in fp32, " \
                             f"beyond the {dtype} model's own error {noise:.4f}"
