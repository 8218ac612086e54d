"""CPU backend: the torch reference with decode attention in a small C kernel.

``actorllm/kernels/cpu_paged_decode.c`` reads each sequence's K/V in place through its block
table with an online softmax, instead of gathering the whole context into a padded
tensor first (the torch reference's decode path, most of its attention time). It takes a
sliding window (the walk starts ``window`` keys back) and a soft-cap too. Where the
compiler targets AVX-512 its scores, softmax and value sums are vector intrinsics (four
query heads a vector for the scores), the portable loops elsewhere; its header says why. Prefill
chunks and the KV write stay those of :class:`TorchBackend`, which is also the oracle
the kernel is tested against (tests/test_ops_cpu.py).

The kernel is compiled on first use with the machine's C compiler (``$CC``, else
``cc``/``gcc``) into ``$ACTORLLM_CACHE_DIR`` (default ``~/.cache/actorllm``), keyed
by the source, the flags and the CPU, and loaded with ctypes, which releases the GIL
during the call. Without a compiler, ``load_cpu_backend`` raises
``BackendUnavailable`` and ``select_backend("auto")`` keeps the torch backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from actorllm.ops.torch_backend import NO_FEATURES, Features, TorchBackend

log = logging.getLogger(__name__)

SOURCE = "cpu_paged_decode.c"
# Reassociation lets the compiler vectorize the dot products; no -ffast-math, whose
# finite-math assumption would break the kernel's -inf start of the running maximum.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-fPIC", "-shared", "-fopenmp")


class CpuKernelError(RuntimeError):
    """The C kernel could not be built or loaded; the message says why in one line."""


def _source(name: str) -> Path:
    root = os.environ.get("ACTORLLM_KERNEL_DIR") or str(
        importlib.resources.files("actorllm.kernels"))
    return Path(root) / name


def _cpu_key() -> str:
    # -march=native code is only valid on a CPU with the same features.
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def build_library(source: str, compiler: str, flags: Sequence[str],
                  libs: Sequence[str] = (), cache_dir: Path | None = None,
                  timeout: float = 120) -> Path:
    """Compile ``actorllm/kernels/<source>`` into a shared object, once per source text
    (with the headers beside it), compiler, flags and CPU, and return its path in the cache.

    ``compiler`` is a path or a name on ``PATH``; ``libs`` come after the source on the
    command line. ``CpuKernelError`` says in one line why a build failed.
    """
    src = _source(source)
    if not src.is_file():
        raise CpuKernelError(f"kernel source {src} is missing")
    # The headers beside the sources (cpu_exp16.h) are part of what is built.
    code = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
    key = " ".join((compiler, *flags, *libs, _cpu_key())).encode()
    digest = hashlib.sha256(code + key).hexdigest()
    cache = cache_dir or Path(os.environ.get("ACTORLLM_CACHE_DIR")
                              or Path.home() / ".cache" / "actorllm")
    target = cache / f"{src.stem}-{digest[:16]}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes that start at once never load half a file.
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, "-o", tmp, str(src), *libs],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if " error: " in line]
            first = (errors or proc.stderr.strip().splitlines() or ["(no output)"])[0]
            raise CpuKernelError(f"{compiler} failed on {src.name}: {first}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CpuKernelError(f"could not run {compiler}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s with %s", target.name, compiler)
    return target


def build_kernel(cache_dir: Path | None = None) -> Path:
    """Compile the decode kernel (once per source, flags and CPU) and return the shared
    object."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CpuKernelError("no C compiler found (set CC, or install gcc)")
    return build_library(SOURCE, cc, FLAGS, ("-lm",), cache_dir)


class CpuBackend(TorchBackend):
    """``TorchBackend`` with fp32 decode attention in the C kernel.

    ``num_threads`` threads split the (sequence, KV head) pairs; None follows
    ``torch.get_num_threads()`` at each call. Rows the kernel does not cover (another
    dtype, a head dim over 256, more than 16 query heads per KV head) take the torch path.
    """

    name = "cpu"

    def __init__(self, library: Path, num_threads: int | None = None) -> None:
        lib = ctypes.CDLL(str(library))
        fn = lib.paged_decode_f32_ex
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [
            ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.num_threads = num_threads
        #: The kernel's entry point (``paged_decode_f32_ex``: window and soft-cap arguments),
        #: for C++ that calls it directly (ops/cpu_step.py).
        self.kernel_address: int = ctypes.cast(fn, ctypes.c_void_p).value or 0

    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
        max_len: int, scale: float, extra: Features = NO_FEATURES,
    ) -> Tensor:
        """Decode attention by the kernel (sliding window and soft-cap included); the
        torch reference where it does not apply."""
        if not (
                q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype
                == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return super().decode(q, k_cache, v_cache, block_tables, seq_lens, max_len, scale,
                                  extra)
        # The engine passes int32, contiguous tables and lengths: test before converting,
        # since even a no-op conversion is an op dispatch (and GIL round trip) per layer.
        q = q if q.is_contiguous() else q.contiguous()
        tables, lens = (t if t.dtype is torch.int32 and t.is_contiguous()
                        else t.to(torch.int32).contiguous() for t in (block_tables, seq_lens))
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        threads = self.num_threads or torch.get_num_threads()
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                      lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, k_cache.shape[2],
                      head_dim, k_cache.shape[1], tables.shape[1], scale,
                      extra.sliding_window or 0, extra.softcap or 0.0, threads)
        if rc != 0:
            return super().decode(q, k_cache, v_cache, block_tables, seq_lens, max_len, scale,
                                  extra)
        return out


def load_cpu_backend(num_threads: int | None = None) -> CpuBackend:
    """Build (or find in the cache) and load the kernel; ``CpuKernelError`` if it cannot."""
    return CpuBackend(build_kernel(), num_threads)
