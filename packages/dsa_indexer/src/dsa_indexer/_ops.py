"""Public indexer entries: validation, ``dsa_indexer::*`` custom ops, autograd, dispatch.

Each entry checks its arguments and resolves one complete :class:`IndexerConfig`
(:func:`dsa_indexer.resolve_config`); the custom ops receive its fields as typed static arguments
(custom ops take no dataclasses; ``kernel_common.define_config_op`` writes them into each op's
schema) in declaration order, rebuild the config and run the Triton kernels or the torch
reference.
"""

from __future__ import annotations

import torch
from kernel_common import check_indices, check_int, check_tensor, config_fields, define_config_op
from topk import ranged_topk

from dsa_indexer import reference
from dsa_indexer.config import IndexerConfig, resolve_config

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


def _config_fields(q: torch.Tensor, config: IndexerConfig | None) -> tuple:
    """The resolved config's fields, in declaration order: the ops' static arguments."""
    return config_fields(resolve_config(q, config).config)


def _indexer_logits_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    clean: bool,
    *config,
) -> torch.Tensor:
    cfg = IndexerConfig(*config)
    if cfg.backend == "triton":
        from dsa_indexer._triton import indexer_logits_triton

        return indexer_logits_triton(q, k, weights, starts, ends, clean, config=cfg)
    # The reference always writes -inf outside the ranges, which satisfies clean=False too.
    return reference.indexer_logits_reference(q, k, weights, starts, ends)


_indexer_logits_op = define_config_op(
    "dsa_indexer::indexer_logits",
    "Tensor q, Tensor k, Tensor weights, Tensor starts, Tensor ends, bool clean",
    "Tensor",
    IndexerConfig,
    _indexer_logits_impl,
)


@torch.library.register_fake("dsa_indexer::indexer_logits")
def _(q, k, weights, starts, ends, clean, *config):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


# The logits are not differentiable by contract (the scores at the selected columns are). An
# autograd registration that marks the output non-differentiable lets inputs that require grad
# through opcheck and torch.compile, and the output claims no gradient.
def _logits_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _logits_backward(ctx, grad):
    raise RuntimeError("indexer_logits is not differentiable")


torch.library.register_autograd(
    "dsa_indexer::indexer_logits", _logits_backward, setup_context=_logits_setup_context
)


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
        config: an :class:`IndexerConfig`; default the measured per-arch table row
            (:func:`dsa_indexer.resolve_config` tells which).

    Returns:
        float32 ``[T, T_kv]``: ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` for ``s`` in range.
        Not differentiable (use :func:`indexer_topk_scores` for the selected scores).
    """
    op = "indexer_logits"
    _check_qkw(op, q, k, weights)
    _check_ranges(op, q, starts, ends)
    return _indexer_logits_op(q, k, weights, starts, ends, bool(clean), *_config_fields(q, config))


def _topk_scores_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *config,
) -> torch.Tensor:
    cfg = IndexerConfig(*config)
    if cfg.backend == "triton":
        from dsa_indexer._triton import indexer_topk_scores_triton

        return indexer_topk_scores_triton(q, k, weights, indices, config=cfg)
    check_indices("indexer_topk_scores", "indices", indices, k.shape[0], "T_kv")
    return reference.indexer_topk_scores_reference(q, k, weights, indices)


_topk_scores_op = define_config_op(
    "dsa_indexer::indexer_topk_scores",
    "Tensor q, Tensor k, Tensor weights, Tensor indices",
    "Tensor",
    IndexerConfig,
    _topk_scores_impl,
)


@torch.library.register_fake("dsa_indexer::indexer_topk_scores")
def _(q, k, weights, indices, *config):
    return q.new_empty(indices.shape, dtype=torch.float32)


def _topk_scores_backward_impl(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = IndexerConfig(*config)
    if cfg.backend == "triton":
        from dsa_indexer._triton import indexer_topk_scores_backward_triton

        return indexer_topk_scores_backward_triton(grad, q, k, weights, indices, config=cfg)
    return reference.indexer_topk_scores_backward_reference(grad, q, k, weights, indices)


_topk_scores_backward_op = define_config_op(
    "dsa_indexer::indexer_topk_scores_backward",
    "Tensor grad, Tensor q, Tensor k, Tensor weights, Tensor indices",
    "(Tensor, Tensor, Tensor)",
    IndexerConfig,
    _topk_scores_backward_impl,
)


@torch.library.register_fake("dsa_indexer::indexer_topk_scores_backward")
def _(grad, q, k, weights, indices, *config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights, dtype=torch.float32)


def _scores_setup_context(ctx, inputs, output):
    q, k, weights, indices, *config = inputs
    ctx.save_for_backward(q, k, weights, indices)
    ctx.config = config


def _scores_backward(ctx, grad):
    q, k, weights, indices = ctx.saved_tensors
    dq, dk, dw = _topk_scores_backward_op(grad.contiguous(), q, k, weights, indices, *ctx.config)
    return dq, dk, dw, None, *(None,) * len(ctx.config)


torch.library.register_autograd(
    "dsa_indexer::indexer_topk_scores", _scores_backward, setup_context=_scores_setup_context
)


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
        config: an :class:`IndexerConfig`; default the measured per-arch table row
            (:func:`dsa_indexer.resolve_config` tells which).

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
    return _topk_scores_op(q, k, weights, indices, *_config_fields(q, config))


DEFAULT_LOGITS_BUDGET = 1 << 30
"""Bytes of working memory :func:`lightning_indexer` holds at once by default (1 GiB: 2048 query
rows of fp32 logits at 131072 keys, or 32768 rows of fused top-k candidate lists at topk 2048;
shorter inputs fit whole)."""

# Query blocks are whole multiples of this many rows (when larger than it), so that a block
# boundary never splits a group of queries that a logits program computes together.
_BLOCK_ALIGN = 64


def _fused_slots(cfg: IndexerConfig, topk: int, t_kv: int) -> int:
    """Entries per query of the fused kernel's candidate list, 0 where the two passes run
    (also without keys: their logits blocks take no memory)."""
    if cfg.backend != "triton" or not cfg.lightning_fused or t_kv == 0:
        return 0
    from dsa_indexer._triton.logits_topk import list_slots

    return list_slots(topk, cfg.logits_block_n, cfg.logits_num_warps)


def _row_bytes(t_kv: int, slots: int) -> tuple[int, str]:
    """Working bytes per query row, and what they hold (for the budget's error message)."""
    if slots:
        return 8 * slots + 4, f"top-k candidates (8 * {slots} + 4 = {8 * slots + 4} bytes)"
    return 4 * t_kv, f"logits (4 * T_kv = {4 * t_kv} bytes)"


def _block_rows(op: str, t_q: int, t_kv: int, slots: int, budget: int) -> int:
    """Query rows per block for a budget of ``budget`` bytes of logits or candidate lists; all
    rows when there are no keys (nothing to select from)."""
    if t_kv == 0:
        return max(t_q, 1)
    row, what = _row_bytes(t_kv, slots)
    if budget < row:
        raise ValueError(
            f"{op}: logits_budget_bytes={budget} is below one row of {what}; pass at least {row}"
        )
    return _aligned(budget // row)


def _aligned(rows: int) -> int:
    """``rows`` rounded down to whole ``_BLOCK_ALIGN`` groups, when it holds one."""
    return rows if rows < _BLOCK_ALIGN else rows // _BLOCK_ALIGN * _BLOCK_ALIGN


# Two CUDA streams per device for the blocked path (created once; see _blocks_on_lanes).
_LANES: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def _lanes(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    if device not in _LANES:
        _LANES[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _LANES[device]


def _lightning_indices_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    block_rows: int,
    *config,
) -> torch.Tensor:
    cfg = IndexerConfig(*config)
    t_q = q.shape[0]
    indices = torch.empty(t_q, topk, dtype=torch.int32, device=q.device)
    if cfg.backend != "triton":
        # One block of query rows at a time: its logits, then their top-k. Every row's logits,
        # and so its indices, are those of a whole pass.
        for r0 in range(0, t_q, block_rows):
            r1 = min(t_q, r0 + block_rows)
            logits = reference.indexer_logits_reference(
                q[r0:r1], k, weights[r0:r1], starts[r0:r1], ends[r0:r1]
            )
            indices[r0:r1] = ranged_topk(logits, topk, starts[r0:r1], ends[r0:r1])
        return indices
    if t_q == 0 or k.shape[0] == 0:
        return indices.fill_(-1)  # nothing to select from
    # Past one block on CUDA, two half-size blocks are in flight on two streams (see
    # _blocks_on_lanes); one stream for a single block, blocks of one row that cannot be
    # halved, or the Triton interpreter on CPU tensors.
    lanes = t_q > block_rows and block_rows >= 2 and q.device.type == "cuda"
    step = _aligned(block_rows // 2) if lanes else min(t_q, block_rows)
    slots = _fused_slots(cfg, topk, k.shape[0])
    blocks = _Blocks((q, k, weights, starts, ends), indices, step, slots, cfg)
    if lanes:
        _blocks_on_lanes(blocks)
    else:
        buffer = blocks.buffer()
        for i in range(blocks.count):
            blocks.run(i, buffer)
    return indices


class _Blocks:
    """The query blocks (``step`` rows each) of one :func:`lightning_indexer` call on the Triton
    backend and what they share, prepared once so that a block costs the host two kernel
    launches and no allocation: at 128k keys and the default budget there are 128 blocks, and
    the early causal ones hold so little work that more host time per block leaves the GPU idle.

    A block either runs the fused kernel into candidate lists (``slots > 0``), or writes its
    logits into a buffer (unclean: the top-k reads only each row's range) that the top-k kernel
    then reduces, with the ranges clipped to the row once for all blocks, one zeroed row counter
    per block and a reused candidate scratch.
    """

    def __init__(self, rows, indices, step, slots, cfg):
        self.rows, self.indices, self.step = rows, indices, step  # >= 1: T, T_kv >= 1 here
        self.slots, self.cfg = slots, cfg
        q, k, _, starts, ends = rows
        self.count = -(-q.shape[0] // self.step)
        if slots:
            return
        from topk import TopkConfig
        from topk import resolve_config as topk_config
        from topk._triton import launch_plan

        t_kv = k.shape[0]
        # The Triton indexer runs on CUDA devices, whose top-k table rows are Triton ones, or
        # under the interpreter on CPU tensors (the top-k's default tiling there).
        topk_cfg = topk_config(q).config if q.is_cuda else TopkConfig()
        self.launch = launch_plan(topk_cfg, t_kv, self.indices.shape[1])
        self.lo = starts.clamp(0, t_kv)
        self.hi = ends.clamp(0, t_kv)
        self.counters = torch.zeros(self.count, dtype=torch.int32, device=q.device)

    def buffer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Working memory for one block: the fused kernel's candidate lists (int64
        ``[step, slots]``) and their lengths (int32 ``[step]``), or fp32 logits
        ``[step, T_kv]`` and the top-k's candidate scratch."""
        q, k = self.rows[0], self.rows[1]
        if self.slots:
            return (
                q.new_empty((self.step, self.slots), dtype=torch.int64),
                q.new_empty((self.step,), dtype=torch.int32),
            )
        from topk._triton import topk_scratch

        logits = q.new_empty((self.step, k.shape[0]), dtype=torch.float32)
        return logits, topk_scratch(self.step, q.device, self.launch)

    def run(self, i: int, buffer) -> None:
        """Block ``i``: its rows' top-k into the indices, on the current stream."""
        q, k, weights, starts, ends = self.rows
        r0 = i * self.step
        r1 = min(q.shape[0], r0 + self.step)
        part = (q[r0:r1], k, weights[r0:r1], starts[r0:r1], ends[r0:r1])
        indices = self.indices[r0:r1]
        if self.slots:
            from dsa_indexer._triton.logits_topk import indexer_logits_topk_into

            indexer_logits_topk_into(indices, *buffer, *part, config=self.cfg)
        else:
            from topk._triton import ranged_topk_into

            from dsa_indexer._triton.logits import indexer_logits_into

            logits = buffer[0][: r1 - r0]
            indexer_logits_into(logits, *part, False, config=self.cfg)
            ranged_topk_into(
                indices,
                logits,
                self.lo[r0:r1],
                self.hi[r0:r1],
                self.launch,
                buffer[1],
                self.counters[i : i + 1],
            )


def _blocks_on_lanes(blocks: _Blocks) -> None:
    """Blocks (half the budget each) alternating between two streams, each with its own
    buffer: one block's top-k (memory-bound) overlaps the other's logits (tensor cores), and
    each launch's ramp and drain is filled by the other stream's work (one stream took the 128k
    causal forward from 172 to 191 ms). Both streams start after, and the caller's stream
    continues after, all the blocks (CUDA-graph capture records the fork and the join)."""
    device = blocks.rows[0].device
    main = torch.cuda.current_stream(device)
    lanes = _lanes(device)
    buffers = [blocks.buffer() for _ in lanes]
    for lane in lanes:
        lane.wait_stream(main)
    for i in range(blocks.count):
        with torch.cuda.stream(lanes[i % 2]):
            blocks.run(i, buffers[i % 2])
    for lane in lanes:
        main.wait_stream(lane)
    # The buffers (and the shared clipped ranges and counters) were allocated on the caller's
    # stream, which has waited for both lanes: they may be reused from here on.


_lightning_indices_op = define_config_op(
    "dsa_indexer::lightning_indices",
    "Tensor q, Tensor k, Tensor weights, Tensor starts, Tensor ends, int topk, int block_rows",
    "Tensor",
    IndexerConfig,
    _lightning_indices_impl,
)


@torch.library.register_fake("dsa_indexer::lightning_indices")
def _(q, k, weights, starts, ends, topk, block_rows, *config):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    *,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET,
    config: IndexerConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer logits -> exact ranged top-k -> differentiable scores, in bounded memory.

    Arguments as in :func:`indexer_logits`; ``topk >= 1``. The logits are reduced to their
    top-k in blocks of query rows (on CUDA, past one block, two half-size blocks are in flight
    on two streams), so at most ``logits_budget_bytes`` of working memory exist at once (default
    1 GiB), never the whole ``[T, T_kv]`` logits: the extra memory does not grow with
    ``T * T_kv``. A block's working memory is either its fp32 logits (``4 * T_kv`` bytes a row),
    which the ranged top-k kernel then reduces (plus its candidate scratch, outside the budget:
    about 70 MB per stream at topk 2048 on an H200), or, where the config sets
    ``lightning_fused``, the candidate lists of the fused logits -> top-k kernel
    (``8 * slots + 4`` bytes a row, 32 KB at topk 2048, independent of ``T_kv``), which never
    stores the logits. The budget must hold
    one row (a ``ValueError`` says how many bytes). Either way the indices are bit for bit those
    of one pass over the whole logits. No host synchronisation (CUDA graphs and
    ``torch.compile`` see one op).

    Returns ``(scores, indices)``: float32 ``[T, topk]`` (differentiable w.r.t. q, k, weights;
    -inf at padding) and int32 ``[T, topk]`` (ascending columns, -1 tail where a range holds
    fewer than ``topk`` keys). The backward recomputes the scores at the indices
    (:func:`indexer_topk_scores`), so it needs no logits either.
    """
    op = "lightning_indexer"
    _check_qkw(op, q, k, weights)
    _check_ranges(op, q, starts, ends)
    check_int(op, "topk", topk, minimum=1)
    check_int(op, "logits_budget_bytes", logits_budget_bytes, minimum=1)
    lookup = resolve_config(q, config)
    slots = _fused_slots(lookup.config, topk, k.shape[0])
    block_rows = _block_rows(op, q.shape[0], k.shape[0], slots, logits_budget_bytes)
    fields = config_fields(lookup.config)
    indices = _lightning_indices_op(q, k, weights, starts, ends, topk, block_rows, *fields)
    return _topk_scores_op(q, k, weights, indices, *fields), indices
