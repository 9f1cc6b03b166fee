"""End to end: cu_seqlens -> causal_ranges -> lightning_indexer -> sparse_attention -> backward.

The library pipeline is compared with independent formulations that share no code with the
packages: the per-token causal ranges written out here, ``support.naive_topk`` over
``support.dense_logits`` (fp64) for the selection, ``support.dense_topk_scores`` and
``dsa_bench.dense.dense_attention`` (fp64) for the values, and float64 autograd of those for
every gradient.
"""

import torch
from dsa_bench.dense import dense_attention
from dsa_indexer import causal_ranges, lightning_indexer
from dsa_sparse_attention import sparse_attention
from kernel_common.testing import assert_close
from support import cu_seqlens, dense_logits, dense_topk_scores, naive_topk, seeded_gen

# bf16 outputs (attention out, dq, dkv, indexer dq / dk) against fp64: one bf16 rounding each
# (rel_diff ~1.4e-6 here); the fp32 ones (scores, dweights, dsink) are fp32 sums (~1e-14).
BF16_BAR = 1e-5


def test_packed_pipeline_forward_and_backward():
    gen = seeded_gen("pipeline")
    lens = [1, 13, 1, 40, 9]
    cu = cu_seqlens(lens)
    total, heads, d_idx, d, d_v, topk = sum(lens), 4, 32, 80, 64, 8
    iq = torch.randn(total, heads, d_idx, generator=gen).bfloat16()
    ik = torch.randn(total, d_idx, generator=gen).bfloat16()
    iw = torch.randn(total, heads, generator=gen) / heads**0.5
    q = torch.randn(1, total, heads, d, generator=gen).bfloat16()
    kv = torch.randn(1, total, 1, d, generator=gen).bfloat16()
    sink = torch.randn(heads, generator=gen)
    inputs = (iq, ik, iw, q, kv, sink)

    starts, ends = causal_ranges(cu, total)
    leaves = [x.clone().requires_grad_() for x in inputs]
    scores, idx = lightning_indexer(leaves[0], leaves[1], leaves[2], starts, ends, topk)
    out = sparse_attention(leaves[3], leaves[4], idx[None, :, None], d_v=d_v, attn_sink=leaves[5])
    gen_g = seeded_gen("pipeline grads")
    do = torch.randn(out.shape, generator=gen_g).bfloat16().float()
    ds = torch.randn(scores.shape, generator=gen_g)
    valid = idx >= 0
    loss = (out.float() * do).sum() + torch.where(valid, scores * ds, 0.0).sum()
    loss.backward()

    # Ranges: each query sees its own segment up to itself.
    seg_start = [c for c, n in zip(cu.tolist(), lens, strict=False) for _ in range(n)]
    assert starts.tolist() == seg_start and ends.tolist() == list(range(1, total + 1))

    # Selection: the exact top-k of the fp64 dense logits over each range.
    logits = dense_logits(iq, ik, iw, starts, ends)
    assert torch.equal(idx, naive_topk(logits, topk, starts, ends))
    assert torch.equal(valid.sum(1), (ends - starts).clamp(max=topk))

    # Values and gradients: fp64 autograd of the dense formulations at the selected indices.
    dense = [x.double().requires_grad_() for x in inputs]
    scores64 = dense_topk_scores(dense[0], dense[1], dense[2], idx)
    out64, _ = dense_attention(dense[3], dense[4], idx[None, :, None], d**-0.5, d_v, dense[5])
    loss64 = (out64 * do.double()).sum() + torch.where(valid, scores64 * ds.double(), 0.0).sum()
    loss64.backward()
    # (-inf at padding on both sides: assert_close requires the same non-finite pattern.)
    assert_close(scores, scores64, max_rel_diff=1e-6, name="indexer scores")
    assert_close(out, out64, max_rel_diff=BF16_BAR, name="attention out")
    names = ["indexer dq", "indexer dk", "indexer dweights", "dq", "dkv", "dsink"]
    bars = [BF16_BAR, BF16_BAR, 1e-6, BF16_BAR, BF16_BAR, 1e-6]
    for name, leaf, ref, bar in zip(names, leaves, dense, bars, strict=True):
        assert leaf.grad.dtype == leaf.dtype, name
        assert torch.isfinite(leaf.grad.float()).all(), name
        assert_close(leaf.grad, ref.grad, max_rel_diff=bar, name=name)
