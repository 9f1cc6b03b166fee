"""One indexer training step end to end, every gradient against a dense fp64 formulation.

packed sequences -> causal_ranges -> lightning_indexer -> sparse_attention ->
sparse_attention_probs (detached) -> indexer_kl_loss + a loss on the attention output -> backward.
The dense formulation below (indexer scores, attention, target and KL in float64, differentiated
by autograd) shares no code with the packages; the selected indices come from the library.
"""

import torch
from dsa_bench.dense import dense_attention
from dsa_indexer import causal_ranges, indexer_kl_loss, lightning_indexer
from dsa_sparse_attention import sparse_attention, sparse_attention_probs
from kernel_common.testing import assert_close
from support import seeded_gen


def _dense_step(iq, ik, iw, q, kv, sink, idx, do, d_v):
    """float64 (kl, main, out) from float64 leaves, for given indices [T, topk]."""
    valid = idx >= 0
    keys = ik[idx.clamp(min=0).long()]  # [T, topk, D]
    s = torch.einsum("thd,tjd->thj", iq, keys).relu()
    scores = torch.einsum("thj,th->tj", s, iw).masked_fill(~valid, float("-inf"))
    scale = q.shape[-1] ** -0.5
    out, lse = dense_attention(q, kv, idx[None, :, None], scale, d_v, sink)
    with torch.no_grad():  # the target is a constant of the indexer loss
        logits = torch.einsum("bshd,bkd->bshk", q, kv[:, :, 0]) * scale
        p = torch.exp(logits - lse[..., None])[0].sum(1)  # [T, S_kv], summed over the heads
        target = torch.gather(p, 1, idx.clamp(min=0).long()).masked_fill(~valid, 0.0)
        pt = target / target.sum(-1, keepdim=True)
    log_q = torch.log_softmax(scores, -1)
    ok = valid & (pt > 0)
    kl = torch.where(ok, pt * (torch.log(torch.where(ok, pt, 1.0)) - log_q), 0.0).sum()
    main = (out * do).sum()
    return kl, main, out


def test_indexer_training_step_against_dense_fp64():
    gen = seeded_gen("training step")
    lens = [1, 13, 1, 40, 9]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, heads, d_idx, d, d_v, topk = sum(lens), 4, 32, 80, 64, 8
    leaves = [
        torch.randn(total, heads, d_idx, generator=gen).bfloat16(),  # indexer q
        torch.randn(total, d_idx, generator=gen).bfloat16(),  # indexer k
        torch.randn(total, heads, generator=gen) / heads**0.5,  # indexer weights
        torch.randn(1, total, heads, d, generator=gen).bfloat16(),  # attention q
        torch.randn(1, total, 1, d, generator=gen).bfloat16(),  # attention kv
        torch.randn(heads, generator=gen),  # sink
    ]
    do = torch.randn(1, total, heads, d_v, generator=gen).bfloat16()
    iq, ik, iw, q, kv, sink = (x.clone().requires_grad_() for x in leaves)

    starts, ends = causal_ranges(cu, total)
    scores, idx = lightning_indexer(iq, ik, iw, starts, ends, topk)
    out, lse = sparse_attention(q, kv, idx[None, :, None], d_v=d_v, attn_sink=sink, return_lse=True)
    target = sparse_attention_probs(q.detach(), kv.detach(), idx[None, :, None], lse.detach())
    kl = indexer_kl_loss(scores, target[0, :, 0])
    main = (out.float() * do.float()).sum()
    (kl + main).backward()

    # The indexer learns from the KL term only, the attention from its own loss only.
    kl_grads = torch.autograd.grad(
        indexer_kl_loss(lightning_indexer(iq, ik, iw, starts, ends, topk)[0], target[0, :, 0]),
        (iq, ik, iw),
    )
    for name, got, want in zip(
        ("iq", "ik", "iw"), (iq.grad, ik.grad, iw.grad), kl_grads, strict=True
    ):
        assert torch.equal(got, want), name
    out2 = sparse_attention(q, kv, idx[None, :, None], d_v=d_v, attn_sink=sink)
    main_grads = torch.autograd.grad((out2.float() * do.float()).sum(), (q, kv, sink))
    for name, got, want in zip(
        ("q", "kv", "sink"), (q.grad, kv.grad, sink.grad), main_grads, strict=True
    ):
        assert torch.equal(got, want), name

    dense = [x.double().requires_grad_() for x in leaves]
    kl64, main64, out64 = _dense_step(*dense, idx, do.double(), d_v)
    (kl64 + main64).backward()
    assert_close(kl, kl64, max_rel_diff=1e-6, name="kl loss")
    # (The bf16 output, not its loss: a sum of signed products amplifies its rounding.)
    assert_close(out, out64, name="attention out")
    for name, got, ref in zip(
        ("indexer dq", "indexer dk", "indexer dweights", "dq", "dkv", "dsink"),
        (iq.grad, ik.grad, iw.grad, q.grad, kv.grad, sink.grad),
        dense,
        strict=True,
    ):
        assert torch.isfinite(got.float()).all(), name
        assert_close(got, ref.grad, name=name)
