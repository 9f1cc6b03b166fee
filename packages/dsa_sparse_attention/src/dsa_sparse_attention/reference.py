"""Torch reference for sparse attention, forward and explicit backward (fp32 math, bounded memory).

The reference is written per query chunk with the same conventions as the kernels: K is the
whole kv row, V its first ``d_v`` columns; head ``h`` reads kv group ``h // (H // G)``; a -1
index is masked; the sink adds ``exp(sink[h])`` to the softmax denominator only.
"""

from __future__ import annotations

import math

import torch

_CHUNK_ELEMENTS = 1 << 24  # query chunk so that the gathered [c, G, topk, D] block stays ~64 MB


def _chunk(s: int, groups: int, topk: int, width: int) -> int:
    return max(1, min(s, _CHUNK_ELEMENTS // max(1, groups * topk * width)))


def _scores(q, keys, valid, sm_scale):
    """Scaled logits [b, c, G, hg, topk] with -inf at padding."""
    s = torch.einsum("bcghd,bcgjd->bcghj", q, keys) * sm_scale
    return s.masked_fill(~valid[:, :, :, None, :], float("-inf"))


def _lse(s, sink):
    """Natural-log sum-exp over keys (and the sink), -inf for an empty row without a sink."""
    lse = torch.logsumexp(s, dim=-1)
    if sink is not None:
        lse = torch.logaddexp(lse, sink.expand_as(lse))
    return lse


def _probs(s, lse):
    # An empty row without a sink has lse = -inf: its probabilities are 0, not NaN.
    return torch.where(torch.isneginf(s), 0.0, torch.exp(s - lse[..., None]))


def _live_columns(idx):
    """Drop index columns that are -1 in every row of the chunk (causal windows shorter than
    topk leave long -1 tails): they are masked anyway, and gathering them dominates the time."""
    live = (idx >= 0).flatten(0, 2).any(0)
    live[0] = True  # keep one (masked) column so that an all -1 chunk keeps its shape
    return idx if bool(live.all()) else idx[..., live]


def _gather(kv, idx):
    """kv [b, S_kv, G, D] at idx [b, c, G, topk] (clamped) -> [b, c, G, topk, D]."""
    b, c, g, topk = idx.shape
    flat = idx.clamp(min=0).long().permute(0, 2, 1, 3).reshape(b, g, c * topk)
    rows = torch.gather(kv.permute(0, 2, 1, 3), 2, flat[..., None].expand(-1, -1, -1, kv.shape[-1]))
    return rows.reshape(b, g, c, topk, -1).permute(0, 2, 1, 3, 4)


def sparse_attention_forward_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out [B, S, H, d_v] in q.dtype, lse [B, S, H] float32 natural log)``.

    ``dtype`` is the compute precision; with float64 (gradchecks) lse is float64 too.
    """
    b, s, h, d = q.shape
    g, topk = kv.shape[2], indices.shape[-1]
    hg = h // g
    out = torch.empty(b, s, h, d_v, dtype=q.dtype, device=q.device)
    acc_dtype = torch.promote_types(dtype, torch.float32)
    lse_out = torch.empty(b, s, h, dtype=acc_dtype, device=q.device)
    kvf = kv.to(dtype)
    sink = attn_sink.to(dtype).reshape(g, hg) if attn_sink is not None else None
    step = _chunk(s, g, topk, d)
    for c0 in range(0, s, step):
        c1 = min(s, c0 + step)
        idx = _live_columns(indices[:, c0:c1])
        keys = _gather(kvf, idx)
        qc = q[:, c0:c1].to(dtype).reshape(b, c1 - c0, g, hg, d)
        sc = _scores(qc, keys, idx >= 0, sm_scale)
        lse = _lse(sc, sink)
        p = _probs(sc, lse)
        o = torch.einsum("bcghj,bcgjd->bcghd", p, keys[..., :d_v])
        out[:, c0:c1] = o.reshape(b, c1 - c0, h, d_v).to(q.dtype)
        lse_out[:, c0:c1] = lse.reshape(b, c1 - c0, h)
    return out, lse_out


def sparse_attention_backward_reference(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward from the saved natural-log ``lse``: ``(dq, dkv, dsink)``.

    ``dlse`` [B, S, H] (or None) is the gradient reaching the lse output: since
    ``d lse / d s_j = p_j`` it folds into ``delta = rowsum(o * do) - dlse``. dq and dkv come back
    in the input dtypes, dsink in float32 (float64 when ``dtype`` is).
    """
    b, s, h, d = q.shape
    g, s_kv = kv.shape[2], kv.shape[1]
    hg = h // g
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    dkv = torch.zeros(b, g, s_kv, d, dtype=dtype, device=q.device)
    dsink = torch.zeros(g, hg, dtype=dtype, device=q.device) if attn_sink is not None else None
    kvf = kv.to(dtype)
    sink = attn_sink.to(dtype).reshape(g, hg) if attn_sink is not None else None
    step = _chunk(s, g, indices.shape[-1], d)
    for c0 in range(0, s, step):
        c1 = min(s, c0 + step)
        n = c1 - c0
        idx = _live_columns(indices[:, c0:c1])
        topk = idx.shape[-1]
        keys = _gather(kvf, idx)
        qc = q[:, c0:c1].to(dtype).reshape(b, n, g, hg, d)
        do = dout[:, c0:c1].to(dtype).reshape(b, n, g, hg, d_v)
        lse_c = lse[:, c0:c1].to(dtype).reshape(b, n, g, hg)
        p = _probs(_scores(qc, keys, idx >= 0, sm_scale), lse_c)
        o = torch.einsum("bcghj,bcgjd->bcghd", p, keys[..., :d_v])
        delta = (o * do).sum(-1)
        if dlse is not None:
            delta = delta - dlse[:, c0:c1].to(dtype).reshape(b, n, g, hg)
        dp = torch.einsum("bcghd,bcgjd->bcghj", do, keys[..., :d_v])
        ds = p * (dp - delta[..., None])
        dq[:, c0:c1] = (sm_scale * torch.einsum("bcghj,bcgjd->bcghd", ds, keys)).reshape(b, n, h, d)
        dkeys = sm_scale * torch.einsum("bcghj,bcghd->bcgjd", ds, qc)
        dkeys[..., :d_v] += torch.einsum("bcghj,bcghd->bcgjd", p, do)
        # Scatter-add every occurrence (duplicates count once each; -1 slots carry zeros).
        flat = idx.clamp(min=0).long().permute(0, 2, 1, 3).reshape(b, g, n * topk)
        src = dkeys.permute(0, 2, 1, 3, 4).reshape(b, g, n * topk, d)
        dkv.scatter_add_(2, flat[..., None].expand(-1, -1, -1, d), src)
        if sink is not None:
            p_sink = torch.where(torch.isneginf(lse_c), 0.0, torch.exp(sink - lse_c))
            dsink -= (delta * p_sink).sum(dim=(0, 1))
    return (
        dq.to(q.dtype),
        dkv.permute(0, 2, 1, 3).to(kv.dtype),
        dsink.reshape(h).to(torch.promote_types(dtype, torch.float32))
        if dsink is not None
        else None,
    )


def default_sm_scale(d_qk: int) -> float:
    return 1.0 / math.sqrt(d_qk)


def sparse_attention_probs_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Head-summed attention probability of each selected slot: ``[B, S, G, topk]`` (float32,
    float64 when ``dtype`` is), from the natural-log ``lse`` [B, S, H] of the forward.

    ``sum_{h in g} exp(sm_scale * q[b, s, h] . kv[b, idx, g] - lse[b, s, h])``, 0 at -1 slots;
    each occurrence of a duplicated index gets the same value.
    """
    b, s, h, d = q.shape
    g, topk = kv.shape[2], indices.shape[-1]
    hg = h // g
    out = torch.empty(
        b, s, g, topk, dtype=torch.promote_types(dtype, torch.float32), device=q.device
    )
    kvf = kv.to(dtype)
    step = _chunk(s, g, topk, d)
    for c0 in range(0, s, step):
        c1 = min(s, c0 + step)
        idx = indices[:, c0:c1]
        keys = _gather(kvf, idx)
        qc = q[:, c0:c1].to(dtype).reshape(b, c1 - c0, g, hg, d)
        lse_c = lse[:, c0:c1].to(dtype).reshape(b, c1 - c0, g, hg)
        p = _probs(_scores(qc, keys, idx >= 0, sm_scale), lse_c)
        out[:, c0:c1] = p.sum(3)
    return out
