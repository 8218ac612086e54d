"""The decode op's library (``kernels/cpu_decode_step.cpp``): built once per source, torch
and CPU with the machine's C++ compiler against the installed torch's headers, and
registered in the process as ``torch.ops.actorllm``. Its users are the one-op decode step
and sampling (:mod:`actorllm.ops.cpu_step`) and the linears at a few rows
(:mod:`actorllm.ops.cpu_linear`), which is why it is a module of its own: the step
imports the linears.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

from actorllm.ops.cpu_backend import CpuKernelError, build_library

__all__ = ["SOURCE", "build_op_library", "load_op_library"]

SOURCE = "cpu_decode_step.cpp"

_lock = threading.Lock()
_loaded: Path | None = None


def _torch_flags() -> tuple[list[str], list[str]]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # No FMA contraction: the fused RoPE must round as the module's separate ops do.
    flags = ["-O2", "-std=c++20", "-fPIC", "-shared", "-w", "-ffp-contract=off", "-fopenmp",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS",
             f"-I{root / 'include'}",
             # the version is in the key: a new torch rebuilds
             f"-DACTORLLM_TORCH_VERSION=\"{torch.__version__}\""]
    libs = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]
    return flags, libs


def build_op_library(cache_dir: Path | None = None) -> Path:
    """Compile the op (once per source, torch and CPU) and return the shared object."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise CpuKernelError("no C++ compiler found (set CXX, or install g++)")
    if not (Path(torch.__file__).parent / "include" / "torch" / "library.h").is_file():
        raise CpuKernelError("this torch has no C++ headers")
    flags, libs = _torch_flags()
    return build_library(SOURCE, cxx, flags, libs, cache_dir, timeout=300)


def load_op_library() -> Path:
    """Build the op if needed and register it in this process (once: a process can hold
    one library that defines ``torch.ops.actorllm``)."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        path = build_op_library()
        try:
            torch.ops.load_library(str(path))
        except OSError as exc:
            raise CpuKernelError(f"could not load {path.name}: {exc}") from exc
        _loaded = path
        return path
