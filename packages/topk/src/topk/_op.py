"""The ``topk::ranged_topk`` custom op: validation, fake implementation, backend dispatch."""

from __future__ import annotations

import torch
from kernel_common import check_int, check_tensor, config_fields, define_config_op

from topk.config import TopkConfig, resolve_config
from topk.reference import ranged_topk_reference

_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ranged_topk_impl(
    scores: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor | None,
    *config,
) -> torch.Tensor:
    # The resolved TopkConfig's fields in declaration order (custom ops take no dataclasses).
    cfg = TopkConfig(*config)
    lead, n = scores.shape[:-1], scores.shape[-1]
    flat = scores.reshape(lead.numel(), n)  # not -1: N may be 0
    rows = flat.shape[0]
    lo = (
        starts.reshape(rows)
        if starts is not None
        else torch.zeros(rows, dtype=torch.int32, device=scores.device)
    )
    hi = (
        ends.reshape(rows)
        if ends is not None
        else torch.full((rows,), n, dtype=torch.int32, device=scores.device)
    )
    # Ranges are clipped to the row so that no backend can be asked to read outside it.
    lo = lo.clamp(0, n)
    hi = hi.clamp(0, n)
    if flat.is_cuda and cfg.backend == "triton":
        from topk._triton import launch_plan, ranged_topk_triton

        # The kernel needs unit column stride (any row stride): copy only when that is missing.
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        launch = launch_plan(cfg, n, k)
        return ranged_topk_triton(flat, k, lo, hi, launch).reshape(*lead, k)
    return ranged_topk_reference(flat, k, lo, hi).reshape(*lead, k)


_ranged_topk_op = define_config_op(
    "topk::ranged_topk",
    "Tensor scores, int k, Tensor? starts, Tensor? ends",
    "Tensor",
    TopkConfig,
    _ranged_topk_impl,
)


@torch.library.register_fake("topk::ranged_topk")
def _(scores, k, starts, ends, *config):
    return scores.new_empty((*scores.shape[:-1], k), dtype=torch.int32)


def ranged_topk(
    scores: torch.Tensor,
    k: int,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    *,
    config: TopkConfig | None = None,
) -> torch.Tensor:
    """Exact top-k column indices of each row of ``scores`` over its range ``[starts, ends)``.

    Args:
        scores: ``[..., N]`` float32 (bfloat16 / float16 are upcast). Columns outside a row's
            range are never read and may hold anything (NaN, inf, stale data).
        k: number of indices per row, ``k >= 1`` (``k > N`` is allowed: the tail is -1).
        starts, ends: int32 ``[...]`` (the leading shape of ``scores``), half-open per row and
            clipped to ``[0, N]``; ``None`` means 0 and ``N``.
        config: a :class:`TopkConfig`; default the measured per-arch table row
            (:func:`topk.resolve_config` tells which).

    Returns:
        int32 ``[..., k]``: the columns of the k largest in-range values in ascending column
        order, then -1 where fewer than k are selectable. -inf and NaN are never selected; ties
        at the k-th value keep the smaller column, so the result is a pure function of the scores.
    """
    op = "ranged_topk"
    check_tensor(op, "scores", scores, dtypes=_SCORE_DTYPES)
    if scores.dim() < 1:
        raise ValueError(
            f"{op}: scores must have shape [..., N] with at least one dimension, got []"
        )
    check_int(op, "k", k, minimum=1)
    lead = list(scores.shape[:-1])
    for name, t in (("starts", starts), ("ends", ends)):
        if t is not None:
            check_tensor(
                op,
                name,
                t,
                dtypes=(torch.int32,),
                shape=lead,
                layout="scores.shape[:-1]",
                device=scores.device,
            )
    fields = config_fields(resolve_config(scores, config).config)
    return _ranged_topk_op(scores, k, starts, ends, *fields)
