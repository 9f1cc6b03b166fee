"""Torch references for the lightning indexer (pure PyTorch, fp32 math, bounded memory)."""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = (
    1 << 26
)  # query chunk size so that the [t, H, T_kv] temporary stays ~256 MB in fp32


def _query_chunk(heads: int, width: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, heads * width))


def indexer_logits_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` in ``[starts[t], ends[t])``.

    -inf outside the range.

    q [T, H, D], k [T_kv, D], weights [T, H], starts/ends [T]; computed in ``dtype`` and returned
    as float32 [T, T_kv] (float64 when ``dtype`` is float64, for gradchecks).
    """
    t_q, heads, _ = q.shape
    t_kv = k.shape[0]
    out = torch.empty(t_q, t_kv, dtype=torch.promote_types(dtype, torch.float32), device=q.device)
    kf = k.to(dtype)
    cols = torch.arange(t_kv, device=q.device)
    step = _query_chunk(heads, t_kv)
    for t0 in range(0, t_q, step):
        t1 = min(t_q, t0 + step)
        s = torch.einsum("thd,sd->ths", q[t0:t1].to(dtype), kf).relu_()
        logits = torch.einsum("ths,th->ts", s, weights[t0:t1].to(dtype))
        inside = (cols >= starts[t0:t1, None]) & (cols < ends[t0:t1, None])
        out[t0:t1] = torch.where(inside, logits, float("-inf"))
    return out


def _with_a_key(k: torch.Tensor) -> torch.Tensor:
    """``k``, with one zero row when it has none: -1 slots gather row 0 (clamped) and are masked
    afterwards, so an input without keys (all -1) needs a row to gather."""
    return k if k.shape[0] else k.new_zeros(1, k.shape[1])


def _gathered_scores(q, k, weights, indices, dtype):
    """Per-head pre-activation scores [t, H, topk] at the selected columns (clamped -1 -> 0)."""
    keys = k.to(dtype)[indices.clamp(min=0).long()]  # [t, topk, D]
    return torch.einsum("thd,tjd->thj", q.to(dtype), keys)


def indexer_topk_scores_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The indexer score at ``indices`` [T, topk] (int32, -1 padding), -inf at -1.

    float32 [T, topk] (float64 when ``dtype`` is float64).
    """
    k = _with_a_key(k)
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    out = torch.empty(t_q, topk, dtype=torch.promote_types(dtype, torch.float32), device=q.device)
    step = _query_chunk(1, topk * (d + heads))
    for t0 in range(0, t_q, step):
        t1 = min(t_q, t0 + step)
        idx = indices[t0:t1]
        s = _gathered_scores(q[t0:t1], k, weights, idx, dtype).relu_()
        score = torch.einsum("thj,th->tj", s, weights[t0:t1].to(dtype))
        out[t0:t1] = torch.where(idx >= 0, score, float("-inf"))
    return out


def indexer_topk_scores_backward_reference(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`indexer_topk_scores_reference` w.r.t. q, k and weights.

    The scores are recomputed from q, k and the indices; -1 slots contribute nothing and a
    duplicated index contributes once per occurrence. Returns (dq in q.dtype, dk in k.dtype,
    dweights float32).
    """
    t_kv = k.shape[0]
    k = _with_a_key(k)
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dw = torch.empty(weights.shape, dtype=dtype, device=q.device)
    kf = k.to(dtype)
    step = _query_chunk(1, topk * (d + heads))
    for t0 in range(0, t_q, step):
        t1 = min(t_q, t0 + step)
        idx = indices[t0:t1]
        valid = idx >= 0
        g = torch.where(valid, grad[t0:t1].to(dtype), 0)  # [t, topk]
        s = _gathered_scores(q[t0:t1], k, weights, idx, dtype)  # [t, H, topk]
        dw[t0:t1] = torch.einsum("thj,tj->th", s.relu(), g)
        ds = (s > 0).to(dtype) * weights[t0:t1].to(dtype)[:, :, None] * g[:, None, :]
        keys = kf[idx.clamp(min=0).long()]
        dq[t0:t1] = torch.einsum("thj,tjd->thd", ds, keys)
        dkeys = torch.einsum("thj,thd->tjd", ds, q[t0:t1].to(dtype))
        dk.index_add_(0, idx.clamp(min=0).reshape(-1).long(), dkeys.reshape(-1, d))
    return dq.to(q.dtype), dk[:t_kv].to(k.dtype), dw.to(torch.promote_types(dtype, torch.float32))


def _kl_parts(scores: torch.Tensor, target: torch.Tensor, dtype: torch.dtype):
    """Valid mask, p = target / its sum over valid slots, log softmax over valid slots, and
    whether each row is live (a valid slot and target mass on them)."""
    s = scores.to(dtype)
    valid = torch.isfinite(s)
    a = torch.where(valid, target.to(dtype), 0)
    total = a.sum(-1, keepdim=True)
    live = valid.any(-1, keepdim=True) & (total > 0)
    p = a / torch.where(live, total, 1)
    log_q = torch.log_softmax(torch.where(valid, s, float("-inf")), dim=-1)
    return valid, p, log_q, live


def indexer_kl_loss_rows_reference(
    scores: torch.Tensor, target: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || softmax(scores)) over the valid (finite-score) slots of ``[T, topk]``
    inputs, and whether each row has a valid slot (both ``[T]`` in ``dtype``, at least fp32).

    ``p`` is the target normalised over the valid slots; ``0 * log 0 = 0`` (no log of 0 is
    taken); a row without a valid slot or without target mass on them gives 0.
    """
    valid, p, log_q, live = _kl_parts(scores, target, dtype)
    ok = valid & (p > 0)
    term = torch.where(ok, p * (torch.log(torch.where(ok, p, 1)) - log_q), 0)
    loss = torch.where(live[:, 0], term.sum(-1), 0)
    return loss, valid.any(-1).to(loss.dtype)


def indexer_kl_loss_grad_reference(
    scores: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Gradient of the summed per-row loss w.r.t. ``scores``, times ``scale`` (a one-element
    tensor): ``softmax(scores) - p`` on valid slots of live rows, 0 elsewhere."""
    valid, p, log_q, live = _kl_parts(scores, target, dtype)
    ok = valid & live
    grad = torch.where(ok, torch.exp(torch.where(ok, log_q, 0)) - p, 0)
    return (grad * scale.to(grad.dtype)).to(torch.promote_types(dtype, torch.float32))
