"""``indexer_kl_loss``: the DSA indexer's training loss against the attention's target."""

from __future__ import annotations

import torch
from kernel_common import check_tensor

from dsa_indexer import reference

REDUCTIONS = ("sum", "mean")
_OP = "indexer_kl_loss"


def _use_triton(scores: torch.Tensor) -> bool:
    # The Triton kernels are built and tested for CUDA GPUs; ROCm runs the torch reference.
    return scores.device.type == "cuda" and torch.version.hip is None


@torch.library.custom_op("dsa_indexer::indexer_kl_loss", mutates_args=())
def _kl_loss_op(
    scores: torch.Tensor, target: torch.Tensor, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(scores):
        from dsa_indexer._triton.kl_loss import kl_loss_rows_triton

        loss, has = kl_loss_rows_triton(scores, target)
    else:
        loss, has = reference.indexer_kl_loss_rows_reference(scores, target)
    rows = has.sum()
    total = loss.sum()
    # "mean": over the rows with a valid slot (0 when there is none, not 0 / 0).
    return (total / rows.clamp(min=1) if reduction == "mean" else total), rows


@_kl_loss_op.register_fake
def _(scores, target, reduction):
    return scores.new_empty(()), scores.new_empty(())


@torch.library.custom_op("dsa_indexer::indexer_kl_loss_backward", mutates_args=())
def _kl_loss_backward_op(
    grad: torch.Tensor,
    rows: torch.Tensor,
    scores: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
) -> torch.Tensor:
    scale = (grad / rows.clamp(min=1) if reduction == "mean" else grad).reshape(1).float()
    if _use_triton(scores):
        from dsa_indexer._triton.kl_loss import kl_loss_grad_triton

        return kl_loss_grad_triton(scores, target, scale)
    return reference.indexer_kl_loss_grad_reference(scores, target, scale)


@_kl_loss_backward_op.register_fake
def _(grad, rows, scores, target, reduction):
    return torch.empty_like(scores)


def _setup_context(ctx, inputs, output):
    scores, target, reduction = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(scores, target, output[1])
    ctx.reduction = reduction


def _backward(ctx, grad, _grad_rows):
    scores, target, rows = ctx.saved_tensors
    dscores = _kl_loss_backward_op(grad, rows, scores, target, ctx.reduction)
    return dscores, None, None


_kl_loss_op.register_autograd(_backward, setup_context=_setup_context)


def indexer_kl_loss(
    scores: torch.Tensor, target: torch.Tensor, *, reduction: str = "sum"
) -> torch.Tensor:
    """The DSA indexer loss (sparse stage): ``sum_t KL(p_t || softmax(scores_t))``.

    Args:
        scores: float32 ``[T, topk]``, the indexer scores at the selected keys (as returned by
            :func:`lightning_indexer` / :func:`indexer_topk_scores`); a slot is valid when its
            score is finite (-inf marks padding).
        target: float32 ``[T, topk]``, non-negative: the attention's probability of each
            selected key summed over the heads (``dsa_sparse_attention.sparse_attention_probs``,
            all-reduced over the head shards under tensor parallelism). It is normalised per
            row over the valid slots here (``p_t``) and is a constant: no gradient reaches it.
        reduction: ``"sum"`` over rows, or ``"mean"`` over the rows that have a valid slot.

    Returns:
        A float32 scalar, differentiable w.r.t. ``scores`` only: the gradient is
        ``softmax(scores_t) - p_t`` on valid slots (times the upstream gradient, over the row
        count for "mean") and 0 elsewhere. Unclipped and stable: ``0 * log 0 = 0``, no log of 0.
        A row with no valid slot adds 0; so does a row whose target has no mass on its valid
        slots (the KL is undefined there), and it gets a zero gradient.
    """
    check_tensor(
        _OP, "scores", scores, dtypes=(torch.float32,), shape=[None, None], layout="[T, topk]"
    )
    t, topk = scores.shape
    check_tensor(
        _OP,
        "target",
        target,
        dtypes=(torch.float32,),
        shape=[t, topk],
        layout=f"[T={t}, topk={topk}]",
        device=scores.device,
    )
    if reduction not in REDUCTIONS:
        raise ValueError(f"{_OP}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    loss, _rows = _kl_loss_op(scores.contiguous(), target.detach().contiguous(), reduction)
    return loss
