"""A dense fp64 formulation of sparse attention, independent of the package reference.

Each query attends to every key with a multiplicity weight (how often the key appears in its
index row), so duplicated indices count once per occurrence and -1 entries weigh nothing.
Autograd of this function gives the reference gradients.
"""

import torch


def multiplicity(indices, s_kv):
    """[B, S, G, S_kv] float64 count of each key in each index row (-1 ignored)."""
    b, s, g, _ = indices.shape
    counts = torch.zeros(b, s, g, s_kv + 1, dtype=torch.float64)
    idx = torch.where(indices >= 0, indices, s_kv).long()
    counts.scatter_add_(3, idx, torch.ones_like(idx, dtype=torch.float64))
    return counts[..., :s_kv]


def dense_attention(q, kv, indices, sm_scale, d_v, sink=None):
    """(out [B, S, H, d_v], lse [B, S, H]) in float64 from float64 q/kv (autograd-friendly)."""
    b, s, h, _ = q.shape
    g = kv.shape[2]
    counts = multiplicity(indices, kv.shape[1])  # [B, S, G, S_kv]
    group = torch.arange(h) // (h // g)
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
