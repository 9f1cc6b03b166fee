"""A dense fp64 formulation of sparse attention, independent of the package reference.

Each query attends to every key with a multiplicity weight (how often the key appears in its
index row), so duplicated indices count once per occurrence and -1 entries weigh nothing.
Autograd of this function gives the reference gradients. It is quadratic in the length (every
query against every key): ``dsa-bench`` uses it on the CPU only, and the tests import it from
here.
"""

from __future__ import annotations

import torch


def multiplicity(indices, s_kv):
    """[B, S, G, S_kv] float64 count of each key in each index row (-1 ignored)."""
    b, s, g, _ = indices.shape
    counts = torch.zeros(b, s, g, s_kv + 1, dtype=torch.float64, device=indices.device)
    idx = torch.where(indices >= 0, indices, s_kv).long()
    counts.scatter_add_(3, idx, torch.ones_like(idx, dtype=torch.float64))
    return counts[..., :s_kv]


def dense_attention(q, kv, indices, sm_scale, d_v, sink=None):
    """(out [B, S, H, d_v], lse [B, S, H]) in float64 from float64 q/kv (autograd-friendly)."""
    b, s, h, _ = q.shape
    g = kv.shape[2]
    counts = multiplicity(indices, kv.shape[1])  # [B, S, G, S_kv]
    group = torch.arange(h, device=q.device) // (h // g)
    logits = torch.einsum("bshd,bkhd->bshk", q, kv[:, :, group]) * sm_scale
    weight = counts[:, :, group]  # [B, S, H, S_kv]
    logw = torch.where(weight > 0, weight.log(), float("-inf"))
    z = logits + logw
    if sink is not None:
        z = torch.cat([z, sink.reshape(1, 1, h, 1).expand(b, s, h, 1)], dim=-1)
    # An empty row (no key, no sink) has lse = -inf and p = 0: keep NaN out of its gradient.
    empty = torch.isneginf(z).all(-1, keepdim=True)
    lse_safe = torch.logsumexp(z.masked_fill(empty, 0.0), dim=-1, keepdim=True)
    p = torch.exp(z - lse_safe.masked_fill(empty, 0.0))[..., : kv.shape[1]]
    lse = lse_safe.squeeze(-1).masked_fill(empty.squeeze(-1), float("-inf"))
    out = torch.einsum("bshk,bkhd->bshd", p, kv[:, :, group, :d_v])
    return out, lse


def dense_forward_backward(q, kv, indices, sm_scale, d_v, sink, dout, *, chunk_elements=1 << 22):
    """:func:`dense_attention` in float64 and its gradients for the output gradient ``dout``.

    Returns ``(out, lse, dq, dkv, dsink)`` (float64; ``dsink`` None without a sink): the
    gradients of ``sum(out * dout)`` w.r.t. q, kv and the sink, by autograd. Queries are
    independent, so the work runs over chunks of queries (about ``chunk_elements`` logits per
    chunk) to bound memory; the chunks' kv and sink gradients add up.
    """
    b, s, h, _ = q.shape
    s_kv = kv.shape[1]
    step = max(1, chunk_elements // max(1, b * h * s_kv))
    kv64 = kv.detach().double().requires_grad_()
    sink64 = sink.detach().double().requires_grad_() if sink is not None else None
    outs, lses, dqs = [], [], []
    for c0 in range(0, s, step):
        c1 = min(s, c0 + step)
        qc = q[:, c0:c1].detach().double().requires_grad_()
        out, lse = dense_attention(qc, kv64, indices[:, c0:c1], sm_scale, d_v, sink64)
        out.backward(dout[:, c0:c1].double())
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(qc.grad)
    dsink = sink64.grad if sink64 is not None else None
    return torch.cat(outs, 1), torch.cat(lses, 1), torch.cat(dqs, 1), kv64.grad, dsink
