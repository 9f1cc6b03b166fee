"""Indexer references and entries against the dense fp64 formulations of ``support``
(``dense_logits``: one head at a time over every key; ``dense_topk_scores``: those gathered) and
the per-row ``naive_topk``."""

import pytest
import torch
from dsa_indexer import (
    causal_ranges,
    indexer_logits,
    indexer_topk_scores,
    lightning_indexer,
)
from dsa_indexer import reference as ref
from kernel_common.testing import assert_close
from support import (
    cu_seqlens,
    dense_logits,
    dense_topk_scores,
    indexer_inputs,
    naive_topk,
    random_ranges,
    seeded_gen,
)


def inputs(t, h, d, t_kv=None, seed=0):
    return indexer_inputs(t, t if t_kv is None else t_kv, h, d, seeded_gen("inputs", seed))


@pytest.mark.parametrize(
    ("t", "h", "d", "t_kv"), [(17, 4, 32, None), (9, 8, 64, 23), (1, 1, 16, 1)]
)
def test_logits_match_dense(t, h, d, t_kv):
    q, k, w = inputs(t, h, d, t_kv)
    starts, ends = random_ranges(t, k.shape[0], seeded_gen("ranges", t, h, d))
    got = indexer_logits(q, k, w, starts, ends)
    assert got.dtype == torch.float32
    assert_close(got, dense_logits(q, k, w, starts, ends), name="logits")
    unclean = indexer_logits(q, k, w, starts, ends, clean=False)
    inside = torch.isfinite(got)
    assert torch.equal(unclean[inside], got[inside])


def test_reference_chunking_is_invisible(monkeypatch):
    q, k, w = inputs(33, 4, 16)
    starts, ends = causal_ranges(cu_seqlens([33]), 33)
    whole = ref.indexer_logits_reference(q, k, w, starts, ends)
    idx = naive_topk(whole, 5, starts, ends)
    scores = ref.indexer_topk_scores_reference(q, k, w, idx)
    monkeypatch.setattr(ref, "_CHUNK_ELEMENTS", 64)
    assert torch.equal(ref.indexer_logits_reference(q, k, w, starts, ends), whole)
    assert torch.equal(ref.indexer_topk_scores_reference(q, k, w, idx), scores)
    g = torch.randn(33, 5, generator=torch.Generator().manual_seed(0))
    a = ref.indexer_topk_scores_backward_reference(g, q, k, w, idx)
    monkeypatch.undo()
    b = ref.indexer_topk_scores_backward_reference(g, q, k, w, idx)
    for x, y in zip(a, b, strict=True):
        assert_close(x, y, max_rel_diff=1e-12)


def test_topk_scores_equal_logits_at_indices_and_inf_at_padding():
    q, k, w = inputs(20, 4, 32, 30)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(-1, 30, (20, 12), generator=gen, dtype=torch.int32)
    idx[3] = -1
    idx[4, :6] = 7  # duplicates
    scores = indexer_topk_scores(q, k, w, idx)
    assert scores.dtype == torch.float32
    assert_close(scores, dense_topk_scores(q, k, w, idx), name="scores")
    assert torch.isneginf(scores[3]).all()


def test_backward_matches_autograd_of_dense_fp64():
    q, k, w = inputs(16, 4, 32, 24, seed=3)
    gen = torch.Generator().manual_seed(4)
    idx = torch.randint(-1, 24, (16, 10), generator=gen, dtype=torch.int32)
    idx[5, :4] = 3  # duplicates count once per occurrence
    grad = torch.randn(16, 10, generator=gen)
    q64, k64, w64 = (x.double().requires_grad_() for x in (q, k, w))
    dense = dense_topk_scores(q64, k64, w64, idx)
    torch.where(idx >= 0, dense * grad.double(), 0.0).sum().backward()
    qq, kk, ww = (x.clone().requires_grad_() for x in (q, k, w))
    out = indexer_topk_scores(qq, kk, ww, idx)
    torch.where(idx >= 0, out, 0.0).mul(grad).sum().backward()
    assert qq.grad.dtype == torch.bfloat16 and kk.grad.dtype == torch.bfloat16
    assert ww.grad.dtype == torch.float32
    # dq/dk come back in bf16: compare at bf16 resolution, dweights at fp32.
    assert_close(qq.grad, q64.grad, max_rel_diff=1e-4, name="dq")
    assert_close(kk.grad, k64.grad, max_rel_diff=1e-4, name="dk")
    assert_close(ww.grad, w64.grad, max_rel_diff=1e-6, name="dweights")


def test_gradcheck_fp64_reference_backward():
    """The explicit backward formula, wrapped as the gradient of the fp64 reference forward."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = torch.tensor([[0, 1, -1], [2, 2, 5], [-1, -1, -1], [4, 3, 0]], dtype=torch.int32)

    class Scores(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, w):
            ctx.save_for_backward(q, k, w)
            s = ref.indexer_topk_scores_reference(q, k, w, idx, dtype=torch.float64)
            return torch.where(idx >= 0, s, 0.0)

        @staticmethod
        def backward(ctx, g):
            q, k, w = ctx.saved_tensors
            return ref.indexer_topk_scores_backward_reference(g, q, k, w, idx, dtype=torch.float64)

    assert torch.autograd.gradcheck(Scores.apply, (q, k, w))


def test_lightning_indexer_pipeline_packed():
    cu = cu_seqlens([1, 8, 1, 20])
    total = 30
    q, k, w = inputs(total, 4, 32, seed=6)
    starts, ends = causal_ranges(cu, total)
    q.requires_grad_()
    w.requires_grad_()
    scores, idx = lightning_indexer(q, k, w, starts, ends, 6)
    logits = dense_logits(q.detach(), k, w.detach(), starts, ends)
    assert torch.equal(idx, naive_topk(logits, 6, starts, ends))
    lens = (ends - starts).clamp(max=6)
    assert torch.equal((idx >= 0).sum(1), lens)
    expected = torch.where(idx >= 0, logits.gather(1, idx.clamp(min=0).long()), float("-inf"))
    assert_close(scores, expected, name="scores")
    torch.where(idx >= 0, scores, 0.0).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    assert w.grad is not None and torch.isfinite(w.grad).all()
