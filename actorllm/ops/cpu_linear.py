"""Linear layers on the CPU with weights that oneDNN has laid out for its own GEMM.

``F.linear`` on the CPU goes to MKL's sgemm, which repacks the weight on every call;
for the small batches of a decode step (8 to 64 rows against a 256 x 1408 weight) that
packing is a large share of the work, and MKL's threading gained nothing on this
machine. oneDNN's ``_linear_pointwise`` with a weight reordered once at load time
(``_reorder_linear_weight``, what inductor's CPU backend uses) skips both: measured on
the embedded model's 25 matmuls of one step, 2 threads, 1.7x faster at 8 rows and 1.3x
at 64, and no slower for a 2048-token prefill. The results differ from MKL's in the
last bits (summation order), like any two GEMMs.

:func:`pack_linears` swaps the model's ``nn.Linear`` modules for :class:`PackedLinear`
where the op exists (a torch built with oneDNN) and the weights are fp32 or bf16 on
the CPU; elsewhere it changes nothing.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

# The batch size oneDNN tunes the layout for; 64 rows measured best across 1 to 2048.
_BATCH_HINT = 64


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
    """Whether oneDNN's packed linear can take this weight."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference, its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                             _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
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
    swaps: list[tuple[nn.Module, str, PackedLinear]] = []
    for name, linear in linears:
        packed = PackedLinear(linear)
        probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        with torch.no_grad():
            want = F.linear(probe, linear.weight, linear.bias).float()
            got = packed(probe).float()
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
