"""TileLang sparse-attention forward for Hopper: a warp-specialised K/V gather feeding wgmma.

One program handles one query, one kv group and a block of 64 query heads (``HB``, the wgmma M
of a warpgroup): the Q tile ``[64, D]`` stays in shared memory while the program walks the
query's indices in blocks of ``block_i`` keys. Three warpgroups split the work, each one macro of
:func:`build_forward`:

* warpgroup 2 (``gather_warpgroup``, the producer) gathers each block's K/V rows into one of
  ``num_stages`` shared-memory stages with 16-byte ``cp.async`` copies (8 threads per row, so
  every warp instruction moves four 128-byte row segments), loads the next block's indices while
  those copies fly, and writes the block's validity mask;
* warpgroup 0 (``score_warpgroup``) loads Q, computes ``S = Q K^T`` (wgmma), the online softmax
  in log2 space, publishes ``P`` (bf16) and the rescale factor through shared memory and
  accumulates ``O[:, :d_v/2] += P V`` with ``P`` taken straight from registers; at the end it
  finishes the softmax and writes ``Lse`` and its half of ``Out``;
* warpgroup 1 (``value_warpgroup``) rescales and accumulates the other half,
  ``O[:, d_v/2:] += P V``, from the shared ``P``, and writes that half of ``Out``.

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
the static ``topk_padded``) are invalid too. A valid row is gathered; an invalid one is filled
with zeros without a read (its copy's address is ``clamp(i, 0, S_kv - 1)``, in bounds), so
nothing is read out of bounds and the stage values are finite; the mask makes invalid scores
``-inf``, i.e. probability 0.

The tiling (``block_i``, ``num_stages``) has no default here: it comes from the caller's
``SparseAttentionConfig``, and :func:`check_forward_config` rejects what this kernel cannot run
before anything is compiled.
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

HB = 64  # query heads per program: the wgmma M of one warpgroup
THREADS = 384  # consumer warpgroups 0 and 1, producer warpgroup 2
BLOCK_I_CHOICES = (16, 32, 64)  # the producer's 16-row passes; wgmma N of S = Q K^T
_PRODUCER_ROWS = 16  # rows one producer pass covers: 128 threads, 8 per row
_M_INIT = -1e30  # running max (log2 units) start: finite, so -inf - -inf never happens

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


def check_forward_config(
    heads: int, groups: int, dim: int, d_v: int, block_i: int, num_stages: int
) -> None:
    """Raise ValueError unless the forward kernel can run this configuration.

    Static shape: ``heads`` = ``q.shape[2]``, ``groups`` = ``kv.shape[2]``, ``dim`` =
    ``q.shape[-1]`` (d_v + RoPE tail), ``d_v``; tiling: ``block_i`` and ``num_stages``
    (``SparseAttentionConfig.forward_block_i`` / ``forward_stages``). Cheap, and called before
    anything is compiled; each message names the argument or config field to change.
    """
    if heads < 1 or groups < 1 or heads % groups:
        raise ValueError(
            f"q.shape[2] = {heads} query heads must be a positive multiple of kv.shape[2] = "
            f"{groups} kv groups"
        )
    if d_v < 128 or d_v % 128:
        raise ValueError(
            f"d_v = {d_v} must be a positive multiple of 128: each consumer warpgroup "
            "accumulates d_v / 2 columns in 64-column wgmma tiles"
        )
    if dim < d_v or (dim - d_v) % 64:
        raise ValueError(
            f"q.shape[-1] - d_v = {dim - d_v} (the RoPE tail) must be a non-negative multiple "
            "of 64: the gather and the wgmma tiles move 64 columns at a time"
        )
    if block_i not in BLOCK_I_CHOICES:
        raise ValueError(
            f"SparseAttentionConfig.forward_block_i = {block_i} must be one of "
            f"{BLOCK_I_CHOICES} (whole 16-row gather passes; the wgmma N of S = Q K^T)"
        )
    if num_stages < 2:
        raise ValueError(
            f"SparseAttentionConfig.forward_stages = {num_stages} must be >= 2: the gather of "
            "one block overlaps the compute of another only with a second stage"
        )
    smem = shared_memory_bytes(dim, block_i, num_stages)
    if smem > HOPPER_SMEM_PER_BLOCK:
        raise ValueError(
            f"SparseAttentionConfig.forward_block_i = {block_i} with forward_stages = "
            f"{num_stages} needs {smem} bytes of shared memory at q.shape[-1] = {dim}, more "
            f"than the {HOPPER_SMEM_PER_BLOCK} bytes a Hopper thread block can use; lower "
            "forward_stages or forward_block_i"
        )


def gather_warpgroup_macro(
    half: int,
    tail: int,
    block_i: int,
    num_stages: int,
    n_blocks: int,
    topk,
    seq_len_kv,
    producer_first_thread: int,
):
    """The producer of a program that walks one index row in ``n_blocks`` blocks of ``block_i``
    keys, shared by the forward and ``sparse_attention_probs``' kernel: the macro
    ``gather_warpgroup(k)``, run by threads ``producer_first_thread`` and the 127 after it.

    It loads each block's indices, gathers the rows' ``half + half + tail`` columns into the
    stage buffers ``k.kv_l`` / ``k.kv_r`` / ``k.k_t`` (``[num_stages, block_i, ...]``) and
    writes ``k.valid[stage, row]``, then completes ``k.k_ready[stage]`` (256 arrivals: 128
    ``cp.async`` ones, 128 plain); it refills a stage once ``k.k_free[stage]`` has completed the
    previous use's phase. ``topk`` and ``seq_len_kv`` are the kernel's dynamic sizes; ``k`` also
    carries ``KV``, ``Indices``, ``b``, ``s``, ``g``, ``tx`` and the ``idx`` registers
    (``block_i // 16`` int32).

    A padding slot's copies read nothing and fill the stage row with zeros (a ``cp.async``
    source size of 0; the address is still a clamped, in-bounds row, masked by ``valid``). That
    saves the L2 traffic of the padding (a quarter of the slots of causal indices at 4k tokens
    and topk 2048): the forward took 0.66x the time of reading the clamped row at glm5 4k and
    0.90x at 16k on an H100 (benchmarks/NOTES.md), with the same output bits.
    """
    bi, ns = block_i, num_stages
    passes = bi // _PRODUCER_ROWS

    @T.macro
    def load_indices(k, j, tp):
        """Producer thread tp: the indices of its rows of block j (one per pass)."""
        # Row r * 16 + tp // 8 of each pass; columns past the real topk are padding.
        for r in T.unroll(passes):
            col = j * bi + r * _PRODUCER_ROWS + tp // 8
            k.idx[r] = T.if_then_else(col < topk, k.Indices[k.b, k.s, k.g, col], -1)

    @T.macro
    def gather_block(k, j, tp):
        """Producer thread tp: cp.async its chunks of block j's K/V rows into stage j % ns and
        write the block's mask, once the consumers have released that stage."""
        s = j % ns
        # Phase j // ns - 1 of k_free[s]: the consumers released block j - ns.
        T.barrier_wait(k.k_free[s], (j // ns + 1) % 2)
        c0 = (tp % 8) * 8  # this thread's 16-byte chunk of every 128-byte segment
        for r in T.unroll(passes):
            row = r * _PRODUCER_ROWS + tp // 8
            idx = k.idx[r]
            if tp % 8 == 0:
                k.valid[s, row] = (idx >= 0) & (idx < seq_len_kv)
            src = T.min(T.max(idx, 0), seq_len_kv - 1)
            pred = (idx >= 0) & (idx < seq_len_kv)
            for u in T.unroll(half // 64):
                T.ptx_cp_async(
                    T.access_ptr(k.kv_l[s, row, u * 64 + c0], "w", 8),
                    T.access_ptr(k.KV[k.b, src, k.g, u * 64 + c0], "r", 8),
                    8,
                    pred,
                )
            for u in T.unroll(half // 64):
                T.ptx_cp_async(
                    T.access_ptr(k.kv_r[s, row, u * 64 + c0], "w", 8),
                    T.access_ptr(k.KV[k.b, src, k.g, half + u * 64 + c0], "r", 8),
                    8,
                    pred,
                )
            if tail > 0:
                for u in T.unroll(tail // 64):
                    T.ptx_cp_async(
                        T.access_ptr(k.k_t[s, row, u * 64 + c0], "w", 8),
                        T.access_ptr(k.KV[k.b, src, k.g, 2 * half + u * 64 + c0], "r", 8),
                        8,
                        pred,
                    )
        # The plain arrival releases the mask stores; the cp.async arrival fires once this
        # thread's copies have landed.
        T.barrier_arrive(k.k_ready[s])
        T.cp_async_barrier_noinc(k.k_ready[s])

    @T.macro
    def gather_warpgroup(k):
        """The producer warpgroup: every block's indices, K/V rows and mask."""
        T.set_max_nreg(80, 0)
        tp = k.tx - producer_first_thread
        load_indices(k, 0, tp)
        for j in T.serial(n_blocks):
            gather_block(k, j, tp)
            if j + 1 < n_blocks:
                load_indices(k, j + 1, tp)  # in flight while this block's copies land

    return gather_warpgroup


def build_forward(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk_padded: int,
    has_sink: bool,
    block_i: int,
    num_stages: int,
):
    """The TileLang ``prim_func`` of the forward for one static configuration.

    Static: ``heads`` (H), ``groups`` (G), ``dim`` (D = d_v + RoPE tail), ``d_v``,
    ``topk_padded`` (a positive multiple of ``block_i``: the index columns walked),
    ``has_sink``, ``block_i`` and ``num_stages``; the configuration must pass
    :func:`check_forward_config` (:func:`compile_forward` checks it). Dynamic: batch, S, S_kv and
    the real ``topk`` (the last dimension of ``Indices``, at most ``topk_padded``). ``sm_scale``
    is a runtime scalar. Arguments: ``Q`` bf16 ``[B, S, H, D]``, ``KV`` bf16 ``[B, S_kv, G, D]``,
    ``Indices`` int32 ``[B, S, G, topk]``, ``Sink`` fp32 ``[H]`` (read only with a sink),
    ``Out`` bf16 ``[B, S, H, d_v]``, ``Lse`` fp32 ``[B, S, H]`` (log2 units), ``sm_scale``.
    """
    bi, ns = block_i, num_stages
    hg = heads // groups  # query heads per kv group
    n_hblk = -(-hg // HB)  # head blocks per (query, group)
    full_heads = hg % HB == 0  # every head block is full: no head guards
    half = d_v // 2
    tail = dim - d_v
    n_blocks = topk_padded // bi
    passes = bi // _PRODUCER_ROWS

    dtype, accum, idx_t = "bfloat16", "float32", "int32"
    batch, seq_len, seq_len_kv, topk = T.dynamic("batch, seq_len, seq_len_kv, topk")
    n_rounds, n_rest = divmod(n_blocks, ns)
    gather_warpgroup = gather_warpgroup_macro(
        half, tail, bi, ns, n_blocks, topk, seq_len_kv, producer_first_thread=256
    )

    # Macros cannot see the kernel's locals: they take its buffers in one namespace `k`. Head
    # rows at or past `k.h_lim` are padding of a partial head block: loaded as 0, never stored.

    @T.macro
    def load_q(k):
        """Warpgroup 0: the program's Q rows into shared memory, published to the wgmma."""
        for h, d in T.Parallel(HB, half):
            k.q_l[h, d] = T.if_then_else(
                full_heads or h < k.h_lim, k.Q[k.b, k.s, k.h_base + h, d], 0
            )
        for h, d in T.Parallel(HB, half):
            k.q_r[h, d] = T.if_then_else(
                full_heads or h < k.h_lim, k.Q[k.b, k.s, k.h_base + h, half + d], 0
            )
        if tail > 0:
            for h, d in T.Parallel(HB, tail):
                k.q_t[h, d] = T.if_then_else(
                    full_heads or h < k.h_lim, k.Q[k.b, k.s, k.h_base + h, d_v + d], 0
                )
        T.fence_proxy_async()  # Q: generic-proxy stores, read by wgmma
        T.barrier_arrive(k.bar_q)
        T.barrier_wait(k.bar_q, 0)

    @T.macro
    def score_block(k, s, j, n):
        """Warpgroup 0 on block j (stage s, its n-th use): S = Q K^T, online softmax, publish
        P and the rescale factor for warpgroup 1, O[:, :d_v/2] += P V."""
        # The stage is released as soon as this P V retires, never later (e.g. behind the next
        # block's arrival), so the producer can keep every other stage in flight.
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
        """Warpgroup 1 on block j (stage s, its n-th use): O[:, d_v/2:] += P V."""
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
        """``body(k, s, j, n)`` for every block j, with a static stage index s."""
        # Rounds of `ns` blocks, then the remainder. Block j is stage j % ns, its (j // ns)-th
        # use.
        for rnd in T.serial(n_rounds):
            for s in T.unroll(ns, explicit=True):
                body(k, s, rnd * ns + s, rnd)
        for s in T.unroll(n_rest, explicit=True):
            body(k, s, n_rounds * ns + s, n_rounds)

    @T.macro
    def finish_softmax(k):
        """Warpgroup 0 after the last block: lse (log2 units, sink folded in) and the output
        factor 1 / (l + sink term), handed to warpgroup 1 through ``fin``; writes ``Lse``."""
        # l_i >= 1 exactly when some key was valid (the maximum contributes exp2(0)).
        for h in T.Parallel(HB):
            has_key = k.l_i[h] > 0
            k.lse[h] = T.if_then_else(has_key, T.log2(k.l_i[h]) + k.m_i[h], -T.infinity(accum))
            if has_sink:
                sink2 = T.if_then_else(full_heads or h < k.h_lim, k.Sink[k.h_base + h], 0) * LOG2E
                k.fac[h] = T.if_then_else(has_key, 1 / (k.l_i[h] + T.exp2(sink2 - k.m_i[h])), 0)
                top = T.max(k.lse[h], sink2)
                k.lse[h] = top + T.log2(T.exp2(k.lse[h] - top) + T.exp2(sink2 - top))
            else:
                k.fac[h] = T.if_then_else(has_key, 1 / k.l_i[h], 0)
        T.copy(k.fac, k.fac_sh)
        T.barrier_arrive(k.fin)
        for h in T.Parallel(HB):
            if full_heads or h < k.h_lim:
                k.Lse[k.b, k.s, k.h_base + h] = k.lse[h]

    @T.macro
    def store_output_half(k, acc, fac, staging, col0):
        """``Out[..., col0 : col0 + d_v/2] = acc * fac`` (bf16), staged in the shared ``staging``
        (a Q half: every Q K^T is done once the softmax is finished)."""
        for h, d in T.Parallel(HB, half):
            acc[h, d] *= fac[h]
        T.copy(acc, staging)
        for h, d in T.Parallel(HB, half):
            if full_heads or h < k.h_lim:
                k.Out[k.b, k.s, k.h_base + h, col0 + d] = staging[h, d]

    @T.macro
    def score_warpgroup(k):
        """Warpgroup 0: Q, S = Q K^T and the online softmax per block, O[:, :d_v/2], Lse."""
        T.set_max_nreg(240, 1)
        load_q(k)
        T.fill(k.acc_o_l, 0)
        T.fill(k.l_i, 0)
        T.fill(k.m_i, _M_INIT)
        each_block(k, score_block)
        finish_softmax(k)
        store_output_half(k, k.acc_o_l, k.fac, k.q_l, 0)

    @T.macro
    def value_warpgroup(k):
        """Warpgroup 1: O[:, d_v/2:] from warpgroup 0's shared P."""
        T.set_max_nreg(168, 1)
        T.fill(k.acc_o_r, 0)
        each_block(k, value_block)
        # fin: warpgroup 0 is past its last Q K^T, so q_r may stage this half's output.
        T.barrier_wait(k.fin, 0)
        T.copy(k.fac_sh, k.alpha_r)
        store_output_half(k, k.acc_o_r, k.alpha_r, k.q_r, half)

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
                Q=Q,
                KV=KV,
                Indices=Indices,
                Sink=Sink,
                Out=Out,
                Lse=Lse,
                b=b_i,
                g=g_i,
                s=s_i,
                h_base=h_base,
                h_lim=h_lim,
                scale2=scale2,
                tx=tx,
                q_l=q_l,
                q_r=q_r,
                q_t=q_t,
                kv_l=kv_l,
                kv_r=kv_r,
                k_t=k_t,
                p_sh=p_sh,
                alpha_sh=alpha_sh,
                fac_sh=fac_sh,
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
                fac=fac,
                lse=lse,
                idx=idx,
                bar_q=bar_q,
                k_ready=k_ready,
                k_free=k_free,
                p_ready=p_ready,
                p_free=p_free,
                fin=fin,
            )

            if tx < 128:
                score_warpgroup(k)
            elif tx < 256:
                value_warpgroup(k)
            else:
                gather_warpgroup(k)

    return sparse_attention_fwd


@functools.lru_cache(maxsize=None)
def compile_forward(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk_padded: int,
    has_sink: bool,
    block_i: int,
    num_stages: int,
    target_arch: str,
) -> tilelang.JITKernel:
    """The compiled forward kernel for one static configuration (cached per configuration).

    Arguments as :func:`build_forward`; ``topk_padded`` is ``round_up(topk, block_i)``.
    Raises ValueError (see :func:`check_forward_config`) before compiling anything the kernel
    cannot run. Compiles for ``{"kind": "cuda", "arch": target_arch}`` (e.g. ``"sm_90a"``);
    works without a GPU when nvcc is present. Batch, S, S_kv and topk are dynamic, so new
    lengths reuse the compiled kernel.
    """
    check_forward_config(heads, groups, dim, d_v, block_i, num_stages)
    if topk_padded < block_i or topk_padded % block_i:
        raise ValueError(f"topk_padded = {topk_padded} must be a positive multiple of {block_i}")
    return compile_kernel(
        lambda: build_forward(heads, groups, dim, d_v, topk_padded, has_sink, block_i, num_stages),
        target={"kind": "cuda", "arch": target_arch},
        pass_configs=PASS_CONFIGS,
    )


def sparse_attention_forward_tilelang(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    *,
    block_i: int,
    num_stages: int,
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
        block_i: keys per index block (``SparseAttentionConfig.forward_block_i``: 16, 32 or
            64); topk is padded to a multiple of it.
        num_stages: K/V stages in shared memory (``SparseAttentionConfig.forward_stages``,
            >= 2; 2 fits D = 576 with block_i = 64).

    Returns:
        ``out`` bfloat16 ``[B, S, H, d_v]`` and ``lse2`` float32 ``[B, S, H]``, the log2-space
        log-sum-exp of the scaled logits with the sink folded in (``lse_natural / ln 2``); -inf
        for a row without a valid index and without a sink. Such a row's output is exactly 0.
    """
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
        round_up(indices.shape[-1], block_i),
        attn_sink is not None,
        block_i,
        num_stages,
        arch,
    )
    sink = attn_sink.contiguous() if attn_sink is not None else lse2.new_empty(h)
    kernel(q.contiguous(), kv.contiguous(), indices.contiguous(), sink, out, lse2, float(sm_scale))
    return out, lse2
