"""Public indexer entries: validation, ``dsa_indexer::*`` custom ops, autograd, dispatch."""

from __future__ import annotations

import torch
from kernel_common import check_int, check_tensor
from topk import ranged_topk

from dsa_indexer import reference
from dsa_indexer.config import IndexerConfig, resolve_indexer_config

_OP_INPUTS = (torch.bfloat16,)


def _check_qkw(op: str, q, k, weights) -> None:
    check_tensor(op, "q", q, dtypes=_OP_INPUTS, shape=[None, None, None], layout="[T, H, D]")
    t_q, heads, d = q.shape
    check_tensor(
        op, "k", k, dtypes=_OP_INPUTS, shape=[None, d], layout=f"[T_kv, D={d}]", device=q.device
    )
    check_tensor(
        op,
        "weights",
        weights,
        dtypes=(torch.float32,),
        shape=[t_q, heads],
        layout=f"[T={t_q}, H={heads}]",
        device=q.device,
    )


def _check_ranges(op: str, q, starts, ends) -> None:
    t_q = q.shape[0]
    for name, t in (("starts", starts), ("ends", ends)):
        check_tensor(
            op, name, t, dtypes=(torch.int32,), shape=[t_q], layout=f"[T={t_q}]", device=q.device
        )


def _config_arg(op: str, config: IndexerConfig | None) -> str:
    """The ops take the caller's config as JSON, or "" for the table's choice."""
    if config is None:
        return ""
    if not isinstance(config, IndexerConfig):
        raise TypeError(f"{op}: config must be an IndexerConfig, got {type(config).__name__}")
    return config.to_json()


def _resolve(q: torch.Tensor, config: str) -> IndexerConfig:
    # Resolved inside the ops so that arch detection stays out of torch.compile's trace.
    caller = IndexerConfig.from_json(config) if config else None
    return resolve_indexer_config(q.device, q.shape[1], caller).config


@torch.library.custom_op("dsa_indexer::indexer_logits", mutates_args=())
def _indexer_logits_op(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    clean: bool,
    config: str,
) -> torch.Tensor:
    cfg = _resolve(q, config)
    if cfg.backend == "triton":
        from dsa_indexer._triton import indexer_logits_triton

        return indexer_logits_triton(q, k, weights, starts, ends, clean, config=cfg)
    # The reference always writes -inf outside the ranges, which satisfies clean=False too.
    return reference.indexer_logits_reference(q, k, weights, starts, ends)


@_indexer_logits_op.register_fake
def _(q, k, weights, starts, ends, clean, config):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


def indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    clean: bool = True,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """Lightning-indexer logits of every query against every key of its range.

    Args:
        q: bfloat16 ``[T, H, D]`` indexer queries.
        k: bfloat16 ``[T_kv, D]`` indexer keys (shared by all heads).
        weights: float32 ``[T, H]`` per-query head weights (any scale folded in by the caller).
        starts, ends: int32 ``[T]``: the half-open key range of each query.
        clean: write -inf outside each range; with ``clean=False`` entries outside the ranges
            are undefined and only a range-aware consumer (:func:`topk.ranged_topk`) may read it.
        config: an :class:`IndexerConfig`; default from the measured per-arch table.

    Returns:
        float32 ``[T, T_kv]``: ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` for ``s`` in range.
        Not differentiable (use :func:`indexer_topk_scores` for the selected scores).
    """
    op = "indexer_logits"
    _check_qkw(op, q, k, weights)
    _check_ranges(op, q, starts, ends)
    return _indexer_logits_op(q, k, weights, starts, ends, bool(clean), _config_arg(op, config))


def _check_indices(q, k, indices) -> None:
    """Index values must lie in [-1, T_kv); the torch backend checks them (GPU kernels pad)."""
    bad = (indices < -1) | (indices >= k.shape[0])
    if bool(bad.any()):
        raise ValueError(
            f"indexer_topk_scores: indices must lie in [-1, T_kv={k.shape[0]}); "
            f"found {int(bad.sum())} entries outside it"
        )


@torch.library.custom_op("dsa_indexer::indexer_topk_scores", mutates_args=())
def _topk_scores_op(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, config: str
) -> torch.Tensor:
    cfg = _resolve(q, config)
    if cfg.backend == "triton":
        from dsa_indexer._triton import indexer_topk_scores_triton

        return indexer_topk_scores_triton(q, k, weights, indices, config=cfg)
    _check_indices(q, k, indices)
    return reference.indexer_topk_scores_reference(q, k, weights, indices)


@_topk_scores_op.register_fake
def _(q, k, weights, indices, config):
    return q.new_empty(indices.shape, dtype=torch.float32)


@torch.library.custom_op("dsa_indexer::indexer_topk_scores_backward", mutates_args=())
def _topk_scores_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _resolve(q, config)
    if cfg.backend == "triton":
        from dsa_indexer._triton import indexer_topk_scores_backward_triton

        return indexer_topk_scores_backward_triton(grad, q, k, weights, indices, config=cfg)
    return reference.indexer_topk_scores_backward_reference(grad, q, k, weights, indices)


@_topk_scores_backward_op.register_fake
def _(grad, q, k, weights, indices, config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights, dtype=torch.float32)


def _scores_setup_context(ctx, inputs, output):
    q, k, weights, indices, config = inputs
    ctx.save_for_backward(q, k, weights, indices)
    ctx.config = config


def _scores_backward(ctx, grad):
    q, k, weights, indices = ctx.saved_tensors
    dq, dk, dw = _topk_scores_backward_op(grad.contiguous(), q, k, weights, indices, ctx.config)
    return dq, dk, dw, None, None


_topk_scores_op.register_autograd(_scores_backward, setup_context=_scores_setup_context)


def indexer_topk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """The indexer score at selected key columns, differentiable w.r.t. q, k and weights.

    Args:
        q, k, weights: as in :func:`indexer_logits`.
        indices: int32 ``[T, topk]`` key columns in ``[-1, T_kv)``, -1 for padding (duplicates
            allowed: each occurrence counts). GPU kernels treat values outside it as padding;
            the torch backend rejects them.
        config: an :class:`IndexerConfig`; default from the measured per-arch table.

    Returns:
        float32 ``[T, topk]``: the same value :func:`indexer_logits` gives at those columns,
        -inf at -1. The backward recomputes the scores from q, k and the indices, so the full
        logits are never kept.
    """
    op = "indexer_topk_scores"
    _check_qkw(op, q, k, weights)
    check_tensor(
        op,
        "indices",
        indices,
        dtypes=(torch.int32,),
        shape=[q.shape[0], None],
        layout=f"[T={q.shape[0]}, topk]",
        device=q.device,
    )
    if indices.shape[1] < 1:
        raise ValueError(
            f"{op}: indices must have topk >= 1 columns, got shape {list(indices.shape)}"
        )
    return _topk_scores_op(q, k, weights, indices, _config_arg(op, config))


def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    *,
    config: IndexerConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer logits -> exact ranged top-k -> differentiable scores, with no host sync.

    Arguments as in :func:`indexer_logits`; ``topk >= 1``. Returns ``(scores, indices)``:
    float32 ``[T, topk]`` (differentiable w.r.t. q, k, weights; -inf at padding) and int32
    ``[T, topk]`` (ascending columns, -1 tail where a range holds fewer than ``topk`` keys).
    The logits are computed unclean: the top-k never reads outside the ranges.
    """
    op = "lightning_indexer"
    _check_qkw(op, q, k, weights)
    _check_ranges(op, q, starts, ends)
    check_int(op, "topk", topk, minimum=1)
    config_arg = _config_arg(op, config)
    with torch.no_grad():
        logits = _indexer_logits_op(q, k, weights, starts, ends, False, config_arg)
        indices = ranged_topk(logits, topk, starts, ends)
    return _topk_scores_op(q, k, weights, indices, config_arg), indices
