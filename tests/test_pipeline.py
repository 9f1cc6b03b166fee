"""End to end: cu_seqlens -> causal_ranges -> lightning_indexer -> sparse_attention -> backward.

The library pipeline is compared with the same pipeline composed from the fp32 references
directly (no custom ops, no dispatch) on the same inputs.
"""

import torch
from dsa_indexer import causal_ranges, lightning_indexer
from dsa_indexer import reference as indexer_ref
from dsa_sparse_attention import reference as attn_ref
from dsa_sparse_attention import sparse_attention
from kernel_common.testing import assert_close
from topk.reference import ranged_topk_reference


def test_packed_pipeline_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    lens = [1, 13, 1, 40, 9]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, heads, d_idx, d, d_v, topk = sum(lens), 4, 32, 80, 64, 8
    iq = torch.randn(total, heads, d_idx, generator=gen).bfloat16()
    ik = torch.randn(total, d_idx, generator=gen).bfloat16()
    iw = torch.randn(total, heads, generator=gen) / heads**0.5
    q = torch.randn(1, total, heads, d, generator=gen).bfloat16()
    kv = torch.randn(1, total, 1, d, generator=gen).bfloat16()
    sink = torch.randn(heads, generator=gen)

    starts, ends = causal_ranges(cu, total)
    leaves = [x.clone().requires_grad_() for x in (iq, ik, iw, q, kv, sink)]
    scores, idx = lightning_indexer(leaves[0], leaves[1], leaves[2], starts, ends, topk)
    out = sparse_attention(leaves[3], leaves[4], idx[None, :, None], d_v=d_v, attn_sink=leaves[5])
    gen_g = torch.Generator().manual_seed(1)
    do = torch.randn(out.shape, generator=gen_g).bfloat16().float()
    ds = torch.randn(scores.shape, generator=gen_g)
    loss = (out.float() * do).sum() + torch.where(idx >= 0, scores * ds, 0.0).sum()
    loss.backward()

    # Same pipeline from the references.
    logits = indexer_ref.indexer_logits_reference(iq, ik, iw, starts, ends)
    ref_idx = ranged_topk_reference(logits, topk, starts, ends)
    assert torch.equal(idx, ref_idx)
    # No query attends outside its own segment or to the future.
    seg = torch.searchsorted(cu.long(), torch.arange(total), right=True) - 1
    valid = idx >= 0
    assert ((idx >= cu[seg, None]) | ~valid).all() and (
        (idx <= torch.arange(total)[:, None]) | ~valid
    ).all()
    ref_scores = indexer_ref.indexer_topk_scores_reference(iq, ik, iw, ref_idx)
    assert_close(scores, ref_scores, name="indexer scores")
    scale = 1 / d**0.5
    ref_out, ref_lse = attn_ref.sparse_attention_forward_reference(
        q, kv, ref_idx[None, :, None], scale, d_v, sink
    )
    assert_close(out, ref_out, name="attention out")
    dq, dkv, dsink = attn_ref.sparse_attention_backward_reference(
        do.bfloat16(), None, q, kv, ref_idx[None, :, None], ref_lse, scale, d_v, sink
    )
    diq, dik, diw = indexer_ref.indexer_topk_scores_backward_reference(
        torch.where(valid, ds, 0.0), iq, ik, iw, ref_idx
    )
    for name, got, want in [
        ("indexer dq", leaves[0].grad, diq),
        ("indexer dk", leaves[1].grad, dik),
        ("indexer dweights", leaves[2].grad, diw),
        ("dq", leaves[3].grad, dq),
        ("dkv", leaves[4].grad, dkv),
        ("dsink", leaves[5].grad, dsink),
    ]:
        assert torch.isfinite(got.float()).all(), name
        assert_close(got, want, name=name)
