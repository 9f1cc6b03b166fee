"""Triton kernel of ``sparse_attention_probs``: head-summed probabilities of the selected keys.

One program per (query, kv group) holds the group's query heads (a block of ``HB`` rows, the M
side of the tensor-core product) for the whole walk over the query's index row in ``BLOCK_K``
slots: it gathers the slots' K rows (the whole width, split as ``D_MAIN + D_TAIL`` columns, both
powers of two: 512 + 64 for the RoPE layout), forms ``S = Q K^T`` and
``P = exp2(S * sm_scale * log2(e) - lse2)`` with the forward's lse, and stores the column sums of
``P`` over the heads. The per-head probabilities live only in registers; V is never read. A
group of more than ``HB`` heads is walked once per head block, each later walk adding to the
row it stored (one program owns the row: deterministic, no atomics).

An index is a key when it lies in ``[0, S_kv)``; every other value is padding and gets 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kernel_common import next_pow2, shared_memory_per_block
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LOG2E

# Launches (BLOCK_K, num_stages) in order of preference, the first whose shared memory fits
# the device: 64 slots per step (the N side of the product) with 2 stages of the key gather in
# flight is the fastest of 32/64/128 slots x 4/8 warps x 1/2/3 stages at glm5 64 and 8 heads,
# 16k tokens on the H200 (10.3 and 5.7 ms; 8 warps 15.3 and 6.6 ms;
# benchmarks/results/probs_sweep.log); wider rows (768 at 64 heads needs 289 KiB that way) keep
# the pipelining with fewer slots first, then drop it.
_LAUNCHES = ((64, 2), (32, 2), (64, 1), (32, 1), (16, 1))
_WARPS = 4
_MAX_HEAD_BLOCK = 64
# Triton's shared memory beyond the Q block and the staged key tiles (its barriers): 1 KiB for
# sm_90 (tests/dsa_sparse_attention/test_probs.py::test_triton_launch_fits compiles and checks).
_SMEM_SLACK = 1024


def head_block(heads_per_group: int) -> int:
    """Heads per program, the head side of the products (the M side here, the N side in the
    forward, which shares this block): 16 is the tensor-core minimum, 64 the most one holds."""
    return min(max(16, next_pow2(heads_per_group)), _MAX_HEAD_BLOCK)


def launch_config(d: int, heads_per_group: int, smem_limit: int) -> tuple[int, int] | None:
    """``(BLOCK_K, num_stages)`` for ``D`` and heads per group within ``smem_limit`` bytes of
    shared memory per block, or None where D has no :func:`split_width` or no launch fits.

    The kernel keeps the head block's Q and ``num_stages`` gathered key tiles in shared memory:
    ``(head_block + num_stages * BLOCK_K) * D * 2`` bytes plus the slack.
    """
    if split_width(d) is None:
        return None
    hb = head_block(heads_per_group)
    for block_k, stages in _LAUNCHES:
        if (hb + stages * block_k) * d * 2 + _SMEM_SLACK <= smem_limit:
            return block_k, stages
    return None


@triton.jit
def _load_q(q_ptr, q_row, h0, HG: tl.constexpr, D: tl.constexpr, col0, HB: tl.constexpr,
            COLS: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """Columns [col0, col0 + COLS) of the group's heads h0 .. h0 + HB (zero past HG)."""
    h = h0 + tl.arange(0, HB)
    cols = col0 + tl.arange(0, COLS)
    x = tl.load(q_ptr + (q_row + h)[:, None] * D + cols[None, :], mask=(h < HG)[:, None], other=0.0)
    return x.to(tl.float32) if DOT_FP32 else x


@triton.jit
def _load_k(kv_ptr, key_rows, valid, D: tl.constexpr, col0, COLS: tl.constexpr,
            DOT_FP32: tl.constexpr):  # fmt: skip
    cols = col0 + tl.arange(0, COLS)
    x = tl.load(kv_ptr + key_rows[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
    return x.to(tl.float32) if DOT_FP32 else x


@triton.jit
def _row_start(row, S, G: tl.constexpr, HG: tl.constexpr):
    """``(b, g, q_row)`` of program row ``(b * S + s) * G + g``: its batch, kv group and first
    query head in rows of D."""
    g = row % G
    bs = row // G
    return bs // S, g, bs * (G * HG) + g * HG


@triton.jit
def _key_block(row_idx, j0, TOPK, S_kv, b, g, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(offs_j, valid, key_rows)`` of index slots j0 .. j0 + BLOCK_K: the slots, whether each
    is a key (padding: -1, out of range or past TOPK) and its row of kv in rows of D."""
    offs_j = j0 + tl.arange(0, BLOCK_K)
    idx = tl.load(row_idx + offs_j, mask=offs_j < TOPK, other=-1)
    valid = (idx >= 0) & (idx < S_kv)
    return offs_j, valid, (b * S_kv + idx.to(tl.int64)) * G + g


@triton.jit
def _probs_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    lse_ptr,
    out_ptr,
    S,
    S_kv,
    TOPK,
    scale2,
    G: tl.constexpr,
    HG: tl.constexpr,
    D: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LOG2E_: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b, g, q_row = _row_start(row, S, G, HG)
    row_idx = idx_ptr + row * TOPK
    row_out = out_ptr + row * TOPK
    for h0 in range(0, HG, HB):
        h = h0 + tl.arange(0, HB)
        q_main = _load_q(q_ptr, q_row, h0, HG, D, 0, HB, D_MAIN, DOT_FP32)
        if D_TAIL > 0:
            q_tail = _load_q(q_ptr, q_row, h0, HG, D, D_MAIN, HB, D_TAIL, DOT_FP32)
        # Padded heads get lse2 = +inf: exp2(s - inf) = 0, so they add nothing.
        lse2 = tl.load(lse_ptr + q_row + h, mask=h < HG, other=float("inf")) * LOG2E_
        for j0 in range(0, TOPK, BLOCK_K):
            offs_j, valid, key_rows = _key_block(row_idx, j0, TOPK, S_kv, b, g, G, BLOCK_K)
            j_ok = offs_j < TOPK
            s = tl.dot(q_main, tl.trans(_load_k(kv_ptr, key_rows, valid, D, 0, D_MAIN, DOT_FP32)))
            if D_TAIL > 0:
                k_tail = _load_k(kv_ptr, key_rows, valid, D, D_MAIN, D_TAIL, DOT_FP32)
                s = tl.dot(q_tail, tl.trans(k_tail), s)
            p = tl.exp2(s * scale2 - lse2[:, None])
            p = tl.sum(tl.where(valid[None, :], p, 0.0), axis=0)  # [BLOCK_K]
            if h0 > 0:
                p += tl.load(row_out + offs_j, mask=j_ok, other=0.0)
            tl.store(row_out + offs_j, p, mask=j_ok)


def split_width(d: int) -> tuple[int, int] | None:
    """``(D_MAIN, D_TAIL)``: D as a power of two >= 16 plus 0 or a smaller power of two >= 16
    (the kernel's tensor-core tiles), or None when D has no such split."""
    main = next_pow2(d) // 2 if next_pow2(d) != d else d
    tail = d - main
    if main < 16 or (tail and (tail < 16 or tail & (tail - 1))):
        return None
    return main, tail


def sparse_attention_probs_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Head-summed probabilities, float32 ``[B, S, G, topk]``, on CUDA (or CPU under
    ``TRITON_INTERPRET=1``, launched as on a Hopper). Shapes as in
    ``dsa_sparse_attention.sparse_attention_probs``; ``D`` and the heads per group must have a
    :func:`launch_config` on the device (ValueError otherwise). No host synchronisation."""
    b, s, h, d = q.shape
    s_kv, g = kv.shape[1], kv.shape[2]
    topk = indices.shape[-1]
    hg = h // g
    interpreted = q.device.type == "cpu"  # the interpreter has no bf16 matmul
    smem = HOPPER_SMEM_PER_BLOCK if interpreted else shared_memory_per_block(q.device)
    launch = launch_config(d, hg, smem)
    if launch is None:
        raise ValueError(
            f"D = {d} at {hg} heads per group: the Triton probs kernel has no launch within "
            f"{smem} bytes of shared memory per block (see launch_config)"
        )
    block_k, stages = launch
    d_main, d_tail = split_width(d)
    out = torch.empty(b, s, g, topk, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    _probs_kernel[(b * s * g,)](
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        lse.contiguous(),
        out,
        s,
        s_kv,
        topk,
        float(sm_scale) * LOG2E,
        G=g,
        HG=hg,
        D=d,
        D_MAIN=d_main,
        D_TAIL=d_tail,
        HB=head_block(hg),
        BLOCK_K=block_k,
        DOT_FP32=interpreted,
        LOG2E_=LOG2E,
        num_warps=_WARPS,
        num_stages=stages,
    )
    return out
