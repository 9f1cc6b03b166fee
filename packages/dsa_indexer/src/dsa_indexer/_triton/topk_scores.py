"""Triton kernels for the indexer score at selected key columns, forward and fused backward.

One program per query: it loads that query's ``[HP, D]`` heads once (``HP`` the head count
padded to a power of two >= 16, the smallest tensor-core dimension; padded heads have zero q
and zero weight) and walks its ``topk`` selected columns in ``BLOCK_K`` steps, gathering the
key rows by index. An index outside ``[0, T_kv)`` (the -1 padding, or any stray value) is a
padding slot: its key row is never read, its score is -inf and it contributes no gradient.

The backward recomputes the per-head scores ``s = K_sel @ qᵀ`` (the full logits are never
kept) and, with ``g`` the incoming gradient and ``ds = [s > 0] * w * g``:

* ``dweights[h] = sum_j relu(s[j, h]) * g[j]`` (fp32, on CUDA cores),
* ``dq = dsᵀ @ K_sel`` (accumulated over the steps as ``K_selᵀ @ ds`` so that D = 64 / 128 is
  the M side of the product),
* ``dk[idx[j]] += (ds @ q)[j]`` by fp32 atomic adds into a zeroed ``[T_kv, D]`` scratch, which
  the wrapper casts to bf16. Duplicated indices add once per occurrence. On sm_90 Triton
  already emits these as 16-byte vector reductions (``red.global.add.v4.f32``, SASS
  ``REDG.E.ADD.F32x4``), 16 per thread per 64 x 128 step; at 2 x the gathered bytes they are the
  backward's largest memory cost.

Two backward variants are config knobs, since which is faster per head count has to be measured
(``python -m dsa_bench.indexer --backward-sweep``): ``backward_rotate`` starts each query's walk
at its own step, so that programs running together do not add into the same dk rows at the same
time; ``backward_dk_split = 2`` computes the dk product and its atomics in two column halves,
for fewer live registers (Triton 3.6, sm_90, 32 heads x 128: 220 -> 164 per thread, three CTAs
per SM instead of two; at 64 heads it removes a small spill). ``backward_key_window`` runs long
key ranges as one pass per window of keys, so that each pass's dk scratch stays in L2.

``ds`` enters the two gradient products as bf16 (fp32 accumulation), as FlashAttention does
for its dS; the relative error this adds is ~2^-9 per term, a rel_diff of ~1e-6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsa_indexer._triton._common import check_head_dim, interpreted
from dsa_indexer.config import IndexerConfig


@triton.jit
def _load_query_cols(
    q_ptr,
    t,
    col0,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    COLS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Columns ``[col0, col0 + COLS)`` of query ``t``'s heads: ``[HP, COLS]``, zero at padded
    heads; bf16, or fp32 under the interpreter (which has no bf16 matmul, see
    _common.interpreted)."""
    offs_h = tl.arange(0, HP)
    offs_c = col0 + tl.arange(0, COLS)
    qc = tl.load(
        q_ptr + (t * H + offs_h)[:, None] * D + offs_c[None, :],
        mask=(offs_h < H)[:, None],
        other=0.0,
    )
    if DOT_FP32:
        qc = qc.to(tl.float32)
    return qc


@triton.jit
def _load_query(
    q_ptr, w_ptr, t, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DOT_FP32: tl.constexpr
):
    """Query ``t``'s heads ``[HP, D]`` (as :func:`_load_query_cols`) and their fp32 weights
    ``[HP]`` (zero at padded heads)."""
    qb = _load_query_cols(q_ptr, t, 0, H, D, HP, D, DOT_FP32)
    offs_h = tl.arange(0, HP)
    wb = tl.load(w_ptr + t * H + offs_h, mask=offs_h < H, other=0.0)
    return qb, wb


@triton.jit
def _gather_keys(
    k_ptr,
    row_idx,
    offs_j,
    key_lo,
    key_hi,
    TOPK,
    stride_k,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Gather the key rows of one query's slots ``offs_j`` (``[BLOCK_K]``).

    Returns ``(j_ok, valid, key_rows, kb)``: the slots inside ``[0, TOPK)``; those holding a
    key in ``[key_lo, key_hi)`` (a sub-range of ``[0, T_kv)``; the rest are padding here, never
    read); their key rows (int64, meaningless where not valid); and the keys ``[BLOCK_K, D]``,
    zero at padding, bf16 (fp32 under the interpreter).
    """
    offs_d = tl.arange(0, D)
    j_ok = offs_j < TOPK
    idx = tl.load(row_idx + offs_j, mask=j_ok, other=-1)
    valid = (idx >= key_lo) & (idx < key_hi)
    key_rows = idx.to(tl.int64)
    kb = tl.load(
        k_ptr + key_rows[:, None] * stride_k + offs_d[None, :], mask=valid[:, None], other=0.0
    )
    if DOT_FP32:
        kb = kb.to(tl.float32)
    return j_ok, valid, key_rows, kb


@triton.jit
def _topk_scores_fwd_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    idx_ptr,
    out_ptr,
    T_kv,
    TOPK,
    stride_k,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    qb, wb = _load_query(q_ptr, w_ptr, t, H, D, HP, DOT_FP32)
    qt = tl.trans(qb)
    row_idx = idx_ptr + t * TOPK
    row_out = out_ptr + t * TOPK

    for j0 in range(0, TOPK, BLOCK_K):
        offs_j = j0 + tl.arange(0, BLOCK_K)
        j_ok, valid, _, kb = _gather_keys(
            k_ptr, row_idx, offs_j, 0, T_kv, TOPK, stride_k, D, DOT_FP32
        )
        s = tl.dot(kb, qt)  # [BLOCK_K, HP]
        score = tl.sum(tl.maximum(s, 0.0) * wb[None, :], axis=1)
        tl.store(row_out + offs_j, tl.where(valid, score, float("-inf")), mask=j_ok)


@triton.jit
def _add_dk(dk_acc_ptr, key_rows, valid, ds, q_cols, col0, D: tl.constexpr, COLS: tl.constexpr):
    """``dk_acc[key_rows, col0 : col0 + COLS] += ds @ q_cols`` by fp32 atomics, valid rows only.

    ``ds`` is ``[BLOCK_K, HP]``, ``q_cols`` ``[HP, COLS]`` (both the dot dtype).
    """
    offs_c = col0 + tl.arange(0, COLS)
    tl.atomic_add(
        dk_acc_ptr + key_rows[:, None] * D + offs_c[None, :],
        tl.dot(ds, q_cols),
        mask=valid[:, None],
        sem="relaxed",
    )


@triton.jit
def _window_blocks(row_idx, key_lo, key_hi, TOPK, BLOCK_K: tl.constexpr, SCAN: tl.constexpr):
    """``(j_begin, blocks)``: the ``BLOCK_K``-slot blocks from the one holding the row's first
    slot with a key in ``[key_lo, key_hi)`` to the one holding its last (none: 0 blocks)."""
    first = TOPK
    last = -1
    for c0 in range(0, TOPK, SCAN):
        offs_c = c0 + tl.arange(0, SCAN)
        idx = tl.load(row_idx + offs_c, mask=offs_c < TOPK, other=-1)
        inside = (idx >= key_lo) & (idx < key_hi)
        first = tl.minimum(first, tl.min(tl.where(inside, offs_c, TOPK)))
        last = tl.maximum(last, tl.max(tl.where(inside, offs_c, -1)))
    j_begin = (first // BLOCK_K) * BLOCK_K
    return j_begin, tl.cdiv(tl.maximum(last + 1 - j_begin, 0), BLOCK_K)


@triton.jit
def _store_dq_dw(dq_ptrs, dw_ptrs, dq_t, dw, h_ok):
    tl.store(dq_ptrs, dq_t.to(dq_ptrs.dtype.element_ty), mask=h_ok[None, :])
    tl.store(dw_ptrs, dw, mask=h_ok)


@triton.jit
def _topk_scores_bwd_kernel(
    grad_ptr,
    q_ptr,
    k_ptr,
    w_ptr,
    idx_ptr,
    dq_ptr,
    dk_acc_ptr,
    dw_ptr,
    key_lo,
    key_hi,
    TOPK,
    stride_k,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROTATE: tl.constexpr,
    DK_SPLIT: tl.constexpr,
    WINDOWED: tl.constexpr,
    SCAN: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One query's gradients from its slots holding keys in ``[key_lo, key_hi)``.

    Not ``WINDOWED``: one pass over all keys (``[0, T_kv)``); the program walks every slot and
    stores dq and dweights. ``WINDOWED``: one of several passes over key windows (see
    :func:`topk_scores_backward_into`). The program first finds the first and last slot of its
    row in the window and walks only the blocks between them (for ascending rows, as the ranged
    top-k delivers them, those are the window's slots; any other row is still right, just not
    shorter); the pass of the window at key 0 stores dq and dweights, later passes add to them
    where the row has a slot in their window.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < H
    qb, wb = _load_query(q_ptr, w_ptr, t, H, D, HP, DOT_FP32)
    qt = tl.trans(qb)
    # The dk product in DK_SPLIT column blocks, each dotted and added before the next: its
    # fp32 [BLOCK_K, D / DK_SPLIT] tile, with the layout change before the vector atomics,
    # is what sets the peak register count.
    DC: tl.constexpr = D // DK_SPLIT
    if DK_SPLIT == 2:
        q_lo = _load_query_cols(q_ptr, t, 0, H, D, HP, DC, DOT_FP32)
        q_hi = _load_query_cols(q_ptr, t, DC, H, D, HP, DC, DOT_FP32)
    row_idx = idx_ptr + t * TOPK
    row_grad = grad_ptr + t * TOPK
    if WINDOWED:
        j_begin, blocks = _window_blocks(row_idx, key_lo, key_hi, TOPK, BLOCK_K, SCAN)
        steps_end = blocks * BLOCK_K
    else:
        # Constants rather than the arguments: the one-pass kernel then compiles to fewer
        # registers (Triton 3.6, sm_90: 166 instead of 177 at 32 heads, three CTAs per SM).
        key_lo = 0
        j_begin = 0
        blocks = tl.cdiv(TOPK, BLOCK_K)
        steps_end = TOPK
    wrap = blocks * BLOCK_K
    start = 0
    if ROTATE:
        # Programs that run together are adjacent queries, which select nearly the same keys
        # in the same order: starting each walk at its own step spreads their atomic adds
        # over the key rows instead of piling them onto the same rows at the same time.
        start = (tl.program_id(0) % tl.maximum(blocks, 1)) * BLOCK_K

    dq_t = tl.zeros((D, HP), dtype=tl.float32)
    # Reduced over the keys every step rather than kept as a [BLOCK_K, HP] accumulator summed
    # at the end: that costs ~40 more registers per thread in sm_90 codegen, one CTA less per SM
    # at 8-16 heads.
    dw = tl.zeros((HP,), dtype=tl.float32)
    for j0 in range(0, steps_end, BLOCK_K):
        jb = j0
        if ROTATE:
            jb = j0 + start
            jb = tl.where(jb < wrap, jb, jb - wrap)
        offs_j = j_begin + jb + tl.arange(0, BLOCK_K)
        _, valid, key_rows, kb = _gather_keys(
            k_ptr, row_idx, offs_j, key_lo, key_hi, TOPK, stride_k, D, DOT_FP32
        )
        # Padding slots may carry any gradient (even NaN at a -inf score): never read it.
        g = tl.load(row_grad + offs_j, mask=valid, other=0.0)
        s = tl.dot(kb, qt)  # [BLOCK_K, HP], recomputed scores
        active = s > 0.0
        dw += tl.sum(tl.where(active, s, 0.0) * g[:, None], axis=0)
        ds = tl.where(active, wb[None, :] * g[:, None], 0.0)
        ds = ds.to(kb.dtype)
        dq_t = tl.dot(tl.trans(kb), ds, dq_t)  # [D, HP]
        if DK_SPLIT == 2:
            _add_dk(dk_acc_ptr, key_rows, valid, ds, q_lo, 0, D, DC)
            _add_dk(dk_acc_ptr, key_rows, valid, ds, q_hi, DC, D, DC)
        else:
            _add_dk(dk_acc_ptr, key_rows, valid, ds, qb, 0, D, D)

    dq_off_t = (t * H + offs_h)[None, :] * D + offs_d[:, None]  # [D, HP], matches dq_t
    dq_ptrs = dq_ptr + dq_off_t
    dw_ptrs = dw_ptr + t * H + offs_h
    if WINDOWED:
        if key_lo > 0:
            if blocks > 0:
                # A later window adds to what the earlier passes stored (the stream orders
                # them); a bf16 dq is rounded once per pass that touches the row.
                dq_t += tl.load(dq_ptrs, mask=h_ok[None, :], other=0.0).to(tl.float32)
                dw += tl.load(dw_ptrs, mask=h_ok, other=0.0)
                _store_dq_dw(dq_ptrs, dw_ptrs, dq_t, dw, h_ok)
        else:
            _store_dq_dw(dq_ptrs, dw_ptrs, dq_t, dw, h_ok)
    else:
        _store_dq_dw(dq_ptrs, dw_ptrs, dq_t, dw, h_ok)


def _prepare(op, q, k, weights, indices):
    check_head_dim(op, q.shape[2])
    q = q.contiguous()
    k = k if k.stride(1) == 1 else k.contiguous()
    return q, k, weights.contiguous(), indices.contiguous()


def _check_out(op, name, t, shape, dtypes):
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous {dtypes} of shape {list(shape)}")


def indexer_topk_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig,
) -> torch.Tensor:
    """The indexer score at the selected key columns.

    Args:
        q: bfloat16 ``[T, H, D]``, ``D`` a power of two >= 16 (64, 128); any ``H >= 1``.
        k: bfloat16 ``[T_kv, D]`` (rows may be strided).
        weights: float32 ``[T, H]``.
        indices: int32 ``[T, topk]``, any ``topk >= 1``; entries outside ``[0, T_kv)`` (the -1
            padding included) are padding and never read out of bounds.
        config: tiling (``scores_*`` fields).

    Returns:
        float32 ``[T, topk]``: ``sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])``,
        -inf at padding slots.
    """
    out = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
    indexer_topk_scores_into(out, q, k, weights, indices, config=config)
    return out


def indexer_topk_scores_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig,
) -> None:
    """:func:`indexer_topk_scores_triton` into a contiguous float32 ``[T, topk]`` buffer."""
    op = "indexer_topk_scores_triton"
    q, k, weights, indices = _prepare(op, q, k, weights, indices)
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    _check_out(op, "out", out, (t_q, topk), (torch.float32,))
    if t_q == 0 or topk == 0:
        return
    _topk_scores_fwd_kernel[(t_q,)](
        q,
        k,
        weights,
        indices,
        out,
        k.shape[0],
        topk,
        k.stride(0),
        H=heads,
        D=d,
        HP=max(16, triton.next_power_of_2(heads)),
        BLOCK_K=config.scores_block_k,
        DOT_FP32=interpreted(q.device),
        num_warps=config.scores_num_warps,
        num_stages=config.scores_num_stages,
    )


def indexer_topk_scores_backward_triton(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`indexer_topk_scores_triton` w.r.t. q, k and weights.

    Args:
        grad: float32 ``[T, topk]``, the gradient of the scores (ignored at padding slots,
            whatever it holds there).
        q, k, weights, indices: as in :func:`indexer_topk_scores_triton`.
        config: tiling (``backward_*`` fields).

    Returns:
        ``(dq, dk, dweights)``: bfloat16 ``[T, H, D]``, bfloat16 ``[T_kv, D]`` and float32
        ``[T, H]``. The scores are recomputed from q, k and the indices; all sums run in fp32
        (dk through fp32 atomics into a scratch buffer, so its summation order varies from run
        to run); padding slots contribute nothing.
    """
    # The interpreter's own bf16 cast truncates: there dq is rounded by torch instead.
    dq_dtype = torch.float32 if interpreted(q.device) else q.dtype
    dq = torch.empty(q.shape, dtype=dq_dtype, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dw = torch.empty(weights.shape, dtype=torch.float32, device=q.device)
    topk_scores_backward_into(dq, dk_acc, dw, grad, q, k, weights, indices, config=config)
    return dq.to(q.dtype), dk_acc.to(k.dtype), dw


def topk_scores_backward_into(
    dq: torch.Tensor,
    dk_acc: torch.Tensor,
    dw: torch.Tensor,
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    *,
    config: IndexerConfig,
) -> None:
    """The backward into caller buffers: every entry of ``dq`` (bf16 or float32 ``[T, H, D]``)
    and ``dw`` (float32 ``[T, H]``) is written; ``dk_acc`` (float32 ``[T_kv, D]``, zeroed by the
    caller) receives the atomic adds. Tests pass float32 ``dq`` to check the accumulations.

    With ``config.backward_key_window = W`` and ``T_kv > W`` the work runs as one launch per
    window of W keys, in key order: the dk scratch rows and key rows that a launch touches then
    fit in L2 together, where one launch over all keys would spread its reduce-adds over the
    whole scratch (64 MB of fp32 at 128k keys x 128, more than the H200's 60 MB L2). The
    gathered bytes stay the same; each pass re-reads q and the index rows, and a bf16 dq is
    rounded once per pass that touches the query (rel_diff ~1e-6 each).
    """
    op = "indexer_topk_scores_backward_triton"
    q, k, weights, indices = _prepare(op, q, k, weights, indices)
    grad = grad.contiguous()
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    _check_out(op, "dq", dq, q.shape, (torch.bfloat16, torch.float32))
    _check_out(op, "dk_acc", dk_acc, k.shape, (torch.float32,))
    _check_out(op, "dw", dw, weights.shape, (torch.float32,))
    if t_q == 0:
        return
    t_kv = k.shape[0]
    window = config.backward_key_window
    windowed = 0 < window < t_kv
    step = window if windowed else max(t_kv, 1)
    # One launch at least, also without keys: the first pass writes every dq and dweights row.
    for key_lo in range(0, max(t_kv, 1), step):
        _topk_scores_bwd_kernel[(t_q,)](
            grad,
            q,
            k,
            weights,
            indices,
            dq,
            dk_acc,
            dw,
            key_lo,
            min(t_kv, key_lo + step),
            topk,
            k.stride(0),
            H=heads,
            D=d,
            HP=max(16, triton.next_power_of_2(heads)),
            BLOCK_K=config.backward_block_k,
            ROTATE=config.backward_rotate,
            # A column block narrower than 16 is below the tensor-core minimum: no split there.
            DK_SPLIT=config.backward_dk_split if d // config.backward_dk_split >= 16 else 1,
            WINDOWED=windowed,
            SCAN=1024,
            DOT_FP32=interpreted(q.device),
            num_warps=config.backward_num_warps,
            num_stages=config.backward_num_stages,
        )
