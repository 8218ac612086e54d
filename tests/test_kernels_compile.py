"""Compile every ``actorllm/kernels/*.cu`` with nvcc for sm_80 and sm_90 and read ptxas's report.

Fails on a compile error, on a missing entry point, or on any register spill; prints the
registers and static shared memory of each kernel (``pytest -s``) and puts the same table in
the assertion message. Runs wherever ``nvcc`` is on PATH (no GPU needed); skipped otherwise.

A second test compiles one configuration of each source with NVRTC, exactly as the cuda
backend does at run time, when an NVRTC library can be found (CuPy's or NVIDIA's wheel).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from actorllm.ops import checks
from actorllm.ops.cuda_backend import (
    KERNEL_DIR,
    NVRTC_OPTIONS,
    config_defines,
    decode_smem_bytes,
    prefill_smem_bytes,
)

ARCHS = ("sm_80", "sm_90")
SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


def expected_entries(source: str) -> set[str]:
    """The extern "C" kernels each source must define (what cuda_backend.py looks up)."""
    configs = [
        ("bf16" if dtype == torch.bfloat16 else "f16", d, b)
        for dtype in checks.CUDA_DTYPES
        for d in checks.CUDA_HEAD_DIMS
        for b in checks.CUDA_BLOCK_SIZES
    ]
    if source == "reshape_and_cache.cu":
        return {"reshape_and_cache"}
    if source == "paged_decode.cu":
        return {f"paged_decode_{dt}_d{d}_b{b}" for dt, d, b in configs} | {
            f"paged_decode_reduce_{dt}_d{d}" for dt, d, _ in configs
        }
    if source == "paged_prefill.cu":
        return {f"paged_prefill_{dt}_d{d}_b{b}" for dt, d, b in configs}
    raise AssertionError(f"no expected entry points listed for actorllm/kernels/{source}")


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """``{kernel: {registers, spill_stores, spill_loads, smem}}`` from ``-Xptxas -v`` output."""
    stats: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = stats.setdefault(m.group(1), {"smem": 0})
        elif current is None:
            continue
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif m := re.search(r"Used (\d+) registers", line):
            current["registers"] = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                current["smem"] = int(s.group(1))
    return stats


def compile_nvcc(source: str, arch: str, out_dir: Path) -> tuple[int, str]:
    cmd = [
        NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-I", str(KERNEL_DIR),
        "-o", str(out_dir / f"{source}.{arch}.cubin"), str(KERNEL_DIR / source),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_kernels_compile_without_spills(tmp_path):
    assert SOURCES, f"no CUDA sources in {KERNEL_DIR}"
    jobs = [(s, a) for s in SOURCES for a in ARCHS]
    # Heaviest first, two at a time: the attention sources take ~15 s per arch.
    jobs.sort(key=lambda j: (KERNEL_DIR / j[0]).stat().st_size, reverse=True)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 2)) as pool:
        results = list(pool.map(lambda j: compile_nvcc(*j, tmp_path), jobs))

    failures, rows = [], []
    for (source, arch), (rc, output) in zip(jobs, results, strict=True):
        if rc != 0:
            failures.append(f"{source} [{arch}] failed to compile:\n{output[-4000:]}")
            continue
        stats = parse_ptxas(output)
        missing = expected_entries(source) - set(stats)
        if missing:
            failures.append(f"{source} [{arch}] lacks entry points {sorted(missing)}")
        for name, s in sorted(stats.items()):
            spills = (s.get("spill_stores", 0), s.get("spill_loads", 0))
            rows.append(
                f"{arch}  {name:<34} regs {s.get('registers', -1):>3}  static smem "
                f"{s['smem']:>5} B  spill st/ld {spills[0]}/{spills[1]}"
            )
            if any(spills):
                failures.append(f"{name} [{arch}] spills registers: {s}")
            if s.get("registers", 0) > 255:
                failures.append(f"{name} [{arch}] uses {s['registers']} registers")
    dynamic = [
        f"dynamic smem head_dim {d}: decode {decode_smem_bytes(d)} B, "
        f"prefill {prefill_smem_bytes(d)} B"
        for d in checks.CUDA_HEAD_DIMS
    ]
    report = "\n".join(rows + dynamic)
    print("\n" + report)
    assert not failures, "\n".join(failures) + "\n\n" + report


# ---------------------------------------------------------------------------- NVRTC


def find_nvrtc() -> str | None:
    """Path of an NVRTC shared library: $ACTORLLM_NVRTC, NVIDIA's pip wheel, or the system."""
    if path := os.environ.get("ACTORLLM_NVRTC"):
        return path
    for entry in sys.path:
        hits = sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return ctypes.util.find_library("nvrtc")


NVRTC = find_nvrtc()


def nvrtc_compile(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str, str]:
    """Compile with NVRTC; return (status, log, ptx)."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = b""
        if status == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.value
        return status, log.value.decode(errors="replace"), ptx.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.skipif(NVRTC is None, reason="no NVRTC library found (pip install cupy-cuda12x)")
@pytest.mark.parametrize(
    "source, dtype, head_dim, block_size",
    [
        ("reshape_and_cache.cu", None, None, None),
        ("paged_decode.cu", torch.float16, 128, 16),
        ("paged_prefill.cu", torch.bfloat16, 256, 32),
    ],
)
def test_kernels_compile_with_nvrtc(source, dtype, head_dim, block_size):
    """The run-time path: header pasted in, one configuration, no include path, no math.h."""
    from actorllm.ops.cuda_backend import kernel_source

    options = [*NVRTC_OPTIONS, "--gpu-architecture=compute_80"]
    if dtype is not None:
        options += config_defines(dtype, head_dim, block_size)
    status, log, ptx = nvrtc_compile(ctypes.CDLL(NVRTC), kernel_source(source), options)
    assert status == 0, log
    entries = set(re.findall(r"\.entry (\w+)\(", ptx))
    dt = "bf16" if dtype == torch.bfloat16 else "f16"
    want = {
        "reshape_and_cache.cu": {"reshape_and_cache"},
        "paged_decode.cu": {
            f"paged_decode_{dt}_d{head_dim}_b{block_size}",
            f"paged_decode_reduce_{dt}_d{head_dim}",
        },
        "paged_prefill.cu": {f"paged_prefill_{dt}_d{head_dim}_b{block_size}"},
    }[source]
    assert entries == want  # exactly the one configuration asked for
