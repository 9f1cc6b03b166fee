"""Fused indexer logits -> exact ranged top-k (Triton): the logits never reach HBM.

One program owns ``BLOCK_M`` consecutive queries and walks the union of their key ranges in
ascending key order, exactly like the logits kernel (the same query block and tile helpers, so
the same values bit for bit). Instead of storing a tile, each query appends its in-range logits
to its own *candidate list* in global scratch, ``C`` int64 entries (fp32 bits << 32 | column,
the entry format of :mod:`topk`'s lists), in column order, and keeps a threshold key ``theta``
(below every selectable key at first): only logits whose key exceeds ``theta`` are appended.

When a list could overflow at the next tile it is compacted in place to its exact top k (the
search of :func:`topk._triton.ranged_topk._list_threshold`; ties at the k-th value keep the
earlier entry, which is the smaller column) and ``theta`` becomes the smallest kept key. A later
logit whose key is <= ``theta`` can never enter the top k: k kept entries are at least as large,
and an equal one has a smaller column. At the end each list is resolved to its top k and written
in ascending column order with a -1 tail (``_resolve_list``): the indices that
:func:`topk.ranged_topk` returns for the logits kernel's output, bit for bit. Keys compare as
integers (``_keys``: -0.0 and +0.0 tie, NaN and -inf are never candidates), never as floats.

Cost against logits + top-k: no [rows, T_kv] logits written or read back; per tile a column
scan and a few scattered 8-byte stores; per compaction a search over the list held in registers.
A list takes about k + k ln(L / C) appends for a range of L keys in random order (about five
compactions at 128k keys, k = 2048); keys rising along the range append every logit and compact
every ``(C - k) / BLOCK_N`` tiles, which is slower than the two passes but still exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from topk._triton.ranged_topk import (
    _KINF,
    _KMIN,
    _NONE,
    _emit,
    _keys,
    _list_threshold,
    _resolve_list,
)

from dsa_indexer._triton._common import check_head_dim, interpreted
from dsa_indexer._triton.logits import _logits_tile, _query_block
from dsa_indexer.config import IndexerConfig

# The longest candidate list: its keys are held in registers by the search (32 per thread at 4
# warps for 4096 entries; 8192 spilled).
MAX_LIST = 4096
# Entries re-read per step of a list's in-place emit, and -1 entries per tail store.
_EMIT = 1024
_TAIL = 256


def list_slots(topk: int, block_n: int, num_warps: int) -> int:
    """Entries of each query's candidate list for ``topk``, ``block_n``-key tiles and programs
    of ``num_warps`` warps, or 0 where the fused kernel does not apply (a list must hold k
    entries and one more tile, and at most ``MAX_LIST``). Up to 4096 entries the list is at
    least 2k long, so that compactions (one per ``C - k`` appends) stay rare.

    A list has at least one entry per thread (``32 * num_warps``): then every reduction and
    scan of a compaction spans all warps, and so is a CTA-wide barrier, which the in-place
    compaction relies on (a list held whole by one warp would be reduced inside that warp, and
    its stores could overtake another warp's loads)."""
    slots = max(triton.next_power_of_2(topk + block_n), 32 * num_warps)
    while slots < 2 * topk and slots < 4096:
        slots *= 2
    return slots if slots <= MAX_LIST else 0


@triton.jit
def _compact(list_ptr, n, K: tl.constexpr, C: tl.constexpr, EMIT: tl.constexpr):
    """Keep the K largest of a list's ``n > K`` entries, in place and in order; return the
    smallest kept key.

    The keys are searched in registers; the entries are then re-read and moved in ``EMIT``
    blocks. In place is safe: block j moves entries only to positions below its own end, all
    of which were read before (the emit's cumsum is a CTA-wide barrier between the block's
    loads and its stores)."""
    j = tl.arange(0, C)
    valid = j < n
    keys = _keys((tl.load(list_ptr + j, mask=valid, other=0) >> 32).to(tl.int32), valid)
    t, r = _list_threshold(keys, n, _KMIN, _KINF, K, K)
    theta = tl.min(tl.where(keys >= t, keys, _KINF))
    base_gt = tl.full([], 0, tl.int32)
    base_eq = tl.full([], 0, tl.int32)
    for j0 in range(0, n, EMIT):
        jb = j0 + tl.arange(0, EMIT)
        ok = jb < n
        entry = tl.load(list_ptr + jb, mask=ok, other=0)
        block = _keys((entry >> 32).to(tl.int32), ok)
        base_gt, base_eq = _emit(block, entry, t, r, base_gt, base_eq, list_ptr)
    return theta


@triton.jit
def _indexer_logits_topk_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    starts_ptr,
    ends_ptr,
    list_base,
    counts_ptr,
    T,
    T_kv,
    stride_k,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    EMIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Append each query's candidates to its list (compacting it when full) and store the
    final list lengths in ``counts``."""
    # The last query block first: the longest (causal) programs start first.
    blk = tl.num_programs(0) - 1 - tl.program_id(0)
    t0, offs_m, row_ok, st, en, lo, hi, qt, wb = _query_block(
        blk, q_ptr, w_ptr, starts_ptr, ends_ptr, T, T_kv, H, D, HP, BLOCK_M, DOT_FP32
    )
    lists = list_base + offs_m.to(tl.int64) * C
    local = tl.arange(0, BLOCK_M)
    n = tl.zeros([BLOCK_M], tl.int32)
    theta = tl.full([BLOCK_M], _NONE, tl.int32)
    # Runs of tiles that cannot overflow any list (each tile appends at most BLOCK_N per
    # query), then the compactions the next tile may need. The run's loop has no branch, so
    # Triton software-pipelines its key loads as in the logits kernel; with the compaction test
    # inside it, the loads were not pipelined and the loop ran at about half the speed.
    s0 = lo
    while s0 < hi:
        room = (C - tl.max(n, 0)) // BLOCK_N  # >= 1: every list holds <= C - BLOCK_N
        s1 = tl.minimum(hi, s0 + room * BLOCK_N)
        for s in range(s0, s1, BLOCK_N):
            offs_n, col_ok, logits = _logits_tile(
                k_ptr, stride_k, s, hi, st, en, qt, wb, D, HP, BLOCK_M, BLOCK_N, DOT_FP32
            )
            bits = logits.to(tl.int32, bitcast=True)
            keys = _keys(bits, col_ok[:, None])  # -inf (outside the range) and NaN: _NONE
            take = keys > theta[None, :]
            count = take.to(tl.int32)
            pos = n[None, :] + tl.cumsum(count, 0) - 1
            entry = (bits.to(tl.int64) << 32) | offs_n.to(tl.uint32).to(tl.int64)[:, None]
            tl.store(lists[None, :] + pos, entry, mask=take)
            n += tl.sum(count, 0)
        s0 = s1
        if (s0 < hi) & (tl.max(n, 0) > C - BLOCK_N):
            tl.debug_barrier()  # the appends of every warp are in the lists
            for i in range(BLOCK_M):
                n_i = tl.sum(tl.where(local == i, n, 0), 0)
                if n_i > C - BLOCK_N:
                    th = _compact(list_base + (t0 + i).to(tl.int64) * C, n_i, K, C, EMIT)
                    n = tl.where(local == i, K, n)
                    theta = tl.where(local == i, th, theta)
                    tl.debug_barrier()  # the list is rewritten before anyone appends again

    # The final resolve is a second kernel: inlined here, its search and emit took the kernel
    # from 168 to 248 registers (32 heads), one CTA per SM fewer for the logits loop.
    tl.store(counts_ptr + offs_m, n, mask=row_ok)


@triton.jit
def _resolve_lists_kernel(
    list_base,
    counts_ptr,
    idx_ptr,
    T,
    K: tl.constexpr,
    C: tl.constexpr,
    EMIT: tl.constexpr,
    TAIL: tl.constexpr,
):
    """One row per program: the top K of its candidate list, ascending columns, -1 tail."""
    row = tl.program_id(0)
    n = tl.load(counts_ptr + row)
    k_eff = tl.minimum(n, K)
    out_row = idx_ptr + row.to(tl.int64) * K
    if n > 0:
        list_ptr = list_base + row.to(tl.int64) * C
        _resolve_list(list_ptr, n, _KMIN, _KINF, k_eff, K, out_row, C, EMIT)
    for j0 in range((k_eff // TAIL) * TAIL, K, TAIL):
        j = j0 + tl.arange(0, TAIL)
        tl.store(out_row + j, tl.full([TAIL], -1, tl.int32), mask=(j >= k_eff) & (j < K))


def indexer_logits_topk_into(
    indices: torch.Tensor,
    lists: torch.Tensor,
    counts: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    config: IndexerConfig,
) -> None:
    """The exact ranged top-k of the indexer logits into ``indices``, logits never stored.

    Args:
        indices: contiguous int32 ``[T, topk]``: written whole (ascending columns, -1 tail),
            equal to ``ranged_topk(indexer_logits(...), topk, starts, ends)`` with the same
            ``config``.
        lists, counts: scratch of any content (a caller reuses them for blocks of rows):
            contiguous int64 ``[>= T, list_slots(topk, logits_block_n, logits_num_warps)]``
            and int32 ``[>= T]``.
        q, k, weights, starts, ends: as in :func:`dsa_indexer._triton.indexer_logits_triton`.
        config: the logits tiling (``logits_*`` fields), the same as the two-pass path's.

    No host synchronisation; the grid depends only on shapes.
    """
    t_q, heads, d = q.shape
    topk = indices.shape[1]
    slots = list_slots(topk, config.logits_block_n, config.logits_num_warps)
    check_head_dim("indexer_logits_topk", d)
    if indices.shape != (t_q, topk) or indices.dtype != torch.int32:
        raise ValueError(f"indexer_logits_topk_into: indices must be int32 [{t_q}, topk]")
    if slots == 0 or lists.dtype != torch.int64 or lists.shape[0] < t_q or lists.shape[1] != slots:
        raise ValueError(
            f"indexer_logits_topk_into: lists must be int64 [>= {t_q}, {slots}] (topk={topk})"
        )
    if counts.dtype != torch.int32 or counts.shape[0] < t_q:
        raise ValueError(f"indexer_logits_topk_into: counts must be int32 [>= {t_q}]")
    if not (indices.is_contiguous() and lists.is_contiguous() and counts.is_contiguous()):
        raise ValueError("indexer_logits_topk_into: indices, lists and counts must be contiguous")
    if t_q == 0:
        return
    q = q.contiguous()
    k = k if k.stride(1) == 1 or k.shape[0] == 0 else k.contiguous()
    hp = triton.next_power_of_2(heads)
    block_m = max(1, config.logits_block_rows // hp)
    emit = min(_EMIT, slots)  # >= 32 * num_warps, as slots (see list_slots)
    _indexer_logits_topk_kernel[(triton.cdiv(t_q, block_m),)](
        q,
        k,
        weights.contiguous(),
        starts.contiguous(),
        ends.contiguous(),
        lists,
        counts,
        t_q,
        k.shape[0],
        max(k.stride(0), 1),
        H=heads,
        D=d,
        HP=hp,
        BLOCK_M=block_m,
        BLOCK_N=config.logits_block_n,
        K=topk,
        C=slots,
        EMIT=emit,
        DOT_FP32=interpreted(q.device),
        num_warps=config.logits_num_warps,
        num_stages=config.logits_num_stages,
        **({"maxnreg": config.fused_max_registers} if config.fused_max_registers else {}),
    )
    _resolve_lists_kernel[(t_q,)](
        lists,
        counts,
        indices,
        t_q,
        K=topk,
        C=slots,
        EMIT=emit,
        TAIL=min(_TAIL, triton.next_power_of_2(topk)),
        num_warps=4,
    )
