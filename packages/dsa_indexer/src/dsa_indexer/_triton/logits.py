"""Triton kernel for the indexer logits over per-query key ranges.

One program owns ``BLOCK_M`` consecutive queries and one chunk of the keys (all of them unless
the launch has too few query blocks to fill the GPU, see ``_split_n``), and scans only the part
of the union of their key ranges (``min start .. max end``) inside its chunk, in ``BLOCK_N``-key
tiles. The ``BLOCK_M * HP`` (query, head) pairs
form the N side of one tensor-core product per tile, ``k_tile [BLOCK_N, D] @ q_blockᵀ [D,
BLOCK_M * HP]``, so that the head reduction runs along the accumulator's columns: inside each
thread and across the lanes of a quad, with no trip through shared memory (with queries on the
M side it would cross warps). ``HP`` is the head count padded to a power of two; padded heads
have zero q and zero weight, so they add exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kernel_common import sm_count

from dsa_indexer._triton._common import check_head_dim, interpreted
from dsa_indexer.config import IndexerConfig

# -inf tile of the fill path: about this many fp32 per store instruction batch.
_FILL_ELEMENTS = 4096
# A launch with fewer query blocks than this many per SM splits the keys into chunks (one
# program per block and chunk) until it has about that many programs: a lightning block of
# 1024 queries is only 256 query blocks, each a serial scan of up to 128k keys, which leaves
# most of the GPU idle. Chunks hold about _MIN_SPLIT_N keys or more (64 tiles; at least half
# of it), so that the query block's operand load stays a small part of a program.
_PROGRAMS_PER_SM = 16
_MIN_SPLIT_N = 4096


@triton.jit
def _query_block(
    blk,
    q_ptr,
    w_ptr,
    starts_ptr,
    ends_ptr,
    T,
    T_kv,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Query block ``blk`` (``BLOCK_M`` queries): the first one, their rows, clamped ranges,
    the union ``[lo, hi)`` of the non-empty ones, and the (query, head) operand ``qt``
    ``[D, BLOCK_M * HP]`` with its weights ``wb``, loaded once and kept for every key tile."""
    t0 = blk * BLOCK_M

    offs_m = t0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    st = tl.load(starts_ptr + offs_m, mask=row_ok, other=0)
    en = tl.load(ends_ptr + offs_m, mask=row_ok, other=0)
    st = tl.maximum(st, 0)
    en = tl.minimum(en, T_kv)
    # Empty rows (and rows past T) must not widen the union.
    live = row_ok & (st < en)
    lo = tl.min(tl.where(live, st, T_kv), axis=0)
    hi = tl.max(tl.where(live, en, 0), axis=0)

    r = tl.arange(0, BLOCK_M * HP)
    r_t = t0 + r // HP
    r_h = r % HP
    r_ok = (r_t < T) & (r_h < H)
    offs_d = tl.arange(0, D)
    q_rows = q_ptr + (r_t.to(tl.int64) * H + r_h) * D
    qb = tl.load(q_rows[:, None] + offs_d[None, :], mask=r_ok[:, None], other=0.0)
    wb = tl.load(w_ptr + r_t.to(tl.int64) * H + r_h, mask=r_ok, other=0.0)
    if DOT_FP32:
        # The interpreter has no bf16 matmul (see _common.interpreted).
        qb = qb.to(tl.float32)
    return t0, offs_m, row_ok, st, en, lo, hi, tl.trans(qb), wb


@triton.jit
def _logits_tile(
    k_ptr,
    stride_k,
    s0,
    hi,
    st,
    en,
    qt,
    wb,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Keys ``offs_n = s0 + [0, BLOCK_N)`` (``col_ok``: below ``hi``) and the logits of the
    block's queries against them, ``[BLOCK_N, BLOCK_M]``, -inf outside each query's range.
    Both kernels below take their logits from here, so they compute the same values."""
    offs_n = s0 + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hi
    offs_d = tl.arange(0, D)
    kb = tl.load(
        k_ptr + offs_n.to(tl.int64)[:, None] * stride_k + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        kb = kb.to(tl.float32)
    s = tl.dot(kb, qt)  # [BLOCK_N, BLOCK_M * HP], fp32 accumulation
    s = tl.maximum(s, 0.0) * wb[None, :]
    logits = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, HP)), axis=2)  # [BLOCK_N, BLOCK_M]
    inside = (offs_n[:, None] >= st[None, :]) & (offs_n[:, None] < en[None, :])
    return offs_n, col_ok, tl.where(inside, logits, float("-inf"))


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    starts_ptr,
    ends_ptr,
    out_ptr,
    T,
    T_kv,
    stride_k,
    SPLITS,
    SPLIT_N,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FILL_N: tl.constexpr,
    CLEAN: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Program = (query block, key chunk of SPLIT_N columns), chunks fastest. Causal (and packed,
    # CP-shifted or compressed) ranges grow with the query index, so the last query block is
    # launched first: the longest programs run first and the short ones fill the grid's tail.
    pid = tl.program_id(0)
    blk = tl.cdiv(T, BLOCK_M) - 1 - pid // SPLITS
    c_lo = (pid % SPLITS) * SPLIT_N
    c_hi = tl.minimum(c_lo + SPLIT_N, T_kv)
    _t0, offs_m, row_ok, st, en, lo, hi, qt, wb = _query_block(
        blk, q_ptr, w_ptr, starts_ptr, ends_ptr, T, T_kv, H, D, HP, BLOCK_M, DOT_FP32
    )
    out_rows = out_ptr + offs_m.to(tl.int64) * T_kv  # T * T_kv exceeds 2^31
    # This program's share of the union of ranges (empty when the chunk misses it).
    lo_c = tl.maximum(lo, c_lo)
    hi_c = tl.minimum(hi, c_hi)

    if CLEAN:
        # Chunk columns outside the union are -inf for every row of the block: plain stores,
        # no math.
        fill_lo = tl.minimum(tl.maximum(lo, c_lo), c_hi)
        fill_hi = tl.minimum(tl.maximum(hi_c, fill_lo), c_hi)
        neg_tile = tl.full((BLOCK_M, FILL_N), float("-inf"), tl.float32)
        for c0 in range(c_lo, fill_lo, FILL_N):
            cols = c0 + tl.arange(0, FILL_N)
            tl.store(
                out_rows[:, None] + cols[None, :],
                neg_tile,
                mask=row_ok[:, None] & (cols < fill_lo)[None, :],
            )
        for c0 in range(fill_hi, c_hi, FILL_N):
            cols = c0 + tl.arange(0, FILL_N)
            tl.store(
                out_rows[:, None] + cols[None, :],
                neg_tile,
                mask=row_ok[:, None] & (cols < c_hi)[None, :],
            )

    for s0 in range(lo_c, hi_c, BLOCK_N):
        offs_n, col_ok, logits = _logits_tile(
            k_ptr, stride_k, s0, hi_c, st, en, qt, wb, D, HP, BLOCK_M, BLOCK_N, DOT_FP32
        )
        tl.store(
            out_rows[None, :] + offs_n[:, None],
            logits,
            mask=row_ok[None, :] & col_ok[:, None],
        )


def indexer_logits_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    clean: bool,
    *,
    config: IndexerConfig,
) -> torch.Tensor:
    """Indexer logits ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` over each query's key range.

    Args:
        q: bfloat16 ``[T, H, D]``, ``D`` a power of two >= 16 (64, 128); any ``H >= 1``.
        k: bfloat16 ``[T_kv, D]`` (rows may be strided).
        weights: float32 ``[T, H]``.
        starts, ends: int32 ``[T]``, the half-open key range of each query; clamped to
            ``[0, T_kv]``, and a range with ``start >= end`` is empty.
        clean: write -inf at every column outside each row's range. With ``clean=False`` the
            columns outside the union of a query block's ranges are left unwritten (the output
            comes from ``torch.empty``); columns inside the union but outside a row's own range
            are -inf either way.
        config: tiling (``logits_*`` fields).

    Returns:
        float32 ``[T, T_kv]``. Accumulation is fp32 over bf16 products on tensor cores. No host
        synchronisation; the grid depends only on shapes.
    """
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float32, device=q.device)
    indexer_logits_into(out, q, k, weights, starts, ends, clean, config=config)
    return out


def indexer_logits_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    clean: bool,
    *,
    config: IndexerConfig,
) -> None:
    """:func:`indexer_logits_triton` into a contiguous float32 ``[T, T_kv]`` buffer ``out``.

    Entries the contract leaves unwritten keep their old value (tests poison ``out`` first).
    Allocates nothing but contiguous copies of non-contiguous inputs.
    """
    t_q, heads, d = q.shape
    t_kv = k.shape[0]
    check_head_dim("indexer_logits_triton", d)
    if out.shape != (t_q, t_kv) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"indexer_logits_into: out must be contiguous float32 [{t_q}, {t_kv}]")
    if t_q == 0 or t_kv == 0:
        return
    q = q.contiguous()
    k = k if k.stride(1) == 1 else k.contiguous()
    hp = triton.next_power_of_2(heads)
    block_m = max(1, config.logits_block_rows // hp)
    blocks = triton.cdiv(t_q, block_m)
    split_n = _split_n(blocks, t_kv, config.logits_block_n, q.device)
    splits = triton.cdiv(t_kv, split_n)
    _indexer_logits_kernel[(blocks * splits,)](
        q,
        k,
        weights.contiguous(),
        starts.contiguous(),
        ends.contiguous(),
        out,
        t_q,
        t_kv,
        k.stride(0),
        splits,
        split_n,
        H=heads,
        D=d,
        HP=hp,
        BLOCK_M=block_m,
        BLOCK_N=config.logits_block_n,
        FILL_N=max(16, _FILL_ELEMENTS // block_m),
        CLEAN=bool(clean),
        DOT_FP32=interpreted(q.device),
        num_warps=config.logits_num_warps,
        num_stages=config.logits_num_stages,
    )


def _split_n(blocks: int, t_kv: int, block_n: int, device: torch.device) -> int:
    """Keys per program's chunk for a launch of ``blocks`` query blocks: all of them (one chunk)
    when the blocks alone fill the GPU, else chunks of a whole number of tiles, no more of them
    than ``ceil(T_kv / _MIN_SPLIT_N)``, few enough that blocks x chunks reach
    ``_PROGRAMS_PER_SM`` per SM. Depends only on shapes (no host
    synchronisation); every chunk computes the same logits."""
    target = _PROGRAMS_PER_SM * (sm_count(device) if device.type == "cuda" else 1)
    if blocks >= target or t_kv <= _MIN_SPLIT_N:
        return t_kv  # >= 1: indexer_logits_into returns before launching without keys
    splits = min(triton.cdiv(target, blocks), triton.cdiv(t_kv, _MIN_SPLIT_N))
    return triton.cdiv(triton.cdiv(t_kv, splits), block_n) * block_n
