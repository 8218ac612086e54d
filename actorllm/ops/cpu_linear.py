"""Linear layers on the CPU with weights laid out once, at load, for the GEMM that runs them.

fp32 (every native model on the CPU; panels below aside): the weight is stored
transposed, ``[in, out]`` row-major, and a linear is one ``torch.mm`` (``addmm`` with a
bias). ``F.linear`` hands MKL the ``[out, in]`` weight to be read transposed, and MKL
repacks it on every call; for the small batches of a decode step that packing is a large
share of the work (on ``[in, out]`` MKL still copies blocks of it: panels, below). oneDNN's
``_linear_pointwise`` with a weight it had reordered (what this module did until issue
28) skipped the repacking but costs ~18 us a call before any arithmetic: on torch 2.13
with one thread, the embedded model's shapes ran 10-35 % slower than ``mm`` on the
transposed weight at 32 to 240 rows and 2-3x slower at 8, and the near-zero-compute
model's (hidden 64) 3-8x slower (docs/architecture.md, "Speed on the CPU"). ``mm`` needs
no row buckets either: MKL keeps no kernel per row count.

bf16 keeps oneDNN's packed weight, rows padded to :func:`bucket_rows` (oneDNN compiles
and caches a kernel per row count). The results differ from ``F.linear``'s in the last
bits (summation order), like any two GEMMs.

:func:`pack_linears` swaps the model's ``nn.Linear`` modules for :class:`PackedLinear`
where the weights are fp32 or bf16 on the CPU (bf16 only with a torch built with
oneDNN); elsewhere it changes nothing.

fp32 at 2 to 32 rows calls the decode op's ``actorllm::linear`` where its library loads
(ops/op_library.py): where MKL is weak (the op's ``own_gemm``: a CPU without AVX-512,
or an AVX-512 CPU that is not Intel's, on which MKL runs its generic kernels) it runs
those rows by its own GEMM (kernels/cpu_small_mm.h says why: MKL's cost 2-3x the
one-row step there), elsewhere it makes this module's call. The module and the op
(which runs most steps) so compute a linear the same way, bit for bit.

On such a CPU (``own_gemm`` when the model is packed) an fp32 weight whose output
width is a multiple of 16 is laid out in panels instead, ``[out / 16, in, 16]``, and
every call, at any row count, goes to the op's linear, which runs panels by its own
GEMM: MKL copied the weight into that shape again at every call, a fifth of a 64-row
step of the embedded model (kernels/cpu_small_mm.h; docs/architecture.md, "Weights in
panels" and "AVX-512 CPUs that are not Intel's"). The layout is fixed at load: the op
reads it from the weight's shape, not from the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actorllm.ops.cpu_backend import CpuKernelError
from actorllm.ops.op_library import load_op_library

log = logging.getLogger(__name__)

# The batch size oneDNN tunes the layout for; 64 rows measured best across 1 to 2048.
_BATCH_HINT = 64
# The rows the op's linear may run by its own GEMM (kernels/cpu_small_mm.h kSmallRows*).
SMALL_ROWS = range(2, 33)
# Columns of a panel (kernels/cpu_small_mm.h kPanel).
PANEL = 16


def bucket_rows(rows: int) -> int:
    """Rows padded up to one of a few sizes: multiples of 8 up to 128, then eight sizes
    per doubling, so padding adds at most an eighth.

    oneDNN compiles (and caches, up to 1,024 per process) a kernel for every row count
    it meets; without buckets a server's RSS grew by megabytes per few hundred requests
    of varied lengths. The grid was coarser (multiples of 64 from 64 to 512) until a
    decode step of 71 sequences was found to run its linears at 128 rows: 1.7x their
    time at 72 (the cost grows with the rows from 64 on; docs/architecture.md).
    """
    step = 1 << max(3, (rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def packing_available(weight: Tensor) -> bool:
    """Whether :class:`PackedLinear` can take this weight: fp32 on the CPU, or bf16 where
    oneDNN's packed linear exists."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return True
    return (weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def panels_wanted(op: Callable[..., Tensor] | None) -> bool:
    """Whether fp32 weights given the op's linear are laid out in panels: where the op
    runs its own GEMM now (``own_gemm``: its widest vector body AVX2, on a CPU without
    AVX-512 or under a test's cap, or an AVX-512 CPU that is not Intel's)."""
    return op is not None and bool(torch.ops.actorllm.own_gemm())


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference, its weight laid out for the GEMM: ``[in, out]`` for
    ``torch.mm`` in fp32, or the op's panels ``[out / 16, in, 16]`` (``panels``: where
    ``panels`` is asked and the width allows), oneDNN's blocked layout in bf16
    (``onednn``)."""

    def __init__(self, linear: nn.Linear, op: Callable[..., Tensor] | None = None,
                 panels: bool = False) -> None:
        super().__init__()
        # fp32 rows in SMALL_ROWS go to the op's linear where given (the module docstring).
        self.op = op
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.onednn = weight.dtype != torch.float32
        self.panels = (panels and op is not None and not self.onednn
                       and self.out_features % PANEL == 0)
        with torch.no_grad():
            if self.onednn:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
            elif self.panels:  # [out, in] -> [out / 16, 16, in] -> [out / 16, in, 16]
                packed = weight.reshape(-1, PANEL, self.in_features).transpose(1, 2) \
                    .contiguous()
            else:
                packed = weight.t().contiguous()
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if not self.onednn:  # the op (kernels/cpu_decode_step.cpp) makes the same call
            if self.op is not None and (self.panels or flat.shape[0] in SMALL_ROWS):
                out = self.op(flat, self.packed_weight, self.bias)
            elif self.bias is None:
                out = torch.mm(flat, self.packed_weight)
            else:
                out = torch.addmm(self.bias, flat, self.packed_weight)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
        rows = flat.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias,
                                                 "none", [], "")
        if padded == rows and x.dim() == 2:
            return out  # the model's case: no reshape or slice ops to dispatch
        return out[:rows].view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear` that computes the
    same within float rounding; returns how many were replaced (0 if the op is missing).

    A replacement is checked against ``F.linear`` on a few rows first; one that
    disagrees leaves the whole model as it was.
    """
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears or not all(packing_available(m.weight) for _, m in linears):
        return 0
    op = _op_linear() if linears[0][1].weight.dtype == torch.float32 else None
    panels = panels_wanted(op)
    swaps: list[tuple[nn.Module, str, PackedLinear]] = []
    for name, linear in linears:
        probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        try:
            packed = PackedLinear(linear, op, panels)
            with torch.no_grad():
                want = F.linear(probe, linear.weight, linear.bias).float()
                got = packed(probe).float()
        except RuntimeError as exc:  # (oneDNN's bf16 layout needs AVX-512 or AVX-NE-CONVERT)
            log.info("linears not laid out, kept as F.linear: %s", exc)
            return 0
        tol = 1e-4 if linear.weight.dtype == torch.float32 else 5e-2
        if not torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()):
            log.warning("packed linear %s disagrees with F.linear; keeping F.linear", name)
            return 0
        parent_name, _, attr = name.rpartition(".")
        swaps.append((model.get_submodule(parent_name) if parent_name else model, attr,
                      packed))
    for parent, attr, packed in swaps:
        setattr(parent, attr, packed)
    return len(swaps)


def _op_linear() -> Callable[..., Tensor] | None:
    """``torch.ops.actorllm.linear`` where the decode op's library builds and loads, else
    None (the module then calls ``mm``, and no op runs its steps either)."""
    try:
        load_op_library()
    except CpuKernelError as exc:
        log.info("linears call mm at every row count: %s", exc)
        return None
    return torch.ops.actorllm.linear
