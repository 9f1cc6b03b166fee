"""Triton sparse-attention forward for few heads per kv group, keys on the M side.

At 8 or 16 TP-local heads the TileLang and FlashMLA forwards pad the heads to the 64 rows of a
wgmma and so run 4-8x the useful tensor-core work while the time goes to the per-query KV
gather (2048 rows x 1152 B from L2 at glm5, the same at every head count). This kernel turns the
products around: one program per (query, kv group, head block) walks the query's index row in
``BLOCK_K`` slots and forms ``S^T = K Q^T`` (``[BLOCK_K, HB]``: the gathered keys are the M side,
the heads the N side, which a tensor-core product allows down to 16) and ``O^T += V^T P^T``
(``[d_v, HB]``), with the online softmax over the key axis. K is the whole kv row, split as
``D_MAIN + D_TAIL`` columns (both powers of two, 512 + 64 for the RoPE layout); V is the same
tile's first ``D_MAIN = d_v`` columns, so each key row is read once.

An index is a key when it lies in ``[0, S_kv)``; every other value is padding (logit -inf). The
sink adds ``exp(sink[h])`` to the denominator only. A row without a key and without a sink gets
``lse2 = -inf`` and an output of exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kernel_common import shared_memory_per_block
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LOG2E

from dsa_sparse_attention._triton.probs import (
    _key_block,
    _load_k,
    _load_q,
    _row_start,
    head_block,
    split_width,
)


# Lengths vary from call to call: no specialisation on them, so a new length never recompiles.
@triton.jit(do_not_specialize=["S", "S_kv", "TOPK"])
def _forward_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
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
    HAS_SINK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LOG2E_: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HB
    b, g, q_row = _row_start(row, S, G, HG)
    row_idx = idx_ptr + row * TOPK
    h = h0 + tl.arange(0, HB)
    h_ok = h < HG
    qt_main = tl.trans(_load_q(q_ptr, q_row, h0, HG, D, 0, HB, D_MAIN, DOT_FP32))
    if D_TAIL > 0:
        qt_tail = tl.trans(_load_q(q_ptr, q_row, h0, HG, D, D_MAIN, HB, D_TAIL, DOT_FP32))
    m = tl.full([HB], float("-inf"), tl.float32)  # running max of the log2 logits
    denom = tl.zeros([HB], tl.float32)  # the softmax denominator at scale 2^-m
    acc = tl.zeros([D_MAIN, HB], tl.float32)  # O^T
    for j0 in range(0, TOPK, BLOCK_K):
        _, valid, key_rows = _key_block(row_idx, j0, TOPK, S_kv, b, g, G, BLOCK_K)
        k_main = _load_k(kv_ptr, key_rows, valid, D, 0, D_MAIN, DOT_FP32)
        st = tl.dot(k_main, qt_main)
        if D_TAIL > 0:
            st = tl.dot(_load_k(kv_ptr, key_rows, valid, D, D_MAIN, D_TAIL, DOT_FP32), qt_tail, st)
        st = tl.where(valid[:, None], st * scale2, float("-inf"))
        m_new = tl.maximum(m, tl.max(st, axis=0))
        # While a head has seen no key its max is -inf: subtract 0 instead (no -inf - -inf).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(st - m_use[None, :])
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(k_main), p.to(k_main.dtype))
        m = m_new
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + g * HG + h, mask=h_ok, other=0.0) * LOG2E_
        m_new = tl.maximum(m, sink2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        denom = denom * alpha + tl.exp2(sink2 - m_use)
        acc = acc * alpha[None, :]
        m = m_new
    empty = denom == 0.0
    lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom)))
    out_t = acc * tl.where(empty, 0.0, 1.0 / denom)[None, :]
    cols = tl.arange(0, D_MAIN)
    tl.store(
        out_ptr + (q_row + h)[None, :] * D_MAIN + cols[:, None],
        out_t.to(out_ptr.dtype.element_ty),
        mask=h_ok[None, :],
    )
    tl.store(lse_ptr + q_row + h, lse2, mask=h_ok)


# Launches (BLOCK_K, num_stages) per head block in order of preference: the first whose shared
# memory fits the device. Measured on an H100 at 16k tokens (benchmarks/NOTES.md, 2026-12-06):
# at a head block of 16 two 32-key tiles in flight (94 KiB, two programs per SM) beat 64-key
# tiles (glm5 8 heads 11.46 against 12.08 ms, dsv4.1 8 heads 3.46 against 3.95); at 32 and 64
# heads the 64-key tiles win (glm5 32 heads 14.2 against 16.2 ms, 64 heads 23.0 against 25.9).
_LAUNCHES = {
    16: ((32, 5), (64, 3), (16, 6), (16, 3)),
    32: ((64, 3), (32, 5), (16, 6), (16, 3)),
    64: ((64, 3), (32, 5), (16, 6), (16, 3)),
}
# Triton's shared memory beyond the Q^T block, the staged key tiles and the P^T tile (the index
# rows, barriers); tests/dsa_sparse_attention/test_triton_forward.py compiles each launch and
# checks the estimate.
_SMEM_SLACK = 1024


def num_warps(heads_per_group: int) -> int:
    """Warps per program: the ``[d_v, HB]`` fp32 accumulator takes ``d_v * HB / (32 * warps)``
    registers per thread, 64 at 512 x 16 with 4 warps; a 64-head block takes 8 (measured on an
    H100: 8 warps take 0.5x the time of 4 at 64 heads, 1.2-1.5x at 8 and 16)."""
    return 8 if head_block(heads_per_group) == 64 else 4


def key_buffers(num_stages: int) -> int:
    """Key tiles Triton 3.6 keeps in flight at ``num_stages``: the index row takes the first
    stages (it is loaded ahead of the keys it names), so 3 stages give 2 buffers (compiled for
    sm_90 and read from the TTGIR; the launch test checks the estimate)."""
    return max(1, num_stages - 1)


def launch_config(dim: int, heads_per_group: int, smem_limit: int) -> tuple[int, int] | None:
    """``(BLOCK_K, num_stages)`` for this width and head count within ``smem_limit`` bytes of
    shared memory per block, or None where none fits (:func:`shared_memory_bytes`)."""
    for block_k, stages in _LAUNCHES[head_block(heads_per_group)]:
        if shared_memory_bytes(dim, heads_per_group, block_k, stages) <= smem_limit:
            return block_k, stages
    return None


def shared_memory_bytes(dim: int, heads_per_group: int, block_k: int, num_stages: int) -> int:
    """An upper bound of the kernel's shared memory: Q^T (``HB x D``), the staged key tiles
    (``buffers x BLOCK_K x D``) and P^T (``BLOCK_K x HB``), bf16, plus the slack."""
    hb = head_block(heads_per_group)
    tiles = (hb + key_buffers(num_stages) * block_k) * dim + block_k * hb
    return tiles * 2 + _SMEM_SLACK


def forward_supports(dim: int, d_v: int) -> bool:
    """Whether the kernel runs this width: ``dim`` splits as ``d_v`` plus 0 or a smaller power
    of two (:func:`split_width`), so that V is the key tile's first columns."""
    split = split_width(dim)
    return split is not None and split[0] == d_v


def check_forward_config(
    dim: int, d_v: int, heads_per_group: int, smem_limit: int
) -> tuple[int, int]:
    """The ``(BLOCK_K, num_stages)`` launch of :func:`launch_config`; raise ValueError, naming
    the argument, unless the kernel runs this width and head count on a device with
    ``smem_limit`` bytes of shared memory per block (cheap; before anything is compiled)."""
    if not forward_supports(dim, d_v):
        raise ValueError(
            f"forward_backend='triton' needs q.shape[-1] = {dim} to be d_v = {d_v} (a power of "
            "two >= 16) plus 0 or a smaller power of two >= 16; use the 'tilelang' forward"
        )
    launch = launch_config(dim, heads_per_group, smem_limit)
    if launch is None:
        raise ValueError(
            f"forward_backend='triton': q.shape[-1] = {dim} at {heads_per_group} heads per kv "
            f"group has no launch within {smem_limit} bytes of shared memory per block"
        )
    return launch


def sparse_attention_forward_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward with the Triton kernel, one launch, no host synchronisation.

    Args:
        q: bfloat16 ``[B, S, H, D]``; ``D``, ``d_v`` and the heads per group as
            :func:`check_forward_config` allows (ValueError otherwise).
        kv: bfloat16 ``[B, S_kv, G, D]``: K is the whole row, V its first ``d_v`` columns; head
            ``h`` reads group ``h // (H // G)``.
        indices: int32 ``[B, S, G, topk]``; an entry in ``[0, S_kv)`` is a key, any other value
            padding. Duplicates count once per occurrence.
        attn_sink: float32 ``[H]`` or None: a per-head logit added to the denominator only.
        sm_scale: softmax scale.
        d_v: value width.

    Returns:
        ``out`` ``[B, S, H, d_v]`` in q's dtype and ``lse2`` float32 ``[B, S, H]``, the log2
        log-sum-exp with the sink folded in; -inf (and an output of exactly 0) for a row
        without a key and without a sink. On CUDA, or on the CPU under ``TRITON_INTERPRET=1``.
    """
    b, s, h, d = q.shape
    s_kv, g = kv.shape[1], kv.shape[2]
    topk = indices.shape[-1]
    hg = h // g
    interpreted = q.device.type == "cpu"
    smem = HOPPER_SMEM_PER_BLOCK if interpreted else shared_memory_per_block(q.device)
    block_k, stages = check_forward_config(d, d_v, hg, smem)
    d_main, d_tail = split_width(d)
    out = torch.empty(b, s, h, d_v, dtype=q.dtype, device=q.device)
    lse2 = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    if b * s == 0:
        return out, lse2
    hb = head_block(hg)
    _forward_kernel[(b * s * g, triton.cdiv(hg, hb))](
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        attn_sink if attn_sink is not None else lse2,  # not read without a sink
        out,
        lse2,
        s,
        s_kv,
        topk,
        float(sm_scale) * LOG2E,
        G=g,
        HG=hg,
        D=d,
        D_MAIN=d_main,
        D_TAIL=d_tail,
        HB=hb,
        BLOCK_K=block_k,
        HAS_SINK=attn_sink is not None,
        DOT_FP32=interpreted,  # the interpreter has no bf16 matmul
        LOG2E_=LOG2E,
        num_warps=num_warps(hg),
        num_stages=stages,
    )
    return out, lse2
