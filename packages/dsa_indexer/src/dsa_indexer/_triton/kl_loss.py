"""Triton kernels of the indexer KL loss: per-row loss, and the fused gradient w.r.t. the scores.

Row t has scores ``s`` and a target ``a`` over its ``topk`` slots; a slot is valid when its score
is finite. With ``A = sum(a)`` and ``lse = log sum(exp(s))`` over the valid slots,
``p = a / A`` and ``log q = s - lse``, the row's loss is ``sum p * (log p - log q)`` over the
valid slots with ``p > 0`` (``0 * log 0 = 0``: no log of 0 is ever taken) and its gradient
``q - p`` on the valid slots, 0 elsewhere. A row without a valid slot, or whose target has no
mass on them (``A == 0``, where the KL is undefined), adds 0 and gets a zero gradient.

One program per row walks the row in ``BLOCK``-column chunks twice: an online max / sum-exp /
target-sum pass, then the loss (forward) or the gradient (backward) pass. The backward recomputes
the statistics instead of keeping anything from the forward: two reads of ``[T, topk]`` and one
write, at the speed of memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per chunk: 1024 fp32 per step keep 8 registers per thread at 4 warps, and rows of
# any length stream through.
_BLOCK = 1024
_WARPS = 4


@triton.jit
def _row_stats(s_row, a_row, TOPK, BLOCK: tl.constexpr):
    """(max, sum of exp(s - max), target sum, any valid) over the row's valid slots."""
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.full([], 0.0, tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for c0 in range(0, TOPK, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < TOPK
        s = tl.load(s_row + cols, mask=inside, other=float("-inf"))
        a = tl.load(a_row + cols, mask=inside, other=0.0)
        valid = inside & (tl.abs(s) < float("inf"))  # finite (NaN fails the compare too)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        # Until a valid slot is seen m_new is -inf: shift by 0 instead (z is still 0 then).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - shift) + tl.sum(tl.exp(s - shift), 0)
        total += tl.sum(tl.where(valid, a, 0.0), 0)
        m = m_new
    return m, z, total, m > float("-inf")


@triton.jit
def _kl_fwd_kernel(s_ptr, a_ptr, loss_ptr, has_ptr, TOPK, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * TOPK
    a_row = a_ptr + row * TOPK
    m, z, total, has = _row_stats(s_row, a_row, TOPK, BLOCK)
    lse = m + tl.log(z)
    live = has & (total > 0)
    inv_total = 1.0 / tl.where(live, total, 1.0)
    kl = tl.full([], 0.0, tl.float32)
    for c0 in range(0, TOPK, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < TOPK
        s = tl.load(s_row + cols, mask=inside, other=float("-inf"))
        a = tl.load(a_row + cols, mask=inside, other=0.0)
        p = a * inv_total
        term_ok = inside & (tl.abs(s) < float("inf")) & (p > 0)
        term = p * (tl.log(tl.where(term_ok, p, 1.0)) - (s - lse))
        kl += tl.sum(tl.where(term_ok, term, 0.0), 0)
    tl.store(loss_ptr + row, tl.where(live, kl, 0.0))
    tl.store(has_ptr + row, has.to(tl.float32))


@triton.jit
def _kl_bwd_kernel(s_ptr, a_ptr, scale_ptr, grad_ptr, TOPK, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * TOPK
    a_row = a_ptr + row * TOPK
    m, z, total, has = _row_stats(s_row, a_row, TOPK, BLOCK)
    live = has & (total > 0)
    lse = m + tl.log(tl.where(live, z, 1.0))
    inv_total = 1.0 / tl.where(live, total, 1.0)
    # The upstream gradient (over the row count for "mean"); a row that is not live gets 0.
    scale = tl.where(live, tl.load(scale_ptr), 0.0)
    for c0 in range(0, TOPK, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < TOPK
        s = tl.load(s_row + cols, mask=inside, other=float("-inf"))
        a = tl.load(a_row + cols, mask=inside, other=0.0)
        ok = inside & (tl.abs(s) < float("inf"))  # s <= max, so exp(s - lse) <= 1
        g = tl.exp(tl.where(ok, s - lse, float("-inf"))) - tl.where(ok, a * inv_total, 0.0)
        tl.store(grad_ptr + row * TOPK + cols, g * scale, mask=inside)


def kl_loss_rows_triton(
    scores: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and whether the row has a valid slot, float32 ``[T]`` each (contiguous
    float32 ``[T, topk]`` inputs; CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    rows, topk = scores.shape
    loss = scores.new_empty(rows)
    has = scores.new_empty(rows)
    if rows:
        _kl_fwd_kernel[(rows,)](scores, target, loss, has, topk, BLOCK=_BLOCK, num_warps=_WARPS)
    return loss, has


def kl_loss_grad_triton(
    scores: torch.Tensor, target: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``(softmax(scores) - p) * scale`` on valid slots of live rows, 0 elsewhere, float32
    ``[T, topk]``; ``scale`` is a float32 one-element tensor (no host read)."""
    rows, topk = scores.shape
    grad = torch.empty_like(scores)
    if rows:
        _kl_bwd_kernel[(rows,)](scores, target, scale, grad, topk, BLOCK=_BLOCK, num_warps=_WARPS)
    return grad
