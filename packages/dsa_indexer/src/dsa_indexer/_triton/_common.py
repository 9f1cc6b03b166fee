"""Launch-side helpers shared by the indexer's Triton kernels."""

from __future__ import annotations

import torch


def check_head_dim(op: str, d: int) -> None:
    """The kernels index the head dimension with ``tl.arange``: a power of two, and at least
    16, the smallest tensor-core operand."""
    if d < 16 or d & (d - 1):
        raise ValueError(f"{op}: the head dim D must be a power of two >= 16, got {d}")


def interpreted(device: torch.device) -> bool:
    """Whether a kernel launched on ``device`` runs under the Triton interpreter.

    CPU tensors only reach a Triton kernel under ``TRITON_INTERPRET=1``. Two of its numpy
    emulations differ from the GPU: ``tl.dot`` has no bf16 path (it multiplies the raw bit
    patterns), so the kernels upcast their dot operands to fp32 there (exact for bf16 values,
    up to fp32 summation order); and its fp32 -> bf16 cast truncates where the GPU's rounds to
    nearest, so bf16 outputs are written as fp32 there and rounded by torch.
    """
    return device.type == "cpu"
