"""lightning_indexer in bounded memory: blocks of query rows give the indices of one whole pass."""

import pytest
import torch
from dsa_indexer import _ops as indexer_ops
from dsa_indexer import causal_ranges, lightning_indexer, reference
from support import check_graph_replays, cu_seqlens, indexer_inputs, seeded_gen
from topk.reference import ranged_topk_reference


def _inputs(lens, ratio, offset, heads=4, d=16, seed=0):
    total = sum(lens) - offset
    t_kv = sum(n // ratio for n in lens)
    q, k, w = indexer_inputs(total, t_kv, heads, d, seeded_gen("bounded", seed))
    starts, ends = causal_ranges(cu_seqlens(lens), total, ratio=ratio, query_offset=offset)
    return q, k, w, starts, ends


LAYOUTS = {
    "causal-odd": ([203], 1, 0),
    "packed-1tok": ([37, 1, 1, 90, 1, 5], 1, 0),
    "ratio4": ([64, 130, 9], 4, 0),
    "cp-shard": ([150, 120], 1, 70),  # T != T_kv: the shard's queries against every key
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 64, 65, 130, 10_000])
def test_blocks_equal_one_pass(layout, rows):
    q, k, w, starts, ends = _inputs(*LAYOUTS[layout])
    topk = 8
    whole = ranged_topk_reference(
        reference.indexer_logits_reference(q, k, w, starts, ends), topk, starts, ends
    )
    budget = 4 * k.shape[0] * rows
    scores, idx = lightning_indexer(q, k, w, starts, ends, topk, logits_budget_bytes=budget)
    assert torch.equal(idx, whole)
    want = reference.indexer_topk_scores_reference(q, k, w, whole)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(want))


def test_blocks_respect_the_budget(monkeypatch):
    """Every logits block the op forms fits the budget: the whole [T, T_kv] never exists."""
    q, k, w, starts, ends = _inputs([300, 211], 1, 0)
    t_q, t_kv = q.shape[0], k.shape[0]
    shapes = []
    real = reference.indexer_logits_reference

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(indexer_ops.reference, "indexer_logits_reference", spy)
    budget = 4 * t_kv * 100
    lightning_indexer(q, k, w, starts, ends, 16, logits_budget_bytes=budget)
    assert shapes and sum(r for r, _ in shapes) == t_q
    assert max(r * c * 4 for r, c in shapes) <= budget < 4 * t_q * t_kv


def test_no_keys():
    """No key at all (e.g. ratio-4 keys of segments shorter than 4 tokens): every row is -1."""
    q, k, w, starts, ends = _inputs([3, 2, 1], 4, 0)
    assert k.shape[0] == 0
    scores, idx = lightning_indexer(q, k, w, starts, ends, 5, logits_budget_bytes=1)
    assert torch.equal(idx, torch.full((6, 5), -1, dtype=torch.int32))
    assert torch.isneginf(scores).all()


def test_budget_validation():
    q, k, w, starts, ends = _inputs([40], 1, 0)
    with pytest.raises(ValueError, match=r"logits_budget_bytes=159 is below one row of logits"):
        lightning_indexer(q, k, w, starts, ends, 4, logits_budget_bytes=159)
    with pytest.raises(ValueError, match="logits_budget_bytes must be >= 1"):
        lightning_indexer(q, k, w, starts, ends, 4, logits_budget_bytes=-1)
    with pytest.raises(TypeError, match="logits_budget_bytes must be an int"):
        lightning_indexer(q, k, w, starts, ends, 4, logits_budget_bytes=1.5e9)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 192, 10_000])
def test_gpu_blocks_equal_one_pass(rows):
    """On the GPU, the blocked Triton path gives bit for bit the indices of one pass over the
    whole logits (the same kernels), and those select the reference's scores."""
    from dsa_indexer import indexer_logits
    from topk import ranged_topk

    q, k, w, starts, ends = (t.cuda() for t in _inputs([700, 1, 333, 64], 1, 0, heads=32, d=128))
    topk = 64
    whole = ranged_topk(indexer_logits(q, k, w, starts, ends), topk, starts, ends)
    budget = 4 * k.shape[0] * rows
    _, idx = lightning_indexer(q, k, w, starts, ends, topk, logits_budget_bytes=budget)
    assert torch.equal(idx, whole)
    # Against the fp32 reference: kernel logits differ by rounding, so near-ties may pick other
    # columns; the selected scores must agree.
    ref_logits = reference.indexer_logits_reference(q, k, w, starts, ends)
    ref_idx = ranged_topk(ref_logits, topk, starts, ends)
    picked = [
        torch.gather(ref_logits, 1, i.clamp(min=0).long()).where(i >= 0, float("-inf"))
        for i in (idx, ref_idx)
    ]
    assert torch.equal(idx >= 0, ref_idx >= 0)
    torch.testing.assert_close(picked[0].sort(1).values, picked[1].sort(1).values)


@pytest.mark.gpu
def test_gpu_blocks_capture_in_a_cuda_graph():
    """The blocked path (two streams) inside a CUDA graph: replays give the eager indices, also
    for new inputs copied into the captured ones."""
    gen = seeded_gen("lightning graph")
    cu = cu_seqlens([500, 1, 523]).cuda()
    inputs = [indexer_inputs(1024, 1024, 32, 128, gen, device="cuda") for _ in range(2)]
    starts, ends = causal_ranges(cu, 1024)
    budget = 4 * 1024 * 128  # blocks of 128 rows: 64 per stream

    def run(q, k, w):
        return lightning_indexer(q, k, w, starts, ends, 64, logits_budget_bytes=budget)[1]

    check_graph_replays(run, inputs, run)
