"""TileLang backward of sparse attention: dq, dkv (fp32 reduce-add, then bf16) and dsink.

One program per (query, kv group, block of at most 64 heads of that group) walks the query's
index list in blocks of ``block_i`` keys. The K/V rows of a block are gathered once into shared
memory with ``cp.async`` (16 bytes per copy, one index load per row) into a ring of
``num_stages`` slots; the fetch of block ``i + num_stages`` starts as soon as block ``i`` has
made its last use of its slot, so even one slot overlaps the fetch with compute. Per block the
program recomputes ``P = exp2(q.k * scale * log2 e - lse2)`` and ``dP = do.v`` for all its
heads with one MMA each, forms ``dS = P * (dP - delta)``, accumulates ``dq += dS k`` in
registers and computes the block's key gradient ``dK + dV = dS^T q * scale + P^T do`` summed
over all its heads: that sum is the only thing written per key, one fp32 reduce-add of each
valid key row instead of one per (key, head).

The key gradient is produced in column slices (``split_store`` slices of the value width, then
the RoPE tail) so that one slice at a time is held in registers. Each slice is either staged in
shared memory and handed to the TMA engine as one bulk ``cp.reduce.async.bulk .add.f32`` per
valid row (``dkv_reduce="tma"``: the adds happen in L2, off the load/store pipe, while the
threads go on with the next slice's MMAs), or added with fp32 atomics straight from registers
(``dkv_reduce="atomic"``). The MMA accumulator holds two neighbouring values of a row per
thread and four threads on 32 bytes of it; L2 adds such requests at 60% of the rate of 128-byte
row segments, so for 32- and 64-key blocks the lanes of each warp first trade registers with
shuffles (``dsa_red_add_warp_tile``) until every lane holds four consecutive values and 4 or 8
lanes cover 64 or 128 contiguous bytes of one row, then add them with 16-byte atomics. Padding
slots (-1 or out of range) get P = 0 and are never written. Query heads are padded to the MMA
row block (16, 32 or 64) with zero rows.

Deterministic mode (``deterministic=True``): fp32 reduce-adds land in L2 in whatever order the
programs reach them, and fp32 addition is not associative, so dkv differs from run to run in its
last bits. Integer addition is associative: in this mode every key-gradient value is converted to
a 64-bit fixed-point integer (``round(x * 2**k_d)``) and added with ``.add.u64`` (bulk or
atomic, two's complement), so the sum is the same bits in any order. The scale ``2**k_d`` of
each column d is chosen per call on the GPU from a bound on that column of ``|dkv|``
(:func:`_fixed_point_scale`), so that no partial sum can overflow 2**63 while the quantum stays
~2**-61 of the bound, and a column of large values (an outlier channel of q) does not coarsen
the others; the wrapper converts back through float64.
dq and dsink need only the fixed walk (below): each dq row, and the exact delta dsink reads, is
summed by one program in its walk's block order, and dsink is a torch reduction.

The bf16 ``out`` rounds ``delta = rowsum(o * do)``, and where attention is peaked (one key
holds nearly all the weight) ``dP - delta`` cancels, so that rounding would dominate dq: the
program also sums ``P * dP`` over its keys, which is the same rowsum with the fp32 ``o``, and
corrects dq (and the delta dsink reads) by the difference at the end.

The main kernel (:func:`_build_main`) is a sequence of named macros: ``load_rows`` (q, dout,
lse2 and delta of the program's heads), ``fill_ring`` (the first gathers), ``key_block`` per
block (``block_scores``, ``accumulate_dq``, ``refill_slot``, then per column slice
``key_gradient_slice`` and ``reduce_slice_tma`` / ``reduce_slice_atomic``) and ``refine``.

A small preprocess kernel computes ``rowsum(out * dout)`` in fp32. Folding the lse gradient
``dlse2`` into delta, the ``dsink`` reduction over (batch, query) rows, clamping the indices for
the gather and the fp32 -> bf16 conversion of dkv are O(B S H) / O(B S G topk) / O(B S_kv G D)
torch ops in the wrapper.

Synchronised walk (default mode, once dkv outgrows L2, see :func:`_sync_threshold`): past
L2's size the fp32 dkv rows are added from DRAM unless the programs running at once add to the
same part of it.
Index rows are ascending (``ranged_topk``'s contract; any order stays correct, only slower), so
the programs would sweep the keys together if they walked the same block at the same time, but
they start at different times. So each program starts its walk (a rotation of its blocks) at the
block the others are at: a counter in global memory gets one add per finished block, and a
program starting when it reads ``n`` begins at block ``(n // resident) % blocks``, ``resident``
being how many programs the GPU holds at once. The first wave reads 0 and starts at block 0.
The rotation changes the order a program sums its blocks, so dq and dsink (through the exact
delta) are no longer the same bits run to run there (dkv never was in this mode); deterministic
mode keeps the fixed order.

Batch, query length and key length are dynamic symbols of every kernel, so new lengths reuse
the compiled kernels; heads, groups, widths, padded top-k and the tiling are static and key the
``functools.lru_cache`` behind :func:`compile_backward`. The tiling has no default here: it
comes from the caller's ``SparseAttentionConfig``, and :func:`check_backward_config` rejects
what these kernels cannot run before anything is compiled. The fixed-walk and the synced kernel
of a configuration are compiled together, so a length that crosses from one to the other
compiles nothing either.
"""

# No `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations of the
# kernels, which name closure variables (shapes), so they must stay real expressions.
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang
import tilelang.language as T
import torch
import torch.nn.functional as F
from kernel_common import device_arch, sm_count, tilelang_target
from kernel_common.constants import (
    HOPPER_SMEM_PER_BLOCK,
    HOPPER_SMEM_PER_SM,
    LOG2E,
    MAX_REGISTERS_PER_THREAD,
    SM_REGISTERS,
    round_up,
)

from dsa_sparse_attention._tilelang._build import compile_kernel
from dsa_sparse_attention.config import DKV_REDUCE_MODES

# Automatic warp specialisation stays off: the pipeline here is explicit (cp.async ring, bulk
# reduce-adds issued by warp 0). The automatic bounds guards are off too: every access of the
# kernel is in range by construction (clamped gather indices, explicit head guards) and the
# guards would put a bounds test on every gathered 16-byte chunk. The aggressive shared-memory
# merge is deliberately NOT enabled: it aliased live buffers in a similar kernel and produced
# NaN gradients (tile-ai/tilelang#2199).
_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
}

# One bulk reduce-add of `bytes` contiguous fp32 from shared to global memory, done by the TMA
# engine (sm_90+); completion is tracked with bulk groups (commit / wait_group.read). The proxy
# fence carries a memory clobber so that the compiler cannot sink the staging stores below it.
_PRELUDE = r"""
__device__ __forceinline__ void dsa_bulk_reduce_add_f32(float* gmem, const float* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :: "l"(gmem), "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void dsa_bulk_reduce_add_u64(void* gmem, const void* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;\n"
               :: "l"(gmem), "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))), "r"(bytes)
               : "memory");
}
// x * 2**k rounded to the nearest int64, added as two's complement (the same bits in any order).
__device__ __forceinline__ void dsa_red_add_fixed(void* gmem, float x, float fix) {
  atomicAdd(static_cast<unsigned long long*>(gmem),
            static_cast<unsigned long long>(__float2ll_rn(x * fix)));
}
__device__ __forceinline__ void dsa_fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
"""
# Part of the prelude only for the kernels that call it (the others keep their source, and so
# their cache entries).
_WARP_TILE_PRELUDE = r"""
// Lanes `mask` apart trade registers: afterwards lane bit `mask` and register bit `bit` have
// swapped roles (one shuffle per register pair, the lane keeps the half its bit selects).
template <int N>
__device__ __forceinline__ void dsa_swap_lane_register_bit(float* acc, int mask, int bit) {
  const bool up = threadIdx.x & mask;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    if (r & bit) continue;
    const float recv = __shfl_xor_sync(0xffffffffu, up ? acc[r] : acc[r | bit], mask);
    if (up) acc[r] = recv; else acc[r | bit] = recv;
  }
}
// Adds one warp's 16 x 8*NJ fp32 tile of an MMA accumulator to rows idx[0..15] of dst (row
// stride `stride` floats; rows outside [0, seq_kv) are skipped) with 16-byte atomics. The tile
// is in the m16n8 / wgmma D-fragment order: lane l, register 4j + 2h + v holds row 8h + l/4,
// column 8j + 2(l%4) + v, so atomics straight from it carry 32 bytes of a row each, which L2
// adds at 60% of the rate of 128-byte segments (benchmarks/NOTES.md, the reduce floor).
// Swapping lane bit 0 with register bit 2 gives each lane 4 consecutive columns, 4 lanes on 64
// bytes of a row (registers 8m + 2h + {0, 1, 4, 5}: row l/4 + 8h, columns 16m + 8(l&1) +
// 4((l>>1)&1) + {0..3}). With WIDE, lane bit 4 also swaps with register bit 3: 8 lanes on 128
// bytes (registers 16m + 8a + 2h + {0, 1, 4, 5}: row (l>>2)&3 + 4a + 8h, columns 32m + 8(l&1) +
// 4((l>>1)&1) + 16((l>>4)&1) + {0..3}); two more shuffles per register pair and twice the rows
// per lane (registers), which the 256-thread programs, short of registers, pay for (NOTES.md).
template <int NJ, bool WIDE>
__device__ __forceinline__ void dsa_red_add_warp_tile(float* acc, const int* idx, float* dst,
                                                      long long stride, int seq_kv) {
  static_assert(NJ % (WIDE ? 4 : 2) == 0, "whole 64- / 128-byte segments per row");
  constexpr int kRows = WIDE ? 4 : 2;      // rows per lane
  constexpr int kSeg = WIDE ? 32 : 16;     // columns per segment
  const int lane = threadIdx.x & 31;
  dsa_swap_lane_register_bit<4 * NJ>(acc, 1, 4);
  if constexpr (WIDE) dsa_swap_lane_register_bit<4 * NJ>(acc, 16, 8);
  const int row = WIDE ? (lane >> 2) & 3 : lane >> 2;
  const int col = 8 * (lane & 1) + 4 * ((lane >> 1) & 1) + (WIDE ? 16 * ((lane >> 4) & 1) : 0);
  int key[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) key[k] = idx[row + (16 / kRows) * k];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    if (key[k] < 0 || key[k] >= seq_kv) continue;
    float* p = dst + key[k] * stride + col;
    // Row (16 / kRows) k: register bit 1 is h = row bit 3, and with WIDE bit 3 is row bit 2.
    const int r0 = WIDE ? 8 * (k & 1) + 2 * (k >> 1) : 2 * k;
#pragma unroll
    for (int m = 0; m < NJ * 8 / kSeg; ++m) {
      const int r = r0 + kSeg / 2 * m;
      atomicAdd(reinterpret_cast<float4*>(p + kSeg * m),
                make_float4(acc[r], acc[r + 1], acc[r + 4], acc[r + 5]));
    }
  }
}
"""

_PREPROCESS_ROWS, _PREPROCESS_COLS = 32, 128  # the delta kernel's tile; d_v is whole tiles
# Padding per staging row, 16 bytes (4 fp32 or 2 int64): consecutive rows start on different
# banks, and every row start stays 16-byte aligned for the bulk copies.
_STAGE_PAD_BYTES = 16


def _acc_bytes(deterministic: bool) -> int:
    """Bytes per dkv accumulator value: fp32, or int64 fixed point in deterministic mode."""
    return 8 if deterministic else 4


def head_block(heads_per_group: int) -> int:
    """Query-head rows per program: the group's heads padded to the MMA row block (16, 32 or
    64); groups of more than 64 heads are split into blocks of 64 (one program each)."""
    if heads_per_group > 32:
        return 64
    if heads_per_group > 16:
        return 32
    return 16


def program_threads(heads_per_group: int) -> int:
    """Threads per program, fixed by the head block: 4 warps for 16 head rows, 8 warps (two
    warpgroups) above."""
    return 128 if head_block(heads_per_group) <= 16 else 256


def shared_memory_bytes(
    heads_per_group: int,
    dim: int,
    d_v: int,
    *,
    block_i: int,
    num_stages: int,
    split_store: int,
    dkv_reduce: str,
    deterministic: bool,
) -> int:
    """Dynamic shared memory of one program of the dq / dkv kernel, in bytes (an upper bound:
    every buffer is rounded up to the 1 KiB alignment of swizzled MMA operands)."""
    block_h = head_block(heads_per_group)
    slices = _column_slices(dim, d_v, split_store)
    kib = lambda nbytes: round_up(nbytes, 1024)
    size = sum(kib(2 * block_h * w) for _, w in slices)  # q (bf16)
    size += sum(kib(2 * block_h * w) for c0, w in slices if c0 < d_v)  # dout (bf16)
    size += sum(kib(2 * num_stages * block_i * w) for _, w in slices)  # K/V ring
    size += 2 * kib(2 * block_h * block_i)  # P and dS (bf16)
    if dkv_reduce == "tma":
        widest = max(w for _, w in slices)
        size += kib(block_i * (_acc_bytes(deterministic) * widest + _STAGE_PAD_BYTES))
    return size


def _column_slices(dim: int, d_v: int, split_store: int) -> list[tuple[int, int]]:
    """(start, width) of the dkv column slices: d_v in `split_store` equal parts, then the tail
    (``check_backward_config`` makes every width a multiple of 64)."""
    width = d_v // split_store
    slices = [(c * width, width) for c in range(split_store)]
    if dim > d_v:
        slices.append((d_v, dim - d_v))
    return slices


def check_backward_config(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    block_i: int,
    num_stages: int,
    split_store: int,
    dkv_reduce: str,
    deterministic: bool,
) -> int:
    """Raise ValueError unless the backward kernels can run this configuration; return the
    main kernel's shared memory per program (:func:`shared_memory_bytes`), which it checks.

    Static shape: ``heads`` = ``q.shape[2]``, ``groups`` = ``kv.shape[2]``, ``dim`` =
    ``q.shape[-1]`` (d_v + RoPE tail), ``d_v``; tiling: ``block_i``, ``num_stages``,
    ``split_store``, ``dkv_reduce`` and ``deterministic`` (``SparseAttentionConfig.
    backward_block_i``, ``backward_stages``, ``split_store``, ``dkv_reduce``,
    ``deterministic``). Cheap, and called before anything is compiled; each message names the
    argument or config field to change.
    """
    if heads < 1 or groups < 1 or heads % groups:
        raise ValueError(
            f"q.shape[2] = {heads} query heads must be a positive multiple of kv.shape[2] = "
            f"{groups} kv groups"
        )
    hg = heads // groups
    if hg > 128:
        raise ValueError(
            f"q.shape[2] // kv.shape[2] = {hg} query heads per kv group must be at most 128"
        )
    if d_v < _PREPROCESS_COLS or d_v % _PREPROCESS_COLS:
        raise ValueError(
            f"d_v = {d_v} must be a positive multiple of {_PREPROCESS_COLS} (the delta "
            "kernel's column tile)"
        )
    if dim < d_v or (dim - d_v) % 64:
        raise ValueError(
            f"q.shape[-1] - d_v = {dim - d_v} (the RoPE tail) must be a non-negative multiple "
            "of 64: the gather and the MMA tiles move 64 columns at a time"
        )
    if dkv_reduce not in DKV_REDUCE_MODES:
        raise ValueError(
            f"SparseAttentionConfig.dkv_reduce = {dkv_reduce!r} must be one of {DKV_REDUCE_MODES}"
        )
    if block_i < 16 or block_i % 16:
        raise ValueError(
            f"SparseAttentionConfig.backward_block_i = {block_i} must be a positive multiple "
            "of 16 (the MMA tile of the key-gradient rows)"
        )
    block_h, threads = head_block(hg), program_threads(hg)
    # Each warp computes at least one 16 x 8 tile of the block_h x block_i score block.
    min_block_i = round_up(8 * (threads // 32) // (block_h // 16), 16)
    if block_i < min_block_i:
        raise ValueError(
            f"SparseAttentionConfig.backward_block_i = {block_i} is too small for {hg} heads per "
            f"group: the {threads // 32} warps of a {block_h}-row head block each need a 16 x 8 "
            f"tile of the {block_h} x {block_i} score block; use at least {min_block_i}"
        )
    if dkv_reduce == "tma" and block_i > threads:
        raise ValueError(
            f"SparseAttentionConfig.backward_block_i = {block_i} must be at most {threads} with "
            f"dkv_reduce='tma': each of the program's {threads} threads issues the bulk "
            "reduce-add of one key row"
        )
    if num_stages < 1:
        raise ValueError(
            f"SparseAttentionConfig.backward_stages = {num_stages} must be >= 1 (slots of the "
            "K/V ring)"
        )
    if split_store < 1 or d_v % split_store or (d_v // split_store) % 64:
        raise ValueError(
            f"SparseAttentionConfig.split_store = {split_store} must split d_v = {d_v} into "
            "slices whose width is a multiple of 64"
        )
    smem = shared_memory_bytes(
        hg,
        dim,
        d_v,
        block_i=block_i,
        num_stages=num_stages,
        split_store=split_store,
        dkv_reduce=dkv_reduce,
        deterministic=deterministic,
    )
    if smem > HOPPER_SMEM_PER_BLOCK:
        # The tma mode's staging buffer is the one thing dkv_reduce='atomic' would drop.
        fixes = "fewer backward_stages, a smaller backward_block_i" + (
            ", more split_store or dkv_reduce='atomic'"
            if dkv_reduce == "tma"
            else " or more split_store"
        )
        raise ValueError(
            f"SparseAttentionConfig.backward_block_i = {block_i}, backward_stages = "
            f"{num_stages}, split_store = {split_store}, dkv_reduce = {dkv_reduce!r} and "
            f"deterministic = {deterministic} need "
            f"{smem} bytes of shared memory for {block_h} head rows at q.shape[-1] = {dim}, "
            f"more than the {HOPPER_SMEM_PER_BLOCK} bytes a Hopper thread block can use; use "
            f"{fixes}"
        )
    return smem


def _build_preprocess(heads: int, d_v: int):
    """delta[b, s, h] = sum_d out[b, s, h, d] * dout[b, s, h, d] in fp32 (``d_v`` a multiple of
    ``_PREPROCESS_COLS``)."""
    rows, cols = _PREPROCESS_ROWS, _PREPROCESS_COLS
    batch, seq = T.dynamic("batch, seq_len")

    @T.prim_func
    def preprocess(
        Out: T.Tensor((batch, seq, heads, d_v), T.bfloat16),
        dO: T.Tensor((batch, seq, heads, d_v), T.bfloat16),
        Delta: T.Tensor((batch, seq, heads), T.float32),
    ):
        with T.Kernel(T.ceildiv(seq, rows), heads, batch, threads=128) as (bx, h, b):
            acc = T.alloc_fragment((rows, cols), T.float32)
            delta = T.alloc_fragment((rows,), T.float32)
            T.clear(acc)
            for k in T.serial(d_v // cols):
                for i, j in T.Parallel(rows, cols):
                    acc[i, j] += T.if_then_else(
                        bx * rows + i < seq,
                        T.cast(Out[b, bx * rows + i, h, k * cols + j], T.float32)
                        * T.cast(dO[b, bx * rows + i, h, k * cols + j], T.float32),
                        0.0,
                    )
            T.reduce_sum(acc, delta, dim=1)
            for i in T.Parallel(rows):
                if bx * rows + i < seq:
                    Delta[b, bx * rows + i, h] = delta[i]

    return preprocess


def _build_main(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk_padded: int,
    block_i: int,
    num_stages: int,
    split_store: int,
    dkv_reduce: str,
    deterministic: bool,
    synced: bool,
):
    """The dq / dkv kernel (see the module docstring) for a configuration that passed
    :func:`check_backward_config`; ``topk_padded`` is a multiple of ``block_i``, the index slots
    per row. ``synced``: walk the blocks from the start the ``Progress`` counter gives (the module
    docstring's synchronised walk), else from block 0.

    Arguments: ``Q`` bf16 ``[B, S, H, D]``, ``KV`` bf16 ``[B, S_kv, G, D]``, ``Out`` / ``dO``
    bf16 ``[B, S, H, d_v]``, ``Idx`` / ``IdxC`` int32 ``[B, S, G, topk_padded]`` (the padded
    indices and the same clamped into ``[0, S_kv)``), ``Lse2`` / ``Dot`` / ``Delta`` fp32
    ``[B, S, H]`` (log2 lse, ``rowsum(out * dout)``, the delta used for dS), outputs ``dQ`` bf16
    ``[B, S, H, D]``, ``dKV`` ``[B, S_kv, G, D]`` (added to; fp32, or int64 fixed point in
    deterministic mode) and ``DeltaFix`` fp32 ``[B, S, H]``, then ``Fix`` fp32 (the fixed-point
    scale ``2**k_d`` of each column, ``[D]``, in deterministic mode; ``[1]`` and unread
    otherwise), ``Progress`` int32 ``[1]`` (key blocks finished by all programs, from
    :func:`_walk_counter`: zero at launch, preset by tests; read and written only when
    ``synced``), ``sm_scale`` and ``resident`` (programs the GPU runs at once).
    """
    hg = heads // groups
    block_h = head_block(hg)
    threads = program_threads(hg)
    n_hc = -(-hg // block_h)  # head blocks per group
    bs = block_i
    n_blocks = topk_padded // bs
    slices = _column_slices(dim, d_v, split_store)
    value_slices = [c for c, (c0, _) in enumerate(slices) if c0 < d_v]
    stage_w = max(w for _, w in slices) + _STAGE_PAD_BYTES // _acc_bytes(deterministic)
    fix_len = dim if deterministic else 1
    use_tma = dkv_reduce == "tma"
    acc_dtype = T.int64 if deterministic else T.float32  # dKV and the staging buffer
    has_tail = dim > d_v
    # K/V ring of `n_buf` slots: the fetch of block ib + n_buf starts as soon as block ib's
    # slot is free (after its dq MMA), so up to n_buf blocks are in flight or resident.
    n_buf = num_stages
    # Gather: 8 threads per key row, 16 bytes (8 bf16) per cp.async; one index load per row.
    rows_per_pass = threads // 8
    # (Python loops over lists unroll at trace time; a `range` loop would become a TIR loop.)
    gather_passes = [*range(-(-bs // rows_per_pass))]
    ring = [*range(n_buf)]
    batch, seq, seq_kv = T.dynamic("batch, seq_len, seq_len_kv")
    # TileLang tiles the key-gradient accumulator [bs, w] of 32- and 64-key blocks as 16-row
    # warp tiles stacked over the whole block (wgmma for 64 keys, each warpgroup a column range;
    # mma.sync for 32), warp k at rows 16 (k % warps_m) and columns (k // warps_m) * w / warps_n,
    # each in the m16n8 register order (read off the generated code; the GPU tests compare dkv
    # with the reference on every such tiling). 128-byte segments where registers allow (H100,
    # 16k, results/backward_warp_tile_h100.log): against 64-byte ones they take 8 heads from
    # 32.6 to 28.8 ms and 32 heads (64-key blocks) from 38.2 to 36.4. The 64-row head blocks'
    # dq accumulator alone takes 144 registers a thread: there the second exchange costs more
    # than it saves on slices of 64 accumulator registers a thread (46.3 against 47.3 ms at 64
    # heads, 2 slices) and wins on slices of 32 (44.9 against 46.4, 4 slices;
    # results/backward_pipelined_slices_h100.log).
    warps = threads // 32
    warps_m = bs // 16

    def wide(w):
        """Whether a slice of width `w` is added in 128-byte segments (else 64-byte)."""
        return block_h < 64 or bs * w // threads <= 32

    def warp_tile(w):
        """(8-column chunks per warp, 128-byte segments) of a slice of width `w` for
        dsa_red_add_warp_tile, or None where the per-pair atomics stay. Warp tiles are 16
        columns or more (slices are multiples of 64 columns, at most 4 warps share them);
        128-byte segments need 32."""
        if use_tma or deterministic or bs not in (32, 64):
            return None
        cols = w // (warps // warps_m)
        return cols // 8, wide(w) and cols % 32 == 0

    tiles = [warp_tile(w) for _, w in slices]  # per slice
    prelude = _PRELUDE + (_WARP_TILE_PRELUDE if any(t is not None for t in tiles) else "")

    # Macros cannot see the kernel's locals: they take its buffers and indices in one namespace
    # `e`. Head rows at or past `e.n_real` are padding of a partial head block.

    def block(e, ib):
        """The index block of walk step `ib`: the program's rotation applied when synced."""
        return (ib + e.start[0]) % n_blocks if synced else ib

    @T.macro
    def load_rows(e):
        """The program's q and dout rows into shared memory (per column slice), its lse2 and
        delta into registers, and zeroed accumulators."""
        # Padded head rows load as zeros: their P is forced to 0, so they add nothing.
        for c, (c0, w) in enumerate(slices):
            for h, d in T.Parallel(block_h, w):
                e.q_s[c][h, d] = T.if_then_else(
                    h < e.n_real, e.Q[e.b, e.s, e.h0 + h, c0 + d], T.cast(0, T.bfloat16)
                )
        for j, c in enumerate(value_slices):
            c0, w = slices[c]
            for h, d in T.Parallel(block_h, w):
                e.do_s[j][h, d] = T.if_then_else(
                    h < e.n_real, e.dO[e.b, e.s, e.h0 + h, c0 + d], T.cast(0, T.bfloat16)
                )
        for h in T.Parallel(block_h):
            e.lse_f[h] = T.if_then_else(h < e.n_real, e.Lse2[e.b, e.s, e.h0 + h], 0.0)
            e.delta_f[h] = T.if_then_else(h < e.n_real, e.Delta[e.b, e.s, e.h0 + h], 0.0)
        for acc in [*e.acc_dq, e.acc_pdp, *([e.acc_pk] if has_tail else [])]:
            T.clear(acc)

    @T.macro
    def gather(e, ib, buf):
        """cp.async the K/V rows of walk step `ib` (its block: `block`) into ring slot `buf`
        (no wait)."""
        # Through the pre-clamped indices: always in range, so no per-element clamp or bounds
        # test; the mask comes from the original indices.
        key = block(e, ib) * bs
        for p in gather_passes:
            row = p * rows_per_pass + e.tx // 8
            if row < bs:
                for c, (c0, w) in enumerate(slices):
                    for k in T.unroll(w // 64):
                        col = k * 64 + (e.tx % 8) * 8
                        T.call_extern(
                            "handle",
                            "tl::cp_async_gs<16>",
                            T.address_of(e.kv_s[c][buf, row, col]),
                            T.address_of(
                                e.KV[e.b, e.IdxC[e.b, e.s, e.g, key + row], e.g, c0 + col]
                            ),
                        )

    @T.macro
    def fill_ring(e):
        """Start the gathers of the first `n_buf` blocks, one cp.async group per ring slot."""
        for j in ring:
            if j < n_blocks:
                gather(e, j, j)
            T.ptx_commit_group()

    @T.macro
    def block_scores(e, ib, kv):
        """Wait for walk step `ib` (rows `kv`), then P and dS for all heads into `p_s` /
        `ds_s`."""
        T.ptx_wait_group(n_buf - 1)  # this thread's copies of block ib have landed ...
        for r in T.Parallel(bs):
            e.valid[r] = (e.Idx[e.b, e.s, e.g, block(e, ib) * bs + r] >= 0) & (
                e.Idx[e.b, e.s, e.g, block(e, ib) * bs + r] < seq_kv
            )
        T.sync_threads()  # ... and everyone else's
        for c, q_c in enumerate(e.q_s):
            T.gemm(q_c, kv[c], e.acc_s, transpose_B=True, clear_accum=c == 0)
        for j, c in enumerate(value_slices):
            T.gemm(e.do_s[j], kv[c], e.acc_dp, transpose_B=True, clear_accum=j == 0)
        for h, r in T.Parallel(block_h, bs):
            e.acc_s[h, r] = T.if_then_else(
                e.valid[r] & (h < e.n_real),
                T.exp2(e.acc_s[h, r] * e.scale_log2 - e.lse_f[h]),
                0.0,
            )
        # dS carries the softmax scale of the logits (dq and dk both need it). Alongside,
        # sum P * dP: its row sum is rowsum(o * do) with the fp32 o (see `refine`).
        for h, r in T.Parallel(block_h, bs):
            e.acc_pdp[h, r] += e.acc_s[h, r] * e.acc_dp[h, r]
            e.acc_dp[h, r] = e.acc_s[h, r] * (e.acc_dp[h, r] - e.delta_f[h]) * e.sm_scale
        T.copy(e.acc_s, e.p_s)
        T.copy(e.acc_dp, e.ds_s)

    @T.macro
    def accumulate_dq(e, kv):
        """dq += dS K over the block's rows `kv` (and sum_j P_j K_j over the RoPE tail)."""
        for c, acc in enumerate(e.acc_dq):
            T.gemm(e.ds_s, kv[c], acc)
        if has_tail:
            T.gemm(e.p_s, kv[-1], e.acc_pk)  # sum_j P_j K_j over the RoPE tail columns

    @T.macro
    def refill_slot(e, ib, buf):
        """Slot `buf` is read for the last time: start the gather of block ib + n_buf into it."""
        # Right after the last read, so that the fetch overlaps this block's key-gradient work
        # (even with a single slot).
        T.sync_threads()
        if ib + n_buf < n_blocks:
            gather(e, ib + n_buf, buf)
        T.ptx_commit_group()  # one group per block, possibly empty, keeps the counts exact

    @T.macro
    def key_gradient_slice(e, c):
        """Column slice `c` of the block's key gradient, summed over the program's heads:
        ``acc_kv[c] = dS^T q (+ P^T do over the value columns)``."""
        c0, _ = slices[c]
        T.gemm(e.ds_s, e.q_s[c], e.acc_kv[c], transpose_A=True, clear_accum=True)
        if c0 < d_v:
            T.gemm(e.p_s, e.do_s[value_slices.index(c)], e.acc_kv[c], transpose_A=True)

    @T.macro
    def reduce_slice_tma(e, ib, c):
        """Add slice `c` to dKV with one bulk reduce-add per valid key row of block `ib`, staged
        through shared memory and issued by thread `row`."""
        c0, w = slices[c]
        # The bulk reads of the previous slice (issued by warp 0; other threads have no bulk
        # group and pass at once) must be done before the staging buffer is overwritten; they
        # overlapped the MMAs of this slice.
        T.tma_store_wait(0)
        T.sync_threads()
        for r, d in T.Parallel(bs, w):
            if deterministic:
                e.stage[r, d] = T.call_extern(
                    T.int64, "__float2ll_rn", e.acc_kv[c][r, d] * e.Fix[c0 + d]
                )
            else:
                e.stage[r, d] = e.acc_kv[c][r, d]
        # Make the generic-proxy stores visible to the TMA (async proxy) reads.
        T.call_extern("handle", "dsa_fence_proxy_async_shared")
        T.sync_threads()
        if e.tx < bs:
            row = e.Idx[e.b, e.s, e.g, block(e, ib) * bs + e.tx]
            if (row >= 0) & (row < seq_kv):
                T.call_extern(
                    "handle",
                    "dsa_bulk_reduce_add_u64" if deterministic else "dsa_bulk_reduce_add_f32",
                    T.address_of(e.dKV[e.b, row, e.g, c0]),
                    T.address_of(e.stage[e.tx, 0]),
                    w * _acc_bytes(deterministic),
                )
            T.tma_store_arrive()

    @T.macro
    def reduce_slice_atomic(e, ib, c):
        """Add slice `c` to dKV with atomics from registers (valid rows only): fp32, 16 bytes
        per atomic on 64- or 128-byte row segments (``dsa_red_add_warp_tile``) where the
        accumulator's warp tiling is known, else two values per atomic as the accumulator holds
        them; one 64-bit fixed-point add per value in deterministic mode."""
        c0, w = slices[c]
        tile = tiles[c]
        if tile is not None:  # a Python bool: TileLang picks the branch while tracing
            warp = e.tx // 32
            T.call_extern(
                "handle",
                f"dsa_red_add_warp_tile<{tile[0]}, {str(tile[1]).lower()}>",
                e.acc_kv[c].access_ptr("rw"),
                T.address_of(e.Idx[e.b, e.s, e.g, block(e, ib) * bs + warp % warps_m * 16]),
                T.address_of(e.dKV[e.b, 0, e.g, c0 + warp // warps_m * tile[0] * 8]),
                groups * dim,
                seq_kv,
            )
        else:
            key = block(e, ib) * bs
            for r, d in T.Parallel(bs, w):
                if (e.Idx[e.b, e.s, e.g, key + r] >= 0) & (e.Idx[e.b, e.s, e.g, key + r] < seq_kv):
                    if deterministic:
                        T.call_extern(
                            "handle",
                            "dsa_red_add_fixed",
                            T.address_of(e.dKV[e.b, e.Idx[e.b, e.s, e.g, key + r], e.g, c0 + d]),
                            e.acc_kv[c][r, d],
                            e.Fix[c0 + d],
                        )
                    else:
                        T.atomic_add(
                            e.dKV[e.b, e.Idx[e.b, e.s, e.g, key + r], e.g, c0 + d],
                            e.acc_kv[c][r, d],
                        )

    @T.macro
    def key_block(e, ib, buf):
        """All work of key block `ib`, whose K/V rows were fetched into ring slot `buf`."""
        kv = [kv_c[buf : buf + 1, :, :] for kv_c in e.kv_s]
        block_scores(e, ib, kv)
        accumulate_dq(e, kv)
        refill_slot(e, ib, buf)
        for c, _ in enumerate(slices):
            key_gradient_slice(e, c)
            if use_tma:
                reduce_slice_tma(e, ib, c)
            else:
                reduce_slice_atomic(e, ib, c)
        if synced and e.tx == 0:
            T.atomic_add(e.Progress[0], 1)

    @T.macro
    def refine(e):
        """Correct for the bf16 rounding of ``out`` in delta, then write dq and the exact delta.

        The block pass used the wrapper's ``Delta`` (``rowsum(out * do)`` from the bf16 ``out``,
        minus the lse gradient); where the attention is peaked, ``dP - delta`` cancels and that
        rounding dominates dS. The exact delta differs by
        ``err = sum_j P_j dP_j - rowsum(out * do)``, which changes dS by ``-P * err`` and so dq
        by ``-scale * err * sum_j P_j K_j``: that sum is ``out`` over the value columns (K = V
        there; the correction is already second order in the rounding) and ``acc_pk`` over the
        RoPE tail. dkv keeps the per-block dS: each key sums many queries' terms, which averages
        the rounding out. ``DeltaFix`` gets the exact delta (dsink reads it).
        """
        T.reduce_sum(e.acc_pdp, e.err_f, dim=1)
        for h in T.Parallel(block_h):
            e.err_f[h] = T.if_then_else(h < e.n_real, e.err_f[h] - e.Dot[e.b, e.s, e.h0 + h], 0.0)
        for h in T.Parallel(block_h):
            if h < e.n_real:
                e.DeltaFix[e.b, e.s, e.h0 + h] = e.Delta[e.b, e.s, e.h0 + h] + e.err_f[h]
        for c, (c0, w) in enumerate(slices):
            for h, d in T.Parallel(block_h, w):
                if h < e.n_real:
                    pk = (
                        T.cast(e.Out[e.b, e.s, e.h0 + h, c0 + d], T.float32)
                        if c0 < d_v
                        else e.acc_pk[h, d]
                    )
                    e.dQ[e.b, e.s, e.h0 + h, c0 + d] = T.cast(
                        e.acc_dq[c][h, d] - e.sm_scale * e.err_f[h] * pk, T.bfloat16
                    )

    @T.prim_func
    def main(
        Q: T.Tensor((batch, seq, heads, dim), T.bfloat16),
        KV: T.Tensor((batch, seq_kv, groups, dim), T.bfloat16),
        Out: T.Tensor((batch, seq, heads, d_v), T.bfloat16),
        dO: T.Tensor((batch, seq, heads, d_v), T.bfloat16),
        Idx: T.Tensor((batch, seq, groups, topk_padded), T.int32),
        IdxC: T.Tensor((batch, seq, groups, topk_padded), T.int32),
        Lse2: T.Tensor((batch, seq, heads), T.float32),
        Dot: T.Tensor((batch, seq, heads), T.float32),
        Delta: T.Tensor((batch, seq, heads), T.float32),
        dQ: T.Tensor((batch, seq, heads, dim), T.bfloat16),
        dKV: T.Tensor((batch, seq_kv, groups, dim), acc_dtype),
        DeltaFix: T.Tensor((batch, seq, heads), T.float32),
        Fix: T.Tensor((fix_len,), T.float32),
        Progress: T.Tensor((1,), T.int32),
        sm_scale: T.float32,
        resident: T.int32,
    ):
        with T.Kernel(seq, batch, groups * n_hc, threads=threads, prelude=prelude) as (
            s_i,
            b_i,
            gz,
        ):
            g = gz // n_hc
            h0 = g * hg + (gz % n_hc) * block_h  # first query head of this program
            n_real = T.min(block_h, hg - (gz % n_hc) * block_h)  # rows past it are padding

            # Operands are kept per column slice so that every MMA works on a whole buffer.
            q_s = [T.alloc_shared((block_h, w), T.bfloat16) for _, w in slices]
            do_s = [T.alloc_shared((block_h, slices[c][1]), T.bfloat16) for c in value_slices]
            kv_s = [T.alloc_shared((n_buf, bs, w), T.bfloat16) for _, w in slices]
            p_s = T.alloc_shared((block_h, bs), T.bfloat16)
            ds_s = T.alloc_shared((block_h, bs), T.bfloat16)
            valid = T.alloc_fragment((bs,), "bool")
            lse_f = T.alloc_fragment((block_h,), T.float32)
            delta_f = T.alloc_fragment((block_h,), T.float32)
            err_f = T.alloc_fragment((block_h,), T.float32)
            acc_pdp = T.alloc_fragment((block_h, bs), T.float32)
            acc_pk = T.alloc_fragment((block_h, dim - d_v), T.float32) if has_tail else None
            acc_s = T.alloc_fragment((block_h, bs), T.float32)
            acc_dp = T.alloc_fragment((block_h, bs), T.float32)
            acc_dq = [T.alloc_fragment((block_h, w), T.float32) for _, w in slices]
            acc_kv = [T.alloc_fragment((bs, w), T.float32) for _, w in slices]
            stage = T.alloc_shared((bs, stage_w), acc_dtype) if use_tma else None
            start = T.alloc_local((1,), T.int32) if synced else None
            e = SimpleNamespace(
                Q=Q,
                KV=KV,
                Out=Out,
                dO=dO,
                Idx=Idx,
                IdxC=IdxC,
                Lse2=Lse2,
                Dot=Dot,
                Delta=Delta,
                dQ=dQ,
                dKV=dKV,
                DeltaFix=DeltaFix,
                Fix=Fix,
                Progress=Progress,
                start=start,
                sm_scale=sm_scale,
                scale_log2=sm_scale * LOG2E,
                b=b_i,
                s=s_i,
                g=g,
                h0=h0,
                n_real=n_real,
                tx=T.get_thread_binding(),
                q_s=q_s,
                do_s=do_s,
                kv_s=kv_s,
                p_s=p_s,
                ds_s=ds_s,
                valid=valid,
                lse_f=lse_f,
                delta_f=delta_f,
                err_f=err_f,
                acc_s=acc_s,
                acc_dp=acc_dp,
                acc_dq=acc_dq,
                acc_kv=acc_kv,
                acc_pdp=acc_pdp,
                acc_pk=acc_pk,
                stage=stage,
            )

            if synced:
                # One thread reads the counter (through an atomic: L1 does not see other SMs'
                # adds) and shares the start, which every thread must agree on. The start is a
                # floor modulo, in [0, n_blocks) even if the int32 counter ever wrapped.
                start_s = T.alloc_shared((1,), T.int32)
                if e.tx == 0:
                    done = T.atomic_add(Progress[0], 0, return_prev=True)
                    start_s[0] = (done // resident) % n_blocks
                T.sync_threads()
                start[0] = start_s[0]
            load_rows(e)
            fill_ring(e)
            for ib in T.serial(n_blocks):
                key_block(e, ib, ib % n_buf)
            if use_tma:
                # Shared memory must outlive the last bulk reads: wait for full completion
                # (threads that issued none return at once).
                T.tma_store_wait(0, False)
            refine(e)

    return main


@dataclass(frozen=True)
class MainKernel:
    """One compiled dq / dkv kernel and what its launch needs."""

    # (q, kv, out, dout, idx, idx_clamped, lse2, rowsum, delta, dq, dkv_acc, delta_fix, fix,
    #  progress, scale, resident)
    kernel: tilelang.JITKernel
    synced: bool  # the synchronised walk (module docstring)
    programs_per_sm: int  # resident = this x the GPU's SMs


@dataclass(frozen=True)
class BackwardKernels:
    """The compiled kernels of one static configuration (see :func:`compile_backward`)."""

    preprocess: tilelang.JITKernel  # (out, dout, rowsum(out * dout))
    main: MainKernel  # the fixed walk
    synced: MainKernel | None  # the synchronised walk (None in deterministic mode)
    sync_above: int | None  # fp32 dkv bytes past which `synced` runs (`_sync_threshold`)
    topk_padded: int

    def main_for(self, dkv_bytes: int) -> MainKernel:
        """The main kernel for an input whose fp32 dkv ``[B, S_kv, G, D]`` takes ``dkv_bytes``."""
        if self.synced is not None and dkv_bytes > self.sync_above:
            return self.synced
        return self.main


@functools.lru_cache(maxsize=None)
def _compile_preprocess(heads: int, d_v: int, target: str) -> tilelang.JITKernel:
    # Default pass configs: the automatic bounds guards cover the ragged last row block.
    return compile_kernel(
        lambda: _build_preprocess(heads, d_v), target={"kind": "cuda", "arch": target}
    )


@functools.lru_cache(maxsize=None)
def _compile_main(*static: object, target: str) -> tilelang.JITKernel:
    return compile_kernel(
        lambda: _build_main(*static),
        target={"kind": "cuda", "arch": target},
        pass_configs=_PASS_CONFIGS,
    )


def compile_backward(
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk: int,
    *,
    block_i: int,
    num_stages: int,
    split_store: int,
    dkv_reduce: str,
    deterministic: bool,
    target: str,
) -> BackwardKernels:
    """Compile (or fetch from the in-process cache) the kernels of one static configuration.

    Args:
        heads: query heads H (TP-local); groups: kv groups G, ``H % G == 0``, 1..128 heads
            per group.
        dim: q/kv width D = ``d_v`` + RoPE tail; d_v: value width. Both the value width split
            in ``split_store`` slices and the tail must be multiples of 64 columns.
        topk: indices per query row (padded up to a multiple of ``block_i`` with -1).
        block_i: keys per block, a multiple of 16 (``SparseAttentionConfig.backward_block_i``).
        num_stages: slots of the K/V ring (``SparseAttentionConfig.backward_stages``). Block
            i + n is fetched into block i's slot right after block i's dq MMA, so n = 1 already
            overlaps the fetch with the key-gradient work and n > 1 prefetches further ahead.
        split_store: slices of d_v the key gradient is computed and written in.
        dkv_reduce: ``"tma"`` (one bulk reduce-add per valid key row and slice) or
            ``"atomic"`` (atomics from registers).
        deterministic: add dkv as 64-bit fixed point (bitwise reproducible, see the module
            docstring) instead of fp32.
        target: the CUDA arch to compile for, e.g. ``"sm_90a"``. Compiling needs nvcc, not a
            GPU.

    Raises ValueError (see :func:`check_backward_config`) before compiling anything the kernels
    cannot run. Threads per program follow the head count (:func:`program_threads`). Batch,
    query and key lengths are not parameters: the kernels take them at run time. In default
    mode the synced kernel is compiled here too, so that no length compiles anything later.
    """
    smem = check_backward_config(
        heads, groups, dim, d_v, block_i, num_stages, split_store, dkv_reduce, deterministic
    )
    topk_padded = round_up(topk, block_i)
    hg = heads // groups
    per_sm = _programs_per_sm(program_threads(hg), smem)
    sync_above = _sync_threshold(head_block(hg), deterministic)

    def main_kernel(synced: bool) -> MainKernel:
        kernel = _compile_main(
            heads,
            groups,
            dim,
            d_v,
            topk_padded,
            block_i,
            num_stages,
            split_store,
            dkv_reduce,
            deterministic,
            synced,
            target=target,
        )
        return MainKernel(kernel, synced, per_sm)

    return BackwardKernels(
        preprocess=_compile_preprocess(heads, d_v, target),
        main=main_kernel(False),
        synced=None if sync_above is None else main_kernel(True),
        sync_above=sync_above,
        topk_padded=topk_padded,
    )


def _sync_threshold(block_h: int, deterministic: bool) -> int | None:
    """The fp32 dkv size in bytes past which the synchronised walk runs (None: never).

    What the walk buys is dkv's residency in L2 (50 MB on Hopper). Measured on H100s
    (`results/sparse_attention_full_sync_walk_h100.csv` against the fixed walk's
    `sparse_attention_full_h100.csv`, `results/backward_sync_walk_h100.log`,
    `results/backward_sync_resident_pitch_h100.log`): below 64-row head blocks the walk took the
    backward at glm5 8 heads from 218 to 108-111 ms at 64k and from 522-528 to 262-310 at 128k,
    cut it by 3-5% at 16k (36 MiB of dkv) and by 23% at dsv4.1-flash-r1 8 heads 16k (64 MiB),
    changed it by -2 to +1% at 32 MiB, and cost 1-8% at 4k and 8k (9-18 MiB; 11-25% on the 4k dsv4.1
    rows, where the unchanged deterministic rows moved 7-10% between the runs). At 64-row head
    blocks it cost 1-3% at glm5 16k (36 MiB) and gained 8% at 64 MiB (glm5.3-flash-notail 32k),
    14% at 72 MiB (glm5 32k) and 10-32% at 128k. Deterministic mode keeps the fixed walk (dq's
    and dsink's bits depend on its order)."""
    if deterministic:
        return None
    return (48 if block_h == 64 else 32) * 1024 * 1024


def _programs_per_sm(threads: int, smem: int) -> int:
    """Programs of the main kernel one SM runs at once: the synchronised walk's ``resident``
    count is this times the SMs. The kernels are compiled for one program per SM at least, so
    ptxas may give each thread up to 255 registers and the 256-thread programs take a whole
    SM's registers; the 128-thread ones take 2 (the 16-head rows use 241 registers a thread,
    and ncu counts two programs per SM), fewer if their shared memory does not fit twice."""
    by_registers = SM_REGISTERS // (threads * MAX_REGISTERS_PER_THREAD)
    return max(1, min(by_registers, HOPPER_SMEM_PER_SM // (smem + 1024)))


def _walk_counter(device: torch.device) -> torch.Tensor:
    """int32 ``[1]``: the synchronised walk's count of finished key blocks, zero at launch (the
    tests and memcheck preset it to start every program at another block)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned base (cp.async / bulk copies move 16 B units)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# The fixed-point scale keeps every partial sum of a dkv column below 2**61 (int64 holds 2**63):
# 2 bits of headroom for the rounding of the bound itself and of the bf16 P / dS operands. Its
# exponent stays where 2**k and 2**-k are normal fp32 numbers.
_FIXED_POINT_BITS = 61
_FIXED_POINT_MAX_EXP = 120


def _fixed_point_scale(
    q: torch.Tensor,
    kv: torch.Tensor,
    dout: torch.Tensor,
    dot: torch.Tensor,
    dlse2: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
) -> torch.Tensor:
    """fp32 ``[D]``: the scale ``2**k_d`` of each dkv column, with ``bound_d * 2**k_d <= 2**61``
    for a bound on every partial sum of that column; computed on the GPU with deterministic
    torch reductions (no host sync); all NaN when an input is not finite (dkv is then NaN).

    Query row (t, h) adds ``sum_j (dS_j q_th + P_j dout_th)`` to the keys it selects, with
    ``sum_j P_j <= 1`` (the sink takes the rest), ``|dS_j| <= P_j * sm_scale * slack_th`` and
    ``slack_th = ||dout_th|| max_j ||v_j|| + |rowsum(out * dout)_th| + |dlse_th|`` (which bounds
    ``|dP_j - delta|``). So no partial sum of column d exceeds ``sm_scale * max_th slack_th *
    sum_th |q_th,d| + sum_th |dout_th,d|``; twice that is the bound (margin for the bf16 norms
    and sums). Per column, an outlier channel of q or dout coarsens only its own column; the
    largest slack (instead of each row's) costs a few of the 61 bits where rows differ, and
    keeps the bound to one read of q and dout (the 1-norms over rows), where weighting each row
    took ~10 ms more at 64 heads 16k."""
    d = q.shape[-1]
    v_norm = torch.linalg.vector_norm(kv[..., :d_v], dim=-1).amax().float()
    slack = torch.linalg.vector_norm(dout, dim=-1).float() * v_norm + dot.abs()
    if dlse2 is not None:
        slack = slack + dlse2.abs() * LOG2E
    bound = torch.linalg.vector_norm(q.reshape(-1, d), ord=1, dim=0).float()
    bound *= sm_scale * slack.amax()
    bound[:d_v] += torch.linalg.vector_norm(dout.reshape(-1, d_v), ord=1, dim=0).float()
    bound *= 2.0
    exp = (_FIXED_POINT_BITS - torch.log2(bound).ceil()).clamp(
        -_FIXED_POINT_MAX_EXP, _FIXED_POINT_MAX_EXP
    )
    return torch.where(torch.isfinite(bound).all(), torch.exp2(exp), torch.nan)


def sparse_attention_backward_tilelang(
    dout: torch.Tensor,
    dlse2: torch.Tensor | None,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse2: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    *,
    block_i: int,
    num_stages: int,
    split_store: int,
    dkv_reduce: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of sparse attention w.r.t. q, kv and the sink (CUDA tensors, no host sync).

    Args:
        dout: bfloat16 ``[B, S, H, d_v]``, gradient of the output.
        dlse2: float32 ``[B, S, H]`` or None, gradient w.r.t. the log2-space lse output
            ``lse2`` (the natural-log lse's gradient is ``dlse2 * log2(e)``).
        q: bfloat16 ``[B, S, H, D]``; kv: bfloat16 ``[B, S_kv, G, D]`` (K = the whole row, V its
            first ``d_v`` columns); head ``h`` reads group ``h // (H // G)``.
        indices: int32 ``[B, S, G, topk]``, any topk >= 1; -1 and any value outside
            ``[0, S_kv)`` is padding, anywhere in the row; duplicates count once per occurrence.
        out: bfloat16 ``[B, S, H, d_v]``, the forward output.
        lse2: float32 ``[B, S, H]``, log2-space lse of the scaled logits with the sink folded in
            (natural lse / ln 2; -inf for a row with no valid index and no sink).
        attn_sink: float32 ``[H]`` or None.
        sm_scale: softmax scale of the logits; d_v: value width.
        block_i, num_stages, split_store, dkv_reduce, deterministic: see
            :func:`compile_backward`.

    Returns:
        ``dq`` bfloat16 ``[B, S, H, D]``, ``dkv`` bfloat16 ``[B, S_kv, G, D]`` (accumulated in
        fp32, or in 64-bit fixed point with ``deterministic``: then every output is the same
        bits on every run and graph replay) and ``dsink`` float32 ``[H]`` (None without a
        sink). A row whose indices are all padding gets dq = 0 and adds nothing to dkv.
    """
    b, s, h, d = q.shape
    s_kv, g = kv.shape[1], kv.shape[2]
    acc_dtype = torch.int64 if deterministic else torch.float32
    dkv_acc = torch.zeros(b, s_kv, g, d, dtype=acc_dtype, device=q.device)
    # Nothing to launch for an empty grid or when no key exists that an index could name.
    launch = b * s > 0 and s_kv > 0
    if launch:
        kernels = compile_backward(
            h,
            g,
            d,
            d_v,
            indices.shape[-1],
            block_i=block_i,
            num_stages=num_stages,
            split_store=split_store,
            dkv_reduce=dkv_reduce,
            deterministic=deterministic,
            target=tilelang_target(device_arch(q.device))["arch"],
        )
        main = kernels.main_for(dkv_acc.numel() * 4)
        pad = kernels.topk_padded - indices.shape[-1]
        idx = _aligned(F.pad(indices, (0, pad), value=-1) if pad else indices)
        # Padding of any kind gathers row 0 (always in range); the kernel masks it from `idx`.
        idx_c = torch.where((idx >= 0) & (idx < s_kv), idx, 0)
        dout = _aligned(dout)
        out = _aligned(out)
        dot = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
        kernels.preprocess(out, dout, dot)
    else:
        dot = (out.float() * dout.float()).sum(-1)  # only dsink reads it
    # d lse / d s_j = p_j, so the lse gradient folds into delta; lse2 = lse * log2(e), so the
    # natural-log lse receives dlse2 * log2(e).
    delta = dot - dlse2 * LOG2E if dlse2 is not None else dot
    if launch:
        fix = (
            _fixed_point_scale(q, kv, dout, dot, dlse2, sm_scale, d_v)
            if deterministic
            else torch.ones(1, device=q.device)  # unread
        )
        dq = torch.empty_like(q)  # every real head row is written by the kernel
        delta_fix = torch.empty_like(delta)  # delta without the bf16 rounding of out
        progress = (
            _walk_counter(q.device)
            if main.synced
            else torch.empty(1, dtype=torch.int32, device=q.device)  # unread
        )
        main.kernel(
            _aligned(q),
            _aligned(kv),
            out,
            dout,
            idx,
            idx_c,
            _aligned(lse2),
            dot,
            delta,
            dq,
            dkv_acc,
            delta_fix,
            fix,
            progress,
            float(sm_scale),
            main.programs_per_sm * sm_count(q.device),
        )
        delta = delta_fix
    else:
        dq = torch.zeros_like(q)
    dsink = None
    if attn_sink is not None:
        # p_sink = exp(sink - lse) per row; rows with lse = -inf (no key, no sink) add nothing.
        p_sink = torch.exp2(attn_sink.float() * LOG2E - lse2)
        dsink = -(delta * torch.where(torch.isneginf(lse2), 0.0, p_sink)).sum(dim=(0, 1))
    if deterministic and launch:
        # The scales are powers of two: float64 keeps 53 bits of each sum (bf16 needs 8).
        dkv = dkv_acc.to(torch.float64).div_(fix.to(torch.float64)).to(torch.bfloat16)
    else:
        dkv = dkv_acc.to(torch.bfloat16)  # int64 zeros when nothing was launched
    return dq, dkv, dsink
