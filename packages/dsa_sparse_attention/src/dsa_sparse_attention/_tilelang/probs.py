"""TileLang kernel of ``sparse_attention_probs`` for Hopper: the forward's gather pipeline
feeding ``S = Q K^T`` with Q held in registers.

The probabilities need only the ``Q K^T`` half of the forward, so the kernel is bound by the
per-query gather of the selected K rows (2048 rows of 1152 bytes per query at glm5), not by its
MMAs; what sets its speed is how many gathered bytes are in flight. One program handles one
query, one kv group and a block of 64 heads (``HB``, the wgmma M); two warpgroups:

* warpgroup 1 is the forward's producer (:func:`forward.gather_warpgroup_macro`): 16-byte
  ``cp.async`` gathers of 64-key blocks into :func:`stages` shared-memory stages, the block's
  validity mask, the ``k_ready`` / ``k_free`` mbarriers;
* warpgroup 0 holds the program's Q rows in registers (the register-A form of wgmma: 144
  registers per thread at D = 576), so that shared memory holds three stages at D = 576 where Q
  in shared memory would leave room for two; per block it forms ``S = Q K^T`` (64 heads x 64
  keys), ``P = exp2(S * sm_scale * log2(e) - lse2[h])``, releases the stage, and sums ``P``
  over the heads (a batched reduction over the four warps) into the output. Per-head
  probabilities never leave registers.

A group of more than 64 heads runs in ``n_hblk`` head blocks, one program each, that write
separate planes of the output (``[n_hblk, B, S, G, topk]``, summed by the caller): no atomics,
so the result is the same bits on every run.

Padding: as in the forward, an index is a key when it lies in ``[0, S_kv)``; an invalid slot's
row is zero-filled without a read, so nothing is read out of bounds; invalid slots get 0, and so
do the padded heads (loaded as 0 with ``lse2 = +inf``).
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's annotations, which
# name sizes local to the builder.
import functools
from types import SimpleNamespace

import tilelang
import tilelang.language as T
import torch
from kernel_common import device_arch, tilelang_target
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LOG2E, round_up

from dsa_sparse_attention._tilelang._build import compile_kernel
from dsa_sparse_attention._tilelang.forward import (
    _PRELUDE,
    HB,
    PASS_CONFIGS,
    gather_warpgroup_macro,
)

BLOCK = 64  # keys per block: the wgmma N of S = Q K^T
MAX_STAGES = 4
THREADS = 256  # consumer warpgroup 0, producer warpgroup 1
_RED_BYTES = 128 * 16 * 4  # the head reduction's workspace: 16 fp32 per thread


def head_blocks(heads: int, groups: int) -> int:
    """Head blocks of 64 per (query, group); the last may be partial."""
    return -(-(heads // groups) // HB)


def column_split(dim: int) -> tuple[int, int]:
    """``(half, tail)``: the gather's column slices, ``dim = 2 * half + tail`` with ``half`` and
    ``tail`` multiples of 64 (576 = 256 + 256 + 64, as the forward's d_v split)."""
    tail = dim % 128
    return (dim - tail) // 2, tail


def shared_memory_bytes(dim: int, num_stages: int) -> int:
    """Shared memory of one program: the K stages, the reduction's workspace and 1 KB for the
    masks and the barriers."""
    return 2 * num_stages * BLOCK * dim + _RED_BYTES + 1024


def stages(dim: int) -> int:
    """The most K stages (up to ``MAX_STAGES``) that fit shared memory: 3 at D = 512 and 576."""
    return max(
        (
            n
            for n in range(1, MAX_STAGES + 1)
            if shared_memory_bytes(dim, n) <= HOPPER_SMEM_PER_BLOCK
        ),
        default=0,
    )


# The widest D the kernel runs: at 832 Q takes 208 registers per thread and ptxas serialises
# the wgmmas (benchmarks/NOTES.md); up to 768 it reports 255 registers and no spills.
MAX_DIM = 768


def probs_kernel_supports(dim: int) -> bool:
    """Whether this kernel runs width ``dim``: a multiple of 64 (the gather's column slices) from
    128 to :data:`MAX_DIM`. Plain arithmetic, so that ``torch.compile`` traces the dispatch."""
    return 128 <= dim <= MAX_DIM and dim % 64 == 0


def build_probs(heads: int, groups: int, dim: int, topk_padded: int):
    """The TileLang ``prim_func`` for one static configuration.

    Static: ``heads``, ``groups``, ``dim`` (:func:`probs_kernel_supports`) and ``topk_padded``
    (a positive multiple of 64). Dynamic: batch, S, S_kv and the real ``topk`` (at most
    ``topk_padded``). Arguments: ``Q`` bf16 ``[B, S, H, D]``, ``KV`` bf16 ``[B, S_kv, G, D]``,
    ``Indices`` int32 ``[B, S, G, topk]``, ``Lse`` fp32 ``[B, S, H]`` (natural log), ``Probs``
    fp32 ``[n_hblk, B, S, G, topk]`` (one plane per head block, every element written),
    ``sm_scale``.
    """
    bi, ns = BLOCK, stages(dim)
    hg = heads // groups
    n_hblk = head_blocks(heads, groups)
    full_heads = hg % HB == 0  # every head block is full: no head guards
    half, tail = column_split(dim)
    n_blocks = topk_padded // bi

    dtype, accum, idx_t = "bfloat16", "float32", "int32"
    batch, seq_len, seq_len_kv, topk = T.dynamic("batch, seq_len, seq_len_kv, topk")
    gather_warpgroup = gather_warpgroup_macro(
        half,
        tail,
        bi,
        ns,
        n_blocks,
        topk,
        seq_len_kv,
        producer_first_thread=128,
    )

    @T.macro
    def load_q(k):
        """Q rows of the program's heads into registers and their lse2 (padded heads: 0 and
        +inf, so that they add exactly 0)."""
        for h, d in T.Parallel(HB, half):
            k.q_l[h, d] = T.if_then_else(full_heads or h < k.h_lim, k.Q[k.b, k.s, k.h0 + h, d], 0)
        for h, d in T.Parallel(HB, half):
            k.q_r[h, d] = T.if_then_else(
                full_heads or h < k.h_lim, k.Q[k.b, k.s, k.h0 + h, half + d], 0
            )
        if tail > 0:
            for h, d in T.Parallel(HB, tail):
                k.q_t[h, d] = T.if_then_else(
                    full_heads or h < k.h_lim, k.Q[k.b, k.s, k.h0 + h, 2 * half + d], 0
                )
        for h in T.Parallel(HB):
            k.lse2[h] = T.if_then_else(
                full_heads or h < k.h_lim, k.Lse[k.b, k.s, k.h0 + h] * LOG2E, T.infinity(accum)
            )

    @T.macro
    def probs_block(k, s, j, n):
        """Block j (stage s, its n-th use): the head sums of P."""
        T.barrier_wait(k.k_ready[s], n % 2)
        T.wgmma_gemm(k.q_l, k.kv_l[s, :, :], k.acc, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(k.q_r, k.kv_r[s, :, :], k.acc, transpose_B=True)
        if tail > 0:
            T.wgmma_gemm(k.q_t, k.k_t[s, :, :], k.acc, transpose_B=True)
        T.wait_wgmma(0)
        for h, c in T.Parallel(HB, bi):
            k.acc[h, c] = T.if_then_else(
                k.valid[s, c], T.exp2(k.acc[h, c] * k.scale2 - k.lse2[h]), 0
            )
        # K and the mask are in registers now: hand the stage back before the reduction.
        T.barrier_arrive(k.k_free[s])
        # One batched reduction over the warps for all of a thread's 16 columns (the default,
        # one per column, would take 16x the barriers).
        T.reduce_sum(k.acc, k.p_sum, dim=0, batch=16)
        for c in T.Parallel(bi):
            if j * bi + c < topk:
                k.Probs[k.hb, k.b, k.s, k.g, j * bi + c] = k.p_sum[c]

    @T.macro
    def consumer_warpgroup(k):
        load_q(k)
        # A plain loop with a run-time stage: Q is the register operand, so only the K
        # descriptor moves with the stage (a few integer ops), and one copy of the body keeps
        # one reduction workspace in shared memory.
        for j in T.serial(n_blocks):
            probs_block(k, j % ns, j, j // ns)

    @T.prim_func
    def sparse_attention_probs_kernel(
        Q: T.Tensor([batch, seq_len, heads, dim], dtype),
        KV: T.Tensor([batch, seq_len_kv, groups, dim], dtype),
        Indices: T.Tensor([batch, seq_len, groups, topk], idx_t),
        Lse: T.Tensor([batch, seq_len, heads], accum),
        Probs: T.Tensor([n_hblk, batch, seq_len, groups, topk], accum),
        sm_scale: T.float32,
    ):
        with T.Kernel(seq_len * n_hblk, batch, groups, threads=THREADS, prelude=_PRELUDE) as (
            bx,
            by,
            bz,
        ):
            kv_l = T.alloc_shared([ns, bi, half], dtype)
            kv_r = T.alloc_shared([ns, bi, half], dtype)
            k_t = T.alloc_shared([ns, bi, tail], dtype) if tail > 0 else None
            valid = T.alloc_shared([ns, bi], "bool")

            q_l = T.alloc_fragment([HB, half], dtype)
            q_r = T.alloc_fragment([HB, half], dtype)
            q_t = T.alloc_fragment([HB, tail], dtype) if tail > 0 else None
            lse2 = T.alloc_fragment([HB], accum)
            acc = T.alloc_fragment([HB, bi], accum)
            p_sum = T.alloc_fragment([bi], accum)
            idx = T.alloc_local([bi // 16], idx_t)

            k_ready = T.alloc_barrier([256] * ns)
            k_free = T.alloc_barrier([128] * ns)

            hb = bx % n_hblk
            k = SimpleNamespace(
                Q=Q,
                KV=KV,
                Indices=Indices,
                Lse=Lse,
                Probs=Probs,
                b=by,
                g=bz,
                s=bx // n_hblk,
                hb=hb,
                h0=bz * hg + hb * HB,  # global head of local row 0
                h_lim=hg - hb * HB,  # local rows below this are real heads
                scale2=sm_scale * LOG2E,
                tx=T.get_thread_binding(),
                kv_l=kv_l,
                kv_r=kv_r,
                k_t=k_t,
                valid=valid,
                q_l=q_l,
                q_r=q_r,
                q_t=q_t,
                lse2=lse2,
                acc=acc,
                p_sum=p_sum,
                idx=idx,
                k_ready=k_ready,
                k_free=k_free,
            )

            if k.tx < 128:
                consumer_warpgroup(k)
            else:
                gather_warpgroup(k)

    return sparse_attention_probs_kernel


@functools.lru_cache(maxsize=None)
def compile_probs(
    heads: int, groups: int, dim: int, topk_padded: int, target_arch: str
) -> tilelang.JITKernel:
    """The compiled kernel for one static configuration (cached per configuration), for
    ``{"kind": "cuda", "arch": target_arch}`` (e.g. ``"sm_90a"``; no GPU needed). Raises
    ValueError for shapes the kernel does not run, before compiling anything."""
    if heads < 1 or groups < 1 or heads % groups:
        raise ValueError(f"heads = {heads} must be a positive multiple of groups = {groups}")
    if not probs_kernel_supports(dim):
        raise ValueError(
            f"D = {dim}: the probs kernel needs D a multiple of 64 from 128 to {MAX_DIM}"
        )
    if topk_padded < BLOCK or topk_padded % BLOCK:
        raise ValueError(f"topk_padded = {topk_padded} must be a positive multiple of {BLOCK}")
    return compile_kernel(
        lambda: build_probs(heads, groups, dim, topk_padded),
        target={"kind": "cuda", "arch": target_arch},
        pass_configs=PASS_CONFIGS,
    )


def sparse_attention_probs_tilelang(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Head-summed probabilities, float32 ``[B, S, G, topk]``, on Hopper; one launch (plus a sum
    over head blocks for more than 64 heads per group), no host synchronisation.

    Shapes as in ``dsa_sparse_attention.sparse_attention_probs`` (``lse`` natural log), with
    :func:`probs_kernel_supports`; every index outside ``[0, S_kv)`` is padding (0).
    """
    b, s, h, d = q.shape
    s_kv, g = kv.shape[1], kv.shape[2]
    topk = indices.shape[-1]
    n_hblk = head_blocks(h, g)
    if s_kv == 0 or b * s * topk == 0:  # no key row to gather (or nothing to compute)
        return torch.zeros((b, s, g, topk), dtype=torch.float32, device=q.device)
    arch = tilelang_target(device_arch(q.device))["arch"]
    kernel = compile_probs(h, g, d, round_up(topk, BLOCK), arch)
    out = torch.empty((n_hblk, b, s, g, topk), dtype=torch.float32, device=q.device)
    kernel(
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        lse.contiguous(),
        out,
        float(sm_scale),
    )
    return out[0] if n_hblk == 1 else out.sum(0)
