"""A model the engine cannot serve is one line: a ``ValueError`` from ``LLM``, exit 2 from
the CLI, never a traceback. One case each: not a causal LM, an encoder-decoder, a vision
model, missing weights, a tensor of the wrong shape, a device/dtype that cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_families import build_family

from actorllm.llm import LLM


def _config_only(path: Path, tokenizer_dir: Path, config: Any) -> Path:
    """A directory with the tokenizer and a config (and no weights: never reached)."""
    from transformers import AutoTokenizer

    path.mkdir(parents=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    config.save_pretrained(str(path))
    return path


def _edit_weights(model_dir: Path, edit: Any) -> Path:
    file = model_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return model_dir


def _cases(tmp_path: Path, tokenizer_dir: Path) -> dict[str, tuple[Path, str, dict[str, Any]]]:
    """name -> (model dir, what the one line must say, engine arguments)."""
    from transformers import BertConfig, T5Config, ViTConfig

    bert = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=2, intermediate_size=64,
                      architectures=["BertForMaskedLM"])
    t5 = T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                  architectures=["T5ForConditionalGeneration"])
    vit = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, architectures=["ViTForImageClassification"])
    gemma = build_family(tmp_path / "missing", "gemma2", tokenizer_dir)
    _edit_weights(gemma, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    olmo = build_family(tmp_path / "shape", "olmo2", tokenizer_dir)
    _edit_weights(olmo, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight",
                                                 torch.zeros(64, 48)))
    llama = build_family(tmp_path / "llama", "llama", tokenizer_dir)
    return {
        "not-causal": (_config_only(tmp_path / "bert", tokenizer_dir, bert),
                       "BertForMaskedLM is not a causal language model", {}),
        "encoder-decoder": (_config_only(tmp_path / "t5", tokenizer_dir, t5),
                            "encoder-decoder", {}),
        "vision": (_config_only(tmp_path / "vit", tokenizer_dir, vit),
                   "not a language model", {}),
        "missing-weights": (gemma, "missing tensor 'model.layers.1.mlp.up_proj.weight'", {}),
        "shape": (olmo, "'model.layers.0.self_attn.o_proj.weight' has the wrong shape", {}),
        "device-dtype": (llama, "--device cuda", {"device": "cuda", "dtype": "bfloat16"}),
    }


CASES = ["not-causal", "encoder-decoder", "vision", "missing-weights", "shape", "device-dtype"]


@pytest.mark.parametrize("case", CASES)
def test_llm_raises_one_line(case: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    if case == "device-dtype" and torch.cuda.is_available():
        pytest.skip("a GPU is here: the case needs a machine without one")
    model_dir, says, engine = _cases(tmp_path, tokenizer_dir)[case]
    with pytest.raises(ValueError) as err:
        LLM(str(model_dir), num_kv_blocks=64, **engine)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cli_exits_2_with_one_line(tmp_path: Path, tokenizer_dir: Path) -> None:
    cases = _cases(tmp_path, tokenizer_dir)
    names = ("encoder-decoder", "missing-weights", "shape")
    # The three at once: each spends its time importing torch, not in the case itself.
    procs = {name: subprocess.Popen([sys.executable, "-m", "actorllm", "run", "--model",
                                     str(cases[name][0]), "--num-kv-blocks", "64", "hello"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in names}
    try:
        for name, proc in procs.items():
            _, stderr = proc.communicate(timeout=300)
            lines = stderr.strip().splitlines()
            assert proc.returncode == 2, (name, stderr)
            assert len(lines) == 1 and cases[name][1] in lines[0], (name, lines)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_vision_config_with_a_vocabulary_is_still_refused(tmp_path: Path,
                                                          tokenizer_dir: Path) -> None:
    """A vision-language config (text_config has a vocabulary) is named a vision model."""
    from transformers import AutoTokenizer

    path = tmp_path / "llava"
    path.mkdir()
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": {"model_type": "llama", "vocab_size": 100, "hidden_size": 32,
                        "num_hidden_layers": 1, "num_attention_heads": 2,
                        "intermediate_size": 64},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32,
                          "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 64},
    }))
    with pytest.raises(ValueError, match="is a vision model"):
        LLM(str(path), num_kv_blocks=64)
