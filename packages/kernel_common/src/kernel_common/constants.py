"""Numbers shared by several kernels and their host code, defined once."""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)
"""log2(e): the kernels compute softmax with exp2 on logits scaled by ``sm_scale * LOG2E``."""

LN2 = math.log(2.0)
"""ln(2): a log2-space lse (the kernels' unit) times LN2 is the natural-log lse of the API."""

HOPPER_SMEM_PER_BLOCK = 227 * 1024
"""Dynamic shared memory one thread block may opt into on sm_90 (232448 bytes)."""

HOPPER_SMEM_PER_SM = 228 * 1024
"""Shared memory of one sm_90 SM, of which 1 KB is reserved per resident thread block."""

SM_REGISTERS = 65536
"""32-bit registers of one SM (sm_80 / sm_90)."""

MAX_REGISTERS_PER_THREAD = 255
"""The most registers ptxas gives one thread."""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``max(n, 1)`` (index rows are padded to
    whole kernel blocks with -1; an empty row still gets one block)."""
    return -(-max(n, 1) // multiple) * multiple
