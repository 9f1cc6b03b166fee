"""indexer_kl_loss: the torch reference and the Triton kernels against a dense fp64 KL."""

import pytest
import torch
from dsa_indexer import indexer_kl_loss
from dsa_indexer import reference as indexer_ref
from kernel_common.testing import assert_close
from support import interp_only, not_interpreted, run_interpreted, seeded_gen


def dense_kl(scores64, target, reduction):
    """fp64 loss, row by row in Python-level steps: valid = finite score; p = target / its sum
    over valid slots; rows without a valid slot or target mass add 0; 0 * log 0 = 0."""
    total = torch.zeros((), dtype=torch.float64)
    rows = 0
    for t in range(scores64.shape[0]):
        valid = torch.isfinite(scores64[t].detach())
        if not valid.any():
            continue
        rows += 1
        a = target[t].double()[valid]
        if a.sum() <= 0:
            continue
        p = a / a.sum()
        log_q = scores64[t][valid] - torch.logsumexp(scores64[t][valid], 0)
        keep = p > 0
        total = total + (p[keep] * (p[keep].log() - log_q[keep])).sum()
    return total / max(rows, 1) if reduction == "mean" else total


def make(rows, topk, gen, device="cpu"):
    """Scores with -inf padding, NaN slots, an all-padding row; a target with zero slots, a
    zero row and a row of tiny values."""
    s = torch.randn(rows, topk, generator=gen) * 3
    a = torch.rand(rows, topk, generator=gen)
    s[0] = float("-inf")
    if rows > 1:
        s[1, topk // 2 :] = float("-inf")
    if rows > 2:
        s[2, ::3] = float("nan")
    if rows > 3:
        a[3] = 0.0
    if rows > 4:
        a[4, : topk // 2] = 0.0
    if rows > 5:
        a[5] *= 1e-30
    return s.to(device), a.to(device)


CASES = [(7, 1), (7, 5), (9, 1500), (6, 2112)]


def _check(scores, target, reduction, bar=1e-6):
    x = scores.clone().requires_grad_()
    loss = indexer_kl_loss(x, target, reduction=reduction)
    loss.backward(torch.tensor(0.7, device=scores.device))
    x64 = scores.detach().cpu().double().requires_grad_()
    want = dense_kl(x64, target.cpu(), reduction)
    want.backward(torch.tensor(0.7, dtype=torch.float64))
    assert_close(loss, want, max_rel_diff=bar, name="loss")
    grad64 = torch.where(torch.isfinite(x64.detach()), torch.nan_to_num(x64.grad), 0.0)
    assert torch.isfinite(x.grad).all()
    assert_close(x.grad, grad64, max_rel_diff=bar, name="dscores")


@pytest.mark.parametrize("rows,topk", CASES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reference_against_dense(rows, topk, reduction):
    _check(*make(rows, topk, seeded_gen("kl", rows, topk)), reduction)


def test_edge_rows():
    """No valid slot anywhere: 0 and a zero gradient (also for "mean", not 0 / 0)."""
    s = torch.full((3, 4), float("-inf"), requires_grad=True)
    for reduction in ("sum", "mean"):
        loss = indexer_kl_loss(s, torch.rand(3, 4), reduction=reduction)
        (g,) = torch.autograd.grad(loss, s)
        assert loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))
    # A target equal to softmax(scores) gives KL 0 and gradient 0.
    s = torch.randn(5, 9)
    loss = indexer_kl_loss(s.requires_grad_(), torch.softmax(s.detach(), -1) * 3.0)
    assert abs(loss.item()) < 1e-6


def test_validation_messages():
    s, a = torch.zeros(4, 6), torch.zeros(4, 6)
    cases = [
        (dict(scores=s.double()), TypeError, "scores must have dtype float32"),
        (dict(scores=s[0]), ValueError, r"scores must have shape \[T, topk\]"),
        (dict(target=a[:, :5]), ValueError, r"target must have shape \[T=4, topk=6\]"),
        (dict(target=a.bfloat16()), TypeError, "target must have dtype float32"),
        (dict(reduction="none"), ValueError, r"reduction must be one of \('sum', 'mean'\)"),
    ]
    for overrides, exc, msg in cases:
        args = dict(scores=s, target=a, reduction="sum")
        args.update(overrides)
        with pytest.raises(exc, match=msg):
            indexer_kl_loss(args.pop("scores"), args.pop("target"), **args)


def test_opcheck_and_compile():
    s, a = make(6, 10, seeded_gen("kl op"))
    s = torch.where(torch.isnan(s), 0.0, s)  # opcheck compares gradients numerically
    for reduction in ("sum", "mean"):
        torch.library.opcheck(
            torch.ops.dsa_indexer.indexer_kl_loss.default, (s.requires_grad_(), a, reduction)
        )
    compiled = torch.compile(indexer_kl_loss, fullgraph=True, dynamic=True)
    for rows in (6, 9):
        s, a = make(rows, 10, seeded_gen("kl compile", rows))
        x, y = s.clone().requires_grad_(), s.clone().requires_grad_()
        indexer_kl_loss(x, a).backward()
        compiled(y, a).backward()
        torch.testing.assert_close(x.grad, y.grad)


@not_interpreted
def test_interpreter_run():
    run_interpreted(__file__)


@interp_only
@pytest.mark.parametrize("rows,topk", CASES)
def test_cpu_interp_kernels(rows, topk):
    from dsa_indexer._triton.kl_loss import kl_loss_grad_triton, kl_loss_rows_triton

    s, a = make(rows, topk, seeded_gen("kl interp", rows, topk))
    loss, has = kl_loss_rows_triton(s, a)
    want_loss, want_has = indexer_ref.indexer_kl_loss_rows_reference(s, a, dtype=torch.float64)
    assert torch.equal(has, want_has.float())
    assert_close(loss, want_loss, max_rel_diff=1e-6, name="row losses")
    scale = torch.tensor([0.3])
    grad = kl_loss_grad_triton(s, a, scale)
    want = indexer_ref.indexer_kl_loss_grad_reference(s, a, scale, dtype=torch.float64)
    assert_close(grad, want, max_rel_diff=1e-6, name="dscores")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,topk", [*CASES, (4096, 2048)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_gpu_against_dense(rows, topk, reduction):
    s, a = make(rows, topk, seeded_gen("kl gpu", rows, topk), device="cuda")
    if rows > 64:
        x = s.clone().requires_grad_()
        loss = indexer_kl_loss(x, a, reduction=reduction)
        loss.backward()
        want_loss, _ = indexer_ref.indexer_kl_loss_rows_reference(s, a, dtype=torch.float64)
        want = want_loss.sum() / (torch.isfinite(s).any(-1).sum() if reduction == "mean" else 1)
        assert_close(loss, want, max_rel_diff=1e-6, name="loss")
        scale = torch.ones(1, device="cuda") / (
            torch.isfinite(s).any(-1).sum() if reduction == "mean" else 1
        )
        grad = indexer_ref.indexer_kl_loss_grad_reference(s, a, scale, dtype=torch.float64)
        assert_close(x.grad, grad, max_rel_diff=1e-6, name="dscores")
        return
    _check(s, a, reduction)
