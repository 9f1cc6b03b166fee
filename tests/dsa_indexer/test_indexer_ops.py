"""Indexer entries: validation messages, custom-op registration, torch.compile."""

import pytest
import torch
from dsa_indexer import causal_ranges, indexer_logits, indexer_topk_scores, lightning_indexer


def make(t=12, h=4, d=16, t_kv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t_kv = t if t_kv is None else t_kv
    q = torch.randn(t, h, d, generator=gen).bfloat16()
    k = torch.randn(t_kv, d, generator=gen).bfloat16()
    w = torch.randn(t, h, generator=gen)
    starts, ends = causal_ranges(torch.tensor([0, 5, t], dtype=torch.int32), t)
    return q, k, w, starts, ends


def test_validation_messages():
    q, k, w, s, e = make()
    with pytest.raises(TypeError, match="q must have dtype bfloat16, got float32"):
        indexer_logits(q.float(), k, w, s, e)
    with pytest.raises(ValueError, match=r"q must have shape \[T, H, D\]"):
        indexer_logits(q[0], k, w, s, e)
    with pytest.raises(ValueError, match=r"k must have shape \[T_kv, D=16\]"):
        indexer_logits(q, k[:, :8], w, s, e)
    with pytest.raises(TypeError, match="weights must have dtype float32"):
        indexer_logits(q, k, w.bfloat16(), s, e)
    with pytest.raises(ValueError, match=r"weights must have shape \[T=12, H=4\]"):
        indexer_logits(q, k, w[:, :2], s, e)
    with pytest.raises(ValueError, match=r"ends must have shape \[T=12\]"):
        indexer_logits(q, k, w, s, e[:3])
    with pytest.raises(TypeError, match="starts must have dtype int32"):
        indexer_logits(q, k, w, s.long(), e)
    with pytest.raises(ValueError, match=r"indices must have shape \[T=12, topk\]"):
        indexer_topk_scores(q, k, w, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk >= 1"):
        indexer_topk_scores(q, k, w, torch.zeros(12, 0, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, T_kv=12\)"):
        indexer_topk_scores(q, k, w, torch.full((12, 2), 12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indices must lie in"):
        indexer_topk_scores(q, k, w, torch.full((12, 2), -2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk must be >= 1"):
        lightning_indexer(q, k, w, s, e, 0)


@pytest.mark.gpu
def test_device_mismatch():
    q, k, w, s, e = make()
    with pytest.raises(ValueError, match="k is on cpu, expected cuda"):
        indexer_logits(q.cuda(), k, w.cuda(), s.cuda(), e.cuda())


def test_opcheck():
    q, k, w, s, e = make()
    torch.library.opcheck(torch.ops.dsa_indexer.indexer_logits.default, (q, k, w, s, e, True, ""))
    idx = torch.randint(-1, 12, (12, 5), dtype=torch.int32)
    qq, kk, ww = (x.clone().requires_grad_() for x in (q, k, w))
    torch.library.opcheck(torch.ops.dsa_indexer.indexer_topk_scores.default, (qq, kk, ww, idx, ""))
    g = torch.randn(12, 5)
    torch.library.opcheck(
        torch.ops.dsa_indexer.indexer_topk_scores_backward.default, (g, q, k, w, idx, "")
    )


def test_compile_forward_and_backward():
    def step(q, k, w, s, e):
        scores, idx = lightning_indexer(q, k, w, s, e, 4)
        return torch.where(idx >= 0, scores, 0.0).sum(), idx

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for t in (12, 19):
        q, k, w, s, e = make(t=t, seed=t)
        q1, k1, w1 = (x.clone().requires_grad_() for x in (q, k, w))
        q2, k2, w2 = (x.clone().requires_grad_() for x in (q, k, w))
        loss1, idx1 = step(q1, k1, w1, s, e)
        loss2, idx2 = compiled(q2, k2, w2, s, e)
        loss1.backward()
        loss2.backward()
        assert torch.equal(idx1, idx2)
        torch.testing.assert_close(loss1, loss2)
        for a, b in ((q1, q2), (k1, k2), (w1, w2)):
            torch.testing.assert_close(a.grad, b.grad)
    logits_fn = torch.compile(indexer_logits, fullgraph=True, dynamic=True)
    q, k, w, s, e = make()
    assert torch.equal(logits_fn(q, k, w, s, e), indexer_logits(q, k, w, s, e))
