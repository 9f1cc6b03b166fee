"""Triton kernels for the indexer score at selected key columns, forward and fused backward.

One program per query: it loads that query's ``[HP, D]`` heads once (``HP`` the head count
padded to a power of two >= 16, the smallest tensor-core dimension; padded heads have zero q
and zero weight) and walks its ``topk`` selected columns in ``BLOCK_K`` steps, gathering the
key rows by index. An index outside ``[0, T_kv)`` (the -1 padding, or any stray value) is a
padding slot: its key row is never read, its score is -inf and it contributes no gradient.

The backward recomputes the per-head scores ``s = K_sel @ qᵀ`` (the full logits are never
kept) and, with ``g`` the incoming gradient and ``ds = [s > 0] * w * g``:

* ``dweights[h] = sum_j relu(s[j, h]) * g[j]`` (fp32, on CUDA cores),
* ``dq = dsᵀ @ K_sel`` (accumulated over the steps as ``K_selᵀ @ ds`` so that D = 64 / 128 is
  the M side of the product),
* ``dk[idx[j]] += (ds @ q)[j]`` by fp32 atomic adds into a zeroed ``[T_kv, D]`` scratch, which
  the wrapper casts to bf16. Duplicated indices add once per occurrence.

``ds`` enters the two gradient products as bf16 (fp32 accumulation), as FlashAttention does
for its dS; the relative error this adds is ~2^-9 per term, a rel_diff of ~1e-6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_indexer._triton._common import check_head_dim, interpreted
from dsa_indexer.config import IndexerConfig, table_config


@triton.jit
def _topk_scores_fwd_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    idx_ptr,
    out_ptr,
    T_kv,
    TOPK,
    stride_k,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < H
    qb = tl.load(
        q_ptr + (t * H + offs_h)[:, None] * D + offs_d[None, :], mask=h_ok[:, None], other=0.0
    )
    wb = tl.load(w_ptr + t * H + offs_h, mask=h_ok, other=0.0)
    if DOT_FP32:
        # The interpreter has no bf16 matmul (see _common.interpreted).
        qb = qb.to(tl.float32)
    qt = tl.trans(qb)
    row_idx = idx_ptr + t * TOPK
    row_out = out_ptr + t * TOPK

    for j0 in range(0, TOPK, BLOCK_K):
        offs_j = j0 + tl.arange(0, BLOCK_K)
        j_ok = offs_j < TOPK
        idx = tl.load(row_idx + offs_j, mask=j_ok, other=-1)
        valid = (idx >= 0) & (idx < T_kv)
        kb = tl.load(
            k_ptr + idx.to(tl.int64)[:, None] * stride_k + offs_d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        if DOT_FP32:
            kb = kb.to(tl.float32)
        s = tl.dot(kb, qt)  # [BLOCK_K, HP]
        score = tl.sum(tl.maximum(s, 0.0) * wb[None, :], axis=1)
        tl.store(row_out + offs_j, tl.where(valid, score, float("-inf")), mask=j_ok)


@triton.jit
def _topk_scores_bwd_kernel(
    grad_ptr,
    q_ptr,
    k_ptr,
    w_ptr,
    idx_ptr,
    dq_ptr,
    dk_acc_ptr,
    dw_ptr,
    T_kv,
    TOPK,
    stride_k,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < H
    qb = tl.load(
        q_ptr + (t * H + offs_h)[:, None] * D + offs_d[None, :], mask=h_ok[:, None], other=0.0
    )
    wb = tl.load(w_ptr + t * H + offs_h, mask=h_ok, other=0.0)
    if DOT_FP32:
        qb = qb.to(tl.float32)
    qt = tl.trans(qb)
    row_idx = idx_ptr + t * TOPK
    row_grad = grad_ptr + t * TOPK

    dq_t = tl.zeros((D, HP), dtype=tl.float32)
    # Reduced over the keys every step rather than kept as a [BLOCK_K, HP] accumulator summed
    # at the end: that costs ~40 more registers per thread in sm_90 codegen, one CTA less per SM
    # at 8-16 heads.
    dw = tl.zeros((HP,), dtype=tl.float32)
    for j0 in range(0, TOPK, BLOCK_K):
        offs_j = j0 + tl.arange(0, BLOCK_K)
        j_ok = offs_j < TOPK
        idx = tl.load(row_idx + offs_j, mask=j_ok, other=-1)
        valid = (idx >= 0) & (idx < T_kv)
        key_rows = idx.to(tl.int64)
        kb = tl.load(
            k_ptr + key_rows[:, None] * stride_k + offs_d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        # Padding slots may carry any gradient (even NaN at a -inf score): never read it.
        g = tl.load(row_grad + offs_j, mask=valid, other=0.0)
        if DOT_FP32:
            kb = kb.to(tl.float32)
        s = tl.dot(kb, qt)  # [BLOCK_K, HP], recomputed scores
        active = s > 0.0
        dw += tl.sum(tl.where(active, s, 0.0) * g[:, None], axis=0)
        ds = tl.where(active, wb[None, :] * g[:, None], 0.0)
        ds = ds.to(kb.dtype)
        dq_t = tl.dot(tl.trans(kb), ds, dq_t)  # [D, HP]
        dkb = tl.dot(ds, qb)  # [BLOCK_K, D]
        tl.atomic_add(
            dk_acc_ptr + key_rows[:, None] * D + offs_d[None, :],
            dkb,
            mask=valid[:, None],
            sem="relaxed",
        )

    dq_off_t = (t * H + offs_h)[None, :] * D + offs_d[:, None]  # [D, HP], matches dq_t
    tl.store(dq_ptr + dq_off_t, dq_t.to(dq_ptr.dtype.element_ty), mask=h_ok[None, :])
    tl.store(dw_ptr + t * H + offs_h, dw, mask=h_ok)


def _prepare(op, q, k, weights, indices):
    check_head_dim(op, q.shape[2])
    q = q.contiguous()
    k = k if k.stride(1) == 1 else k.contiguous()
    return q, k, weights.contiguous(), indices.contiguous()


def _check_out(op, name, t, shape, dtypes):
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous {dtypes} of shape {list(shape)}")


def indexer_topk_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """The indexer score at the selected key columns.

    Args:
        q: bfloat16 ``[T, H, D]``, ``D`` a power of two >= 16 (64, 128); any ``H >= 1``.
        k: bfloat16 ``[T_kv, D]`` (rows may be strided).
        weights: float32 ``[T, H]``.
        indices: int32 ``[T, topk]``, any ``topk >= 1``; entries outside ``[0, T_kv)`` (the -1
            padding included) are padding and never read out of bounds.
        config: tiling (``scores_*`` fields); ``None`` takes the table row for q's device.

    Returns:
        float32 ``[T, topk]``: ``sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])``,
        -inf at padding slots.
    """
    out = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
    indexer_topk_scores_into(out, q, k, weights, indices, config=config)
    return out


def indexer_topk_scores_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig | None = None,
) -> None:
    """:func:`indexer_topk_scores_triton` into a contiguous float32 ``[T, topk]`` buffer."""
    op = "indexer_topk_scores_triton"
    cfg = config if config is not None else table_config(q.device, q.shape[1])
    q, k, weights, indices = _prepare(op, q, k, weights, indices)
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    _check_out(op, "out", out, (t_q, topk), (torch.float32,))
    if t_q == 0 or topk == 0:
        return
    _topk_scores_fwd_kernel[(t_q,)](
        q,
        k,
        weights,
        indices,
        out,
        k.shape[0],
        topk,
        k.stride(0),
        H=heads,
        D=d,
        HP=max(16, triton.next_power_of_2(heads)),
        BLOCK_K=cfg.scores_block_k,
        DOT_FP32=interpreted(q.device),
        num_warps=cfg.scores_num_warps,
        num_stages=cfg.scores_num_stages,
    )


def indexer_topk_scores_backward_triton(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`indexer_topk_scores_triton` w.r.t. q, k and weights.

    Args:
        grad: float32 ``[T, topk]``, the gradient of the scores (ignored at padding slots,
            whatever it holds there).
        q, k, weights, indices: as in :func:`indexer_topk_scores_triton`.
        config: tiling (``backward_*`` fields); ``None`` takes the table row for q's device.

    Returns:
        ``(dq, dk, dweights)``: bfloat16 ``[T, H, D]``, bfloat16 ``[T_kv, D]`` and float32
        ``[T, H]``. The scores are recomputed from q, k and the indices; all sums run in fp32
        (dk through fp32 atomics into a scratch buffer, so its summation order varies from run
        to run); padding slots contribute nothing.
    """
    # The interpreter's own bf16 cast truncates: there dq is rounded by torch instead.
    dq_dtype = torch.float32 if interpreted(q.device) else q.dtype
    dq = torch.empty(q.shape, dtype=dq_dtype, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dw = torch.empty(weights.shape, dtype=torch.float32, device=q.device)
    topk_scores_backward_into(dq, dk_acc, dw, grad, q, k, weights, indices, config=config)
    return dq.to(q.dtype), dk_acc.to(k.dtype), dw


def topk_scores_backward_into(
    dq: torch.Tensor,
    dk_acc: torch.Tensor,
    dw: torch.Tensor,
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig | None = None,
) -> None:
    """The backward into caller buffers: every entry of ``dq`` (bf16 or float32 ``[T, H, D]``)
    and ``dw`` (float32 ``[T, H]``) is written; ``dk_acc`` (float32 ``[T_kv, D]``, zeroed by the
    caller) receives the atomic adds. Tests pass float32 ``dq`` to check the accumulations."""
    op = "indexer_topk_scores_backward_triton"
    cfg = config if config is not None else table_config(q.device, q.shape[1])
    q, k, weights, indices = _prepare(op, q, k, weights, indices)
    grad = grad.contiguous()
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    _check_out(op, "dq", dq, q.shape, (torch.bfloat16, torch.float32))
    _check_out(op, "dk_acc", dk_acc, k.shape, (torch.float32,))
    _check_out(op, "dw", dw, weights.shape, (torch.float32,))
    if t_q == 0:
        return
    _topk_scores_bwd_kernel[(t_q,)](
        grad,
        q,
        k,
        weights,
        indices,
        dq,
        dk_acc,
        dw,
        k.shape[0],
        topk,
        k.stride(0),
        H=heads,
        D=d,
        HP=max(16, triton.next_power_of_2(heads)),
        BLOCK_K=cfg.backward_block_k,
        DOT_FP32=interpreted(q.device),
        num_warps=cfg.backward_num_warps,
        num_stages=cfg.backward_num_stages,
    )
