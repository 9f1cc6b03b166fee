"""TileLang sparse-attention forward for Hopper: a warp-specialised K/V gather feeding wgmma.

One program handles one query, one kv group and a block of 64 query heads (``HB``, the wgmma M
of a warpgroup): the Q tile ``[64, D]`` stays in shared memory while the program walks the
query's indices in blocks of ``block_i`` keys. Three warpgroups split the work:

* warpgroup 2 (producer) gathers each block's K/V rows into one of ``num_stages`` shared-memory
  stages with 16-byte ``cp.async`` copies (8 threads per row, so every warp instruction moves
  four 128-byte row segments), loads the next block's indices while those copies fly, and writes
  the block's validity mask;
* warpgroup 0 computes ``S = Q K^T`` (wgmma), the online softmax in log2 space, publishes ``P``
  (bf16) and the rescale factor through shared memory and accumulates ``O[:, :d_v/2] += P V``
  with ``P`` taken straight from registers;
* warpgroup 1 rescales and accumulates the other half, ``O[:, d_v/2:] += P V``, from the shared
  ``P``.

The 64 x 512 fp32 accumulator is thus split over two warpgroups (128 registers per thread each).

Synchronisation is explicit, with mbarriers only (TileLang's own partial barriers use named
barriers). Block ``j`` lives in stage ``s = j % num_stages``, the stage's ``n = j // num_stages``-th
use. Per stage, ``k_ready[s]`` completes phase ``n`` when the producer's copies of block ``j``
have landed (128 ``cp.async`` arrivals) and its mask stores are released (128 plain arrivals);
``k_free[s]`` completes phase ``n`` when both consumer warpgroups are done with block ``j``.
Between the consumers, ``p_ready`` / ``p_free`` complete phase ``j`` when ``P`` of block ``j``
is published / consumed. Each wait names the parity of the phase it needs, and no barrier can
complete the following phase before that wait has passed (the next phase needs the waiter's own
release first), so a parity never aliases an older or newer phase; the first wait on a free
barrier uses the odd parity, which a fresh mbarrier reports complete. A consumer releases a stage
as soon as its own ``P V`` on it retires (never behind the next block's arrival), so with two
stages one block is computed while the next is gathered. Consumers unroll the stages statically
(whole rounds of ``num_stages`` blocks, then a static remainder), so every wgmma descriptor is a
compile-time constant and any block count works, including 1, ``num_stages``,
``num_stages + 1``.

Softmax: scores are scaled by ``sm_scale * log2(e)`` (any sign) and exponentiated with ``exp2``;
the running maximum starts at -1e30, so an all-padding block contributes ``exp2(-inf) = 0`` and
rescales by 1.
At the end ``l >= 1`` exactly when some key was valid; the output is ``acc / (l + 2^(sink2 - m))``
(0 when ``l == 0``, whatever the sink) and ``lse2 = log2(l) + m`` (-inf when ``l == 0``), with
the sink folded in as ``logaddexp2(lse2, sink * log2(e))``.

Padding: an index ``i`` is valid when ``0 <= i < S_kv``; columns past the real ``topk`` (up to
the static ``topk_padded``) are invalid too. Every row is gathered from
``clamp(i, 0, S_kv - 1)`` (one clamp per row when its index is loaded, none in the copy loop), so
nothing is read out of bounds and the gathered values are finite; the mask makes invalid scores
``-inf``, i.e. probability 0.
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's annotations, which
# name sizes local to the builder.
import functools
from types import SimpleNamespace

import tilelang
import tilelang.language as T
import torch
from kernel_common import device_arch, tilelang_target

from dsa_sparse_attention._tilelang._build import compile_kernel

LOG2E = 1.4426950408889634
HB = 64  # query heads per program: the wgmma M of one warpgroup
THREADS = 384  # consumer warpgroups 0 and 1, producer warpgroup 2
BLOCK_I_CHOICES = (16, 32, 64)  # the producer's 16-row passes; wgmma N of S = Q K^T
_PRODUCER_ROWS = 16  # rows one producer pass covers: 128 threads, 8 per row
_M_INIT = -1e30  # running max (log2 units) start: finite, so -inf - -inf never happens
SMEM_LIMIT = 227 * 1024  # Hopper's opt-in dynamic shared memory per block

# Manual warp specialisation: TileLang must not add a producer/consumer split of its own. (No
# T.copy touches global memory, so none can become TMA.) The aggressive shared-memory merge is
# left off, its default: it aliased live buffers in another kernel.
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


# Prepended to the generated CUDA source (T.Kernel's prelude). The kernel's wgmma descriptors
# are loop-invariant (fixed shared-memory addresses), and the compiler hoists all ~40 of them
# (64-bit each) out of the block loop, which spills ~100 registers in warpgroup 0 and
# serialises its wgmma pipeline. Rebuilding each descriptor from an opaque address at its use
# costs a few integer ops per gemm and keeps the registers for the accumulators.
_PRELUDE = r"""
#include <tl_templates/cuda/common.h>
namespace tl {
template <int layout_type, int leading_byte_offset, int stride_byte_offset, typename T>
TL_DEVICE void initialize_wgmma_descriptor_at_use(GmmaDescriptor &descriptor, T *start_address) {
  uint32_t address = smem_ptr_to_uint(start_address);
  asm volatile("mov.b32 %0, %0;" : "+r"(address));
  descriptor.bitfield.start_address_ = address >> 4;
  descriptor.bitfield.layout_type_ = layout_type;
  descriptor.bitfield.base_offset_ = 0;
  descriptor.bitfield.leading_byte_offset_ = leading_byte_offset;
  descriptor.bitfield.stride_byte_offset_ = stride_byte_offset;
}
}  // namespace tl
#define initialize_wgmma_descriptor initialize_wgmma_descriptor_at_use
"""


def shared_memory_bytes(dim: int, block_i: int, num_stages: int) -> int:
    """Shared memory of one program: Q, the K/V stages and P (bf16), two fp32 vectors, and
    1 KB for the mask, the barriers and TileLang's reduction scratch."""
    return 2 * (HB * dim + num_stages * block_i * dim + HB * block_i) + 4 * 2 * HB + 1024


def check_config(
    heads: int, groups: int, dim: int, d_v: int, topk_padded: int, block_i: int, num_stages: int
) -> None:
    """Raise ValueError unless the static configuration is one the kernel supports."""
    if groups < 1 or heads < 1 or heads % groups != 0:
        raise ValueError(f"heads={heads} must be a positive multiple of groups={groups}")
    if d_v < 128 or d_v % 128 != 0:
        raise ValueError(f"d_v={d_v} must be a positive multiple of 128 (two 64-wide halves)")
    if dim < d_v or (dim - d_v) % 64 != 0:
        raise ValueError(f"D - d_v = {dim - d_v} must be a non-negative multiple of 64")
    if block_i not in BLOCK_I_CHOICES:
        raise ValueError(f"block_i={block_i} must be one of {BLOCK_I_CHOICES}")
    if num_stages < 2:
        raise ValueError(f"num_stages={num_stages} must be >= 2 (gather and compute overlap)")
    if topk_padded < block_i or topk_padded % block_i != 0:
        raise ValueError(f"topk_padded={topk_padded} must be a positive multiple of {block_i}")
    smem = shared_memory_bytes(dim, block_i, num_stages)
    if smem > SMEM_LIMIT:
        raise ValueError(
            f"D={dim}, block_i={block_i}, num_stages={num_stages} need {smem} bytes of shared "
            f"memory (> {SMEM_LIMIT})"
        )


def build_forward(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk_padded: int,
    has_sink: bool,
    block_i: int = 64,
    num_stages: int = 2,
):
    """The TileLang ``prim_func`` of the forward for one static configuration.

    Static: ``heads`` (H), ``groups`` (G), ``dim`` (D = d_v + RoPE tail), ``d_v``,
    ``topk_padded`` (a multiple of ``block_i``: the index columns walked), ``has_sink``,
    ``block_i`` and ``num_stages``. Dynamic: batch, S, S_kv and the real ``topk`` (the last
    dimension of ``Indices``, at most ``topk_padded``). ``sm_scale`` is a runtime scalar.
    Arguments: ``Q, KV, Indices, Sink, Out, Lse, sm_scale`` (``Sink`` is read only with a sink).
    """
    check_config(heads, groups, dim, d_v, topk_padded, block_i, num_stages)
    bi, ns = block_i, num_stages
    hg = heads // groups  # query heads per kv group
    n_hblk = -(-hg // HB)  # head blocks per (query, group)
    full_heads = hg % HB == 0  # every head block is full: no head guards
    half = d_v // 2
    tail = dim - d_v
    n_blocks = topk_padded // bi
    n_rounds, n_rest = divmod(n_blocks, ns)
    passes = bi // _PRODUCER_ROWS

    dtype, accum, idx_t = "bfloat16", "float32", "int32"
    batch, seq_len, seq_len_kv, topk = T.dynamic("batch, seq_len, seq_len_kv, topk")

    # Macros cannot see the kernel's locals: they take its buffers in one namespace `k`.
    @T.macro
    def score_block(k, s, j, n):
        # Warpgroup 0 on block j (stage s, its n-th use): S = Q K^T, online softmax, publish
        # P and the rescale factor for warpgroup 1, O[:, :d_v/2] += P V. The stage is released
        # as soon as this P V retires, never later (e.g. behind the next block's arrival), so
        # the producer can keep every other stage in flight.
        T.barrier_wait(k.k_ready[s], n % 2)
        T.wgmma_gemm(k.q_l, k.kv_l[s, :, :], k.acc_s, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(k.q_r, k.kv_r[s, :, :], k.acc_s, transpose_B=True)
        if tail > 0:
            T.wgmma_gemm(k.q_t, k.k_t[s, :, :], k.acc_s, transpose_B=True)
        T.copy(k.m_i, k.m_prev)
        T.wait_wgmma(0)
        for h, c in T.Parallel(HB, bi):
            k.acc_s[h, c] = T.if_then_else(
                k.valid[s, c], k.acc_s[h, c] * k.scale2, -T.infinity(accum)
            )
        T.reduce_max(k.acc_s, k.m_i, dim=1, clear=False)
        for h in T.Parallel(HB):
            k.alpha[h] = T.exp2(k.m_prev[h] - k.m_i[h])
        for h, c in T.Parallel(HB, bi):
            k.acc_s[h, c] = T.exp2(k.acc_s[h, c] - k.m_i[h])
        T.reduce_sum(k.acc_s, k.l_blk, dim=1)
        for h in T.Parallel(HB):
            k.l_i[h] = k.l_i[h] * k.alpha[h] + k.l_blk[h]
        for h, d in T.Parallel(HB, half):
            k.acc_o_l[h, d] *= k.alpha[h]
        T.copy(k.acc_s, k.p_frag)
        # p_sh / alpha_sh hold block j - 1 until warpgroup 1 has released them (p_free phase
        # j - 1; for block 0 the odd parity of the fresh barrier).
        T.barrier_wait(k.p_free, (j + 1) % 2)
        T.copy(k.p_frag, k.p_sh)
        T.copy(k.alpha, k.alpha_sh)
        T.fence_proxy_async()  # generic-proxy stores, read next by warpgroup 1's wgmma
        T.barrier_arrive(k.p_ready)
        T.wgmma_gemm(k.p_frag, k.kv_l[s, :, :], k.acc_o_l)
        T.wait_wgmma(0)
        T.barrier_arrive(k.k_free[s])

    @T.macro
    def value_block(k, s, j, n):
        # Warpgroup 1 on block j (stage s, its n-th use).
        T.barrier_wait(k.p_ready, j % 2)
        T.barrier_wait(k.k_ready[s], n % 2)  # complete already; makes the stage visible here
        T.copy(k.alpha_sh, k.alpha_r)
        for h, d in T.Parallel(HB, half):
            k.acc_o_r[h, d] *= k.alpha_r[h]
        T.wgmma_gemm(k.p_sh, k.kv_r[s, :, :], k.acc_o_r)
        T.wait_wgmma(0)
        T.barrier_arrive(k.k_free[s])
        T.barrier_arrive(k.p_free)

    @T.macro
    def each_block(k, body):
        # Every block with a static stage index: rounds of `ns` blocks, then the remainder.
        # Block j is stage j % ns, its (j // ns)-th use.
        for rnd in T.serial(n_rounds):
            for s in T.unroll(ns, explicit=True):
                body(k, s, rnd * ns + s, rnd)
        for s in T.unroll(n_rest, explicit=True):
            body(k, s, n_rounds * ns + s, n_rounds)

    @T.macro
    def load_indices(k, j, tp):
        # One index per pass (row r * 16 + tp // 8); columns past the real topk are padding.
        for r in T.unroll(passes):
            col = j * bi + r * _PRODUCER_ROWS + tp // 8
            k.idx[r] = T.if_then_else(col < topk, k.Indices[k.b, k.s, k.g, col], -1)

    @T.macro
    def gather_block(k, j, tp):
        s = j % ns
        # Phase j // ns - 1 of k_free[s]: both consumers released block j - ns.
        T.barrier_wait(k.k_free[s], (j // ns + 1) % 2)
        c0 = (tp % 8) * 8  # this thread's 16-byte chunk of every 128-byte segment
        for r in T.unroll(passes):
            row = r * _PRODUCER_ROWS + tp // 8
            idx = k.idx[r]
            if tp % 8 == 0:
                k.valid[s, row] = (idx >= 0) & (idx < seq_len_kv)
            src = T.min(T.max(idx, 0), seq_len_kv - 1)
            for u in T.unroll(half // 64):
                T.ptx_cp_async(
                    T.access_ptr(k.kv_l[s, row, u * 64 + c0], "w", 8),
                    T.access_ptr(k.KV[k.b, src, k.g, u * 64 + c0], "r", 8),
                    8,
                )
            for u in T.unroll(half // 64):
                T.ptx_cp_async(
                    T.access_ptr(k.kv_r[s, row, u * 64 + c0], "w", 8),
                    T.access_ptr(k.KV[k.b, src, k.g, half + u * 64 + c0], "r", 8),
                    8,
                )
            if tail > 0:
                for u in T.unroll(tail // 64):
                    T.ptx_cp_async(
                        T.access_ptr(k.k_t[s, row, u * 64 + c0], "w", 8),
                        T.access_ptr(k.KV[k.b, src, k.g, d_v + u * 64 + c0], "r", 8),
                        8,
                    )
        # The plain arrival releases the mask stores; the cp.async arrival fires once this
        # thread's copies have landed.
        T.barrier_arrive(k.k_ready[s])
        T.cp_async_barrier_noinc(k.k_ready[s])

    @T.prim_func
    def sparse_attention_fwd(
        Q: T.Tensor([batch, seq_len, heads, dim], dtype),
        KV: T.Tensor([batch, seq_len_kv, groups, dim], dtype),
        Indices: T.Tensor([batch, seq_len, groups, topk], idx_t),
        Sink: T.Tensor([heads], accum),
        Out: T.Tensor([batch, seq_len, heads, d_v], dtype),
        Lse: T.Tensor([batch, seq_len, heads], accum),
        sm_scale: T.float32,
    ):
        with T.Kernel(seq_len * n_hblk, batch, groups, threads=THREADS, prelude=_PRELUDE) as (
            bx,
            by,
            bz,
        ):
            q_l = T.alloc_shared([HB, half], dtype)
            q_r = T.alloc_shared([HB, half], dtype)
            q_t = T.alloc_shared([HB, tail], dtype) if tail > 0 else None
            kv_l = T.alloc_shared([ns, bi, half], dtype)
            kv_r = T.alloc_shared([ns, bi, half], dtype)
            k_t = T.alloc_shared([ns, bi, tail], dtype) if tail > 0 else None
            p_sh = T.alloc_shared([HB, bi], dtype)
            alpha_sh = T.alloc_shared([HB], accum)
            fac_sh = T.alloc_shared([HB], accum)
            valid = T.alloc_shared([ns, bi], "bool")

            acc_s = T.alloc_fragment([HB, bi], accum)
            p_frag = T.alloc_fragment([HB, bi], dtype)
            acc_o_l = T.alloc_fragment([HB, half], accum)
            acc_o_r = T.alloc_fragment([HB, half], accum)
            m_i = T.alloc_fragment([HB], accum)
            m_prev = T.alloc_fragment([HB], accum)
            alpha = T.alloc_fragment([HB], accum)
            l_i = T.alloc_fragment([HB], accum)
            l_blk = T.alloc_fragment([HB], accum)
            alpha_r = T.alloc_fragment([HB], accum)
            fac = T.alloc_fragment([HB], accum)
            lse = T.alloc_fragment([HB], accum)
            idx = T.alloc_local([passes], idx_t)

            bar_q = T.alloc_barrier(128)
            k_ready = T.alloc_barrier([256] * ns)
            k_free = T.alloc_barrier([256] * ns)
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(128)
            fin = T.alloc_barrier(128)

            b_i, g_i, s_i = by, bz, bx // n_hblk
            h_base = g_i * hg + (bx % n_hblk) * HB  # global head of local row 0
            h_lim = hg - (bx % n_hblk) * HB  # local rows below this are real heads
            scale2 = sm_scale * LOG2E
            tx = T.get_thread_binding()
            k = SimpleNamespace(
                KV=KV,
                Indices=Indices,
                b=b_i,
                g=g_i,
                s=s_i,
                scale2=scale2,
                q_l=q_l,
                q_r=q_r,
                q_t=q_t,
                kv_l=kv_l,
                kv_r=kv_r,
                k_t=k_t,
                p_sh=p_sh,
                alpha_sh=alpha_sh,
                valid=valid,
                acc_s=acc_s,
                p_frag=p_frag,
                acc_o_l=acc_o_l,
                acc_o_r=acc_o_r,
                m_i=m_i,
                m_prev=m_prev,
                alpha=alpha,
                l_i=l_i,
                l_blk=l_blk,
                alpha_r=alpha_r,
                idx=idx,
                k_ready=k_ready,
                k_free=k_free,
                p_ready=p_ready,
                p_free=p_free,
            )

            if tx < 128:
                # Warpgroup 0: Q, S = Q K^T, online softmax, O[:, :d_v/2], lse.
                T.set_max_nreg(240, 1)
                for h, d in T.Parallel(HB, half):
                    q_l[h, d] = T.if_then_else(
                        full_heads or h < h_lim, Q[b_i, s_i, h_base + h, d], 0
                    )
                for h, d in T.Parallel(HB, half):
                    q_r[h, d] = T.if_then_else(
                        full_heads or h < h_lim, Q[b_i, s_i, h_base + h, half + d], 0
                    )
                if tail > 0:
                    for h, d in T.Parallel(HB, tail):
                        q_t[h, d] = T.if_then_else(
                            full_heads or h < h_lim, Q[b_i, s_i, h_base + h, d_v + d], 0
                        )
                T.fence_proxy_async()  # Q: generic-proxy stores, read by wgmma
                T.barrier_arrive(bar_q)
                T.barrier_wait(bar_q, 0)
                T.fill(acc_o_l, 0)
                T.fill(l_i, 0)
                T.fill(m_i, _M_INIT)
                each_block(k, score_block)
                # l_i >= 1 exactly when some key was valid (the maximum contributes exp2(0)).
                for h in T.Parallel(HB):
                    has_key = l_i[h] > 0
                    lse[h] = T.if_then_else(has_key, T.log2(l_i[h]) + m_i[h], -T.infinity(accum))
                    if has_sink:
                        sink2 = T.if_then_else(full_heads or h < h_lim, Sink[h_base + h], 0) * LOG2E
                        fac[h] = T.if_then_else(has_key, 1 / (l_i[h] + T.exp2(sink2 - m_i[h])), 0)
                        top = T.max(lse[h], sink2)
                        lse[h] = top + T.log2(T.exp2(lse[h] - top) + T.exp2(sink2 - top))
                    else:
                        fac[h] = T.if_then_else(has_key, 1 / l_i[h], 0)
                T.copy(fac, fac_sh)
                T.barrier_arrive(fin)
                for h in T.Parallel(HB):
                    if full_heads or h < h_lim:
                        Lse[b_i, s_i, h_base + h] = lse[h]
                for h, d in T.Parallel(HB, half):
                    acc_o_l[h, d] *= fac[h]
                T.copy(acc_o_l, q_l)  # every Q K^T is done: q_l stages this half's output
                for h, d in T.Parallel(HB, half):
                    if full_heads or h < h_lim:
                        Out[b_i, s_i, h_base + h, d] = q_l[h, d]
            elif tx < 256:
                # Warpgroup 1: O[:, d_v/2:].
                T.set_max_nreg(168, 1)
                T.fill(acc_o_r, 0)
                each_block(k, value_block)
                # fin: warpgroup 0 is past its last Q K^T, so q_r may stage this half's output.
                T.barrier_wait(fin, 0)
                T.copy(fac_sh, alpha_r)
                for h, d in T.Parallel(HB, half):
                    acc_o_r[h, d] *= alpha_r[h]
                T.copy(acc_o_r, q_r)
                for h, d in T.Parallel(HB, half):
                    if full_heads or h < h_lim:
                        Out[b_i, s_i, h_base + h, half + d] = q_r[h, d]
            else:
                # Warpgroup 2: the gather.
                T.set_max_nreg(80, 0)
                tp = tx - 256
                load_indices(k, 0, tp)
                for j in T.serial(n_blocks):
                    gather_block(k, j, tp)
                    if j + 1 < n_blocks:
                        load_indices(k, j + 1, tp)

    return sparse_attention_fwd


@functools.lru_cache(maxsize=None)
def compile_forward(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk_padded: int,
    has_sink: bool,
    block_i: int = 64,
    num_stages: int = 2,
    target_arch: str = "sm_90a",
):
    """The compiled forward kernel for one static configuration (cached per configuration).

    Compiles for ``{"kind": "cuda", "arch": target_arch}``; works without a GPU when nvcc is
    present. Batch, S, S_kv and topk are dynamic, so new lengths reuse the compiled kernel.
    """
    return compile_kernel(
        lambda: build_forward(heads, groups, dim, d_v, topk_padded, has_sink, block_i, num_stages),
        target={"kind": "cuda", "arch": target_arch},
        pass_configs=PASS_CONFIGS,
    )


def padded_topk(topk: int, block_i: int = 64) -> int:
    """The index columns the kernel walks for ``topk``: the next multiple of ``block_i``."""
    return max(1, -(-topk // block_i)) * block_i


def sparse_attention_forward_tilelang(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    *,
    block_i: int = 64,
    threads: int = THREADS,
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward on Hopper (TileLang), one kernel launch, no host sync.

    Args:
        q: bfloat16 ``[B, S, H, D]``, ``D = d_v + tail`` (tail 0 or a multiple of 64).
        kv: bfloat16 ``[B, S_kv, G, D]``: K is the whole row, V its first ``d_v`` columns; head
            ``h`` reads group ``h // (H // G)``.
        indices: int32 ``[B, S, G, topk]``, any ``topk >= 1``. An entry is a key row when it lies
            in ``[0, S_kv)``; -1 and every other value (``>= S_kv`` or ``< -1``) is padding.
            Duplicates count once per occurrence.
        attn_sink: float32 ``[H]`` or None: a per-head logit added to the denominator only.
        sm_scale: softmax scale.
        d_v: value width, a multiple of 128.
        block_i: keys per index block (16, 32 or 64); topk is padded to a multiple of it.
        threads: must be 384 (two consumer warpgroups and one producer warpgroup).
        num_stages: K/V stages in shared memory (>= 2; 2 fits D = 576 with block_i = 64).

    Returns:
        ``out`` bfloat16 ``[B, S, H, d_v]`` and ``lse2`` float32 ``[B, S, H]``, the log2-space
        log-sum-exp of the scaled logits with the sink folded in (``lse_natural / ln 2``); -inf
        for a row without a valid index and without a sink. Such a row's output is exactly 0.
    """
    if threads != THREADS:
        raise ValueError(f"threads={threads}: this kernel runs {THREADS} threads (3 warpgroups)")
    b, s, h, d = q.shape
    s_kv, g = kv.shape[1], kv.shape[2]
    out = torch.empty((b, s, h, d_v), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((b, s, h), dtype=torch.float32, device=q.device)
    if s_kv == 0:
        # No key row exists (and none to clamp to): every row is empty.
        out.zero_()
        if attn_sink is None:
            lse2.fill_(float("-inf"))
        else:
            lse2.copy_((attn_sink * LOG2E).expand(b, s, h))
        return out, lse2
    if b * s == 0:
        return out, lse2
    arch = tilelang_target(device_arch(q.device))["arch"]
    kernel = compile_forward(
        h,
        g,
        d,
        d_v,
        padded_topk(indices.shape[-1], block_i),
        attn_sink is not None,
        block_i,
        num_stages,
        arch,
    )
    sink = attn_sink.contiguous() if attn_sink is not None else lse2.new_empty(h)
    kernel(q.contiguous(), kv.contiguous(), indices.contiguous(), sink, out, lse2, float(sm_scale))
    return out, lse2
