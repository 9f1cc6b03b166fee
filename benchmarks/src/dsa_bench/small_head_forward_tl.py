"""A few-head forward whose key rows arrive through the copy engine, as a TileLang kernel.

One 4-warp program per (query, kv group), the group's heads (<= 16) padded to the 16 rows of
m16n8k16. Each warp issues one ``cp.async.bulk`` per valid key row of its quarter of a block
into a ring of stages (pitch D + 8: ``ldmatrix`` reads 8 rows on 8 bank groups) completing on
an mbarrier;
each warp computes S over a quarter of D from Q fragments in registers, the four partial S are
summed in shared memory in a fixed order, and each warp accumulates O for a quarter of the
value columns (P from registers, V through ``ldmatrix.trans``). The library forward's whole
contract: batch, kv groups, a sink, any topk, ``d_v`` and the RoPE tail multiples of 64.
TileLang lays out the program (shared buffers, the block loop, the softmax, the stores); the
warp-level instructions it has no tile operator for (``ldmatrix``, ``mma.sync`` on register
fragments, the per-row bulk copies) are small device functions in the kernel's prelude.

Not a library kernel yet. On an H100 it takes 0.68-0.80x of the library forward's time at 8
heads and 0.75-0.85x at 16 heads, at 4k and 16k tokens (benchmarks/NOTES.md, "A few-head
forward on the copy engine": its first version, where warp 0 issued every copy, was no faster
than the library's forward).
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's annotations.
import functools

import tilelang
import tilelang.language as T
import torch
from dsa_sparse_attention._tilelang._build import compile_kernel
from kernel_common.constants import LOG2E

HB = 16  # M rows of m16n8k16: the heads of one group, padded
WARPS = 4
THREADS = 32 * WARPS
LAUNCHES = ((16, 2), (16, 3), (16, 4), (32, 2), (32, 3), (64, 2))  # (keys per block, stages)

# Barriers are placed by hand (one per block, the refills right after it); TileLang's automatic
# syncs would add their own around the shared buffers the prelude's functions touch.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    # Q's buffer is dead to TileLang after the fragment loads, but a fast warp must not reuse it
    # for the partial scores while a slow one still loads its fragments (no barrier between).
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
}

_PRELUDE = (
    f"#define DSA_WARPS {WARPS}\n"
    + r"""
#include <tl_templates/cuda/common.h>
#include <cuda_bf16.h>
__device__ __forceinline__ unsigned dsa_smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// c[0..7] += A (a[0..3], a 16 x 16 row-major fragment) times the two 16 x 8 column fragments
// that one ldmatrix x4 at `src` loads (lane l names row l % 8 of matrix l / 8; TRANS: .trans):
// matrices 0, 1 are the first n-tile's B fragment (c[0..3]), 2, 3 the second's (c[4..7]).
template <bool TRANS>
__device__ __forceinline__ void dsa_mma_pair(const void* src, float* c, const unsigned* a) {
  unsigned b[4];
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(dsa_smem_u32(src)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(dsa_smem_u32(src)));
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[4 * n]), "+f"(c[4 * n + 1]), "+f"(c[4 * n + 2]), "+f"(c[4 * n + 3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2 * n]), "r"(b[2 * n + 1]));
  }
}
// Q's A fragments: one ldmatrix x4 (lanes 0-15 rows 0-15 of the first 8 columns, 16-31 of the
// next 8).
__device__ __forceinline__ void dsa_ldsm_x4(const void* src, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(dsa_smem_u32(src)));
}
__device__ __forceinline__ unsigned dsa_pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ void dsa_mbar_init(uint64_t* bars, int n, int arrivals) {
  for (int s = 0; s < n; ++s)
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(dsa_smem_u32(bars + s)), "r"(arrivals));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void dsa_mbar_wait(uint64_t* bar, int parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(dsa_smem_u32(bar)), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void dsa_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Every warp gathers 1 / DSA_WARPS of each block (its "share" of BK / DSA_WARPS rows), so the
// copies of a block are issued by all warps at once. A cp.async.bulk takes its addresses in uniform
// registers: the compiler issues one lane's copy per pass of a loop, so one warp issuing all
// BK copies held the other warps at the next barrier (ncu: 29% of the stalls).
//
// Lane l < BK / DSA_WARPS of warp w: the raw index of slot col0 + w * BK / DSA_WARPS + l into
// *row (-1 past topk). Loaded one block before its copies are issued and range-checked only
// there, so the load's latency is off the path between two barriers.
template <int BK>
__device__ __forceinline__ void dsa_load_rows(const int* idx_row, int col0, int topk, int* row) {
  constexpr int RW = BK / DSA_WARPS;
  const int lane = threadIdx.x & 31, col = col0 + (threadIdx.x >> 5) * RW + lane;
  *row = (lane < RW && col < topk) ? __ldg(idx_row + col) : -1;
}
// Warp w: the valid rows of its share (*row from dsa_load_rows; valid: 0 <= row < s_kv) into
// stage `slot` of `stages` (rows `pitch` elements apart), one bulk copy of `row_elems` bf16
// each, completing on bars[slot] (DSA_WARPS arrivals: one per warp); the share's validity bits,
// at their key positions in the block's MW words, into masks[slot][w][] (words per warp, so no
// two warps store to one word; readers OR them). Lane 0 stores them before its arrival, so
// every thread that waits on the barrier sees them. Invalid rows are not copied. (The stage is
// found here from the slot: TileLang's storage rewrite fails on an address_of at a run-time
// offset into the 64-key stages.)
template <int BK>
__device__ __forceinline__ void dsa_issue_rows(const int* row, const void* kv, long long kv_stride,
                                               int row_elems, int s_kv, void* stages, int pitch,
                                               unsigned* masks, uint64_t* bars, int slot) {
  constexpr int MW = (BK + 31) / 32, RW = BK / DSA_WARPS;
  static_assert(RW <= 32 && 32 % RW == 0, "a share's bits lie in one word");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, key0 = warp * RW;
  const int r = *row;
  const bool valid = lane < RW && r >= 0 && r < s_kv;
  const unsigned bits = __ballot_sync(0xffffffffu, valid);  // lanes 0..RW-1
  uint64_t* bar = bars + slot;
  dsa_fence_proxy_async();  // the stage was last read through the generic proxy (ldmatrix)
  if (lane == 0) {
#pragma unroll
    for (int w = 0; w < MW; ++w)
      masks[(slot * DSA_WARPS + warp) * MW + w] = w == key0 / 32 ? bits << (key0 % 32) : 0u;
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(dsa_smem_u32(bar)),
                 "r"(__popc(bits) * row_elems * 2) : "memory");
  }
  __syncwarp();
  if (valid) {
    char* dst = static_cast<char*>(stages) + (slot * BK + key0 + lane) * pitch * 2;
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];"
                 ::"r"(dsa_smem_u32(dst)), "l"(static_cast<const char*>(kv) + r * kv_stride * 2),
                 "r"(row_elems * 2), "r"(dsa_smem_u32(bar)) : "memory");
  }
}
"""
)


def build(heads: int, groups: int, dim: int, d_v: int, has_sink: bool, block: int, stages: int):
    """The ``prim_func``: ``Q`` bf16 ``[B, S, H, D]``, ``KV`` bf16 ``[B, S_kv, G, D]``,
    ``Indices`` int32 ``[B, S, G, topk]`` (any entry outside ``[0, S_kv)`` is padding),
    ``Sink`` fp32 ``[H]`` (read only with a sink), ``Out`` bf16 ``[B, S, H, d_v]``, ``Lse`` fp32
    ``[B, S, H]`` (log2 units, sink folded in), ``sm_scale``. Static: the arguments here;
    dynamic: B, S, S_kv, topk."""
    hg = heads // groups
    if heads % groups or not 1 <= hg <= HB:
        raise ValueError(f"{heads} heads in {groups} groups: 1 to {HB} heads per group")
    if dim % (16 * WARPS) or d_v % (8 * 2 * WARPS) or not 0 < d_v <= dim:
        raise ValueError(f"dim = {dim}, d_v = {d_v}: multiples of 64, d_v <= dim")
    if (block, stages) not in LAUNCHES:
        raise ValueError(f"(block, stages) = {(block, stages)} not in {LAUNCHES}")
    pitch = dim + 8  # an odd multiple of 16 bytes: ldmatrix's 8 rows on 8 bank groups
    ks_w = dim // 16 // WARPS  # S k-steps per warp (its quarter of D)
    nt = block // 8  # S n-tiles
    kt = block // 16  # P V k-steps
    vt = d_v // WARPS // 8  # P V n-tiles per warp
    cols_w = d_v // WARPS
    mw = (block + 31) // 32
    bf16, f32 = "bfloat16", "float32"
    batch, seq, seq_kv, topk = T.dynamic("batch, seq, seq_kv, topk")

    @T.macro
    def load_rows(Indices, rows, bb, bs, bg, j):
        """Every warp: the indices of its share of block j into ``rows`` (``dsa_load_rows``)."""
        T.call_extern(
            "handle",
            f"dsa_load_rows<{block}>",
            T.address_of(Indices[bb, bs, bg, 0]),
            j * block,
            topk,
            T.address_of(rows[0]),
        )

    @T.macro
    def issue(KV, ks, masks, bars, rows, bb, bg, j):
        """Every warp: its share of block j's rows into stage j % stages (``dsa_issue_rows``)."""
        T.call_extern(
            "handle",
            f"dsa_issue_rows<{block}>",
            T.address_of(rows[0]),
            T.address_of(KV[bb, 0, bg, 0]),
            groups * dim,
            dim,
            seq_kv,
            T.address_of(ks[0]),
            pitch,
            T.address_of(masks[0, 0, 0]),
            T.address_of(bars[0]),
            j % stages,
        )

    @T.prim_func
    def few_head_fwd(
        Q: T.Tensor([batch, seq, heads, dim], bf16),
        KV: T.Tensor([batch, seq_kv, groups, dim], bf16),
        Indices: T.Tensor([batch, seq, groups, topk], "int32"),
        Sink: T.Tensor([heads], f32),
        Out: T.Tensor([batch, seq, heads, d_v], bf16),
        Lse: T.Tensor([batch, seq, heads], f32),
        sm_scale: T.float32,
    ):
        with T.Kernel(seq, batch, groups, threads=THREADS, prelude=_PRELUDE) as (bs, bb, bg):
            qs = T.alloc_shared([HB * pitch], bf16)
            ks = T.alloc_shared([stages * block * pitch], bf16)
            part = T.alloc_shared([2 * WARPS * nt * 128], f32)
            bars = T.alloc_shared([stages], "uint64")
            masks = T.alloc_shared([stages, WARPS, mw], "uint32")
            qa = T.alloc_local([ks_w * 4], "uint32")
            pa = T.alloc_local([4], "uint32")
            sc = T.alloc_local([nt * 4], f32)
            o = T.alloc_local([vt * 4], f32)
            m_run = T.alloc_local([2], f32)
            l_run = T.alloc_local([2], f32)
            mx = T.alloc_local([2], f32)
            alpha = T.alloc_local([2], f32)
            tot = T.alloc_local([2], f32)
            lse2 = T.alloc_local([1], f32)
            mword = T.alloc_local([mw], "int32")
            rows = T.alloc_local([1], "int32")  # this lane's index in the next block to issue
            tx = T.get_thread_binding()
            warp = tx // 32
            lane = tx % 32
            n_blocks = T.ceildiv(topk, block)
            scale2 = sm_scale * LOG2E

            if tx == 0:
                T.call_extern("handle", "dsa_mbar_init", T.address_of(bars[0]), stages, WARPS)
            # Zero Q's padding rows and every stage once: rows never copied stay finite.
            for i in T.serial(T.ceildiv(HB * pitch // 8, THREADS)):
                e = i * THREADS + tx
                if e < HB * pitch // 8:
                    for v in T.vectorized(8):
                        qs[e * 8 + v] = T.cast(0, bf16)
            for i in T.serial(T.ceildiv(stages * block * pitch // 8, THREADS)):
                e = i * THREADS + tx
                if e < stages * block * pitch // 8:
                    for v in T.vectorized(8):
                        ks[e * 8 + v] = T.cast(0, bf16)
            T.call_extern("handle", "dsa_fence_proxy_async")  # the copy engine writes ks next
            T.sync_threads()
            for i in T.serial(T.ceildiv(hg * dim // 8, THREADS)):
                e = i * THREADS + tx
                if e < hg * dim // 8:
                    h = e // (dim // 8)
                    c = e % (dim // 8)
                    for v in T.vectorized(8):
                        qs[h * pitch + c * 8 + v] = Q[bb, bs, bg * hg + h, c * 8 + v]
            T.sync_threads()
            for j in T.serial(stages):
                if j < n_blocks:
                    load_rows(Indices, rows, bb, bs, bg, j)
                    issue(KV, ks, masks, bars, rows, bb, bg, j)
            if stages < n_blocks:
                load_rows(Indices, rows, bb, bs, bg, stages)
            for k in T.unroll(ks_w):
                col = (warp * ks_w + k) * 16 + (lane // 16) * 8
                T.call_extern(
                    "handle",
                    "dsa_ldsm_x4",
                    T.address_of(qs[(lane % 16) * pitch + col]),
                    T.address_of(qa[k * 4]),
                )
            for i in T.unroll(vt * 4):
                o[i] = 0
            for r in T.unroll(2):
                m_run[r] = -1e30  # finite: an all-padding block rescales by exp2(0)
                l_run[r] = 0

            for j in T.serial(n_blocks):
                s = j % stages
                stage0 = s * block * pitch
                T.call_extern("handle", "dsa_mbar_wait", T.address_of(bars[s]), (j // stages) % 2)
                for i in T.unroll(nt * 4):
                    sc[i] = 0
                for k in T.unroll(ks_w):
                    col = (warp * ks_w + k) * 16 + ((lane // 8) % 2) * 8
                    for t in T.unroll(nt // 2):
                        key = t * 16 + (lane // 16) * 8 + lane % 8
                        T.call_extern(
                            "handle",
                            "dsa_mma_pair<false>",
                            T.address_of(ks[stage0 + key * pitch + col]),
                            T.address_of(sc[8 * t]),
                            T.address_of(qa[k * 4]),
                        )
                # This warp's partial S (its quarter of D), in fragment order.
                base = (j % 2) * WARPS * nt * 128
                for t in T.unroll(nt):
                    for i in T.vectorized(4):
                        part[base + (warp * nt + t) * 128 + lane * 4 + i] = sc[t * 4 + i]
                T.sync_threads()
                # Every warp is past block j - 1: its stage is free.
                if (j >= 1) & (j - 1 + stages < n_blocks):
                    issue(KV, ks, masks, bars, rows, bb, bg, j - 1 + stages)
                    if j + stages < n_blocks:  # lands while this block computes
                        load_rows(Indices, rows, bb, bs, bg, j + stages)
                # The full S, summed in warp order by every warp: the same bits in all four.
                for t in T.unroll(nt):
                    for i in T.unroll(4):
                        e = base + t * 128 + lane * 4 + i
                        sc[t * 4 + i] = (
                            (part[e] + part[e + nt * 128]) + part[e + 2 * nt * 128]
                        ) + part[e + 3 * nt * 128]
                for r in T.unroll(2):
                    mx[r] = -T.infinity(f32)
                for w in T.unroll(mw):  # the block's validity bits: the warps' words ORed
                    mword[w] = 0
                    for v in T.unroll(WARPS):
                        mword[w] = mword[w] | T.cast(masks[s, v, w], "int32")
                for t in T.unroll(nt):
                    for i in T.unroll(4):
                        bit = (mword[t // 4] >> ((t % 4) * 8 + (lane % 4) * 2 + i % 2)) & 1
                        sc[t * 4 + i] = T.if_then_else(
                            bit == 1, sc[t * 4 + i] * scale2, -T.infinity(f32)
                        )
                        mx[i // 2] = T.max(mx[i // 2], sc[t * 4 + i])
                for r in T.unroll(2):
                    mx[r] = T.max(mx[r], T.shfl_xor(mx[r], 1))
                    mx[r] = T.max(mx[r], T.shfl_xor(mx[r], 2))
                    mx[r] = T.max(m_run[r], mx[r])  # the new running max
                    alpha[r] = T.exp2(m_run[r] - mx[r])
                    m_run[r] = mx[r]
                    tot[r] = 0
                for t in T.unroll(nt):
                    for i in T.unroll(4):
                        sc[t * 4 + i] = T.exp2(sc[t * 4 + i] - m_run[i // 2])
                        tot[i // 2] += sc[t * 4 + i]
                for r in T.unroll(2):
                    tot[r] += T.shfl_xor(tot[r], 1)
                    tot[r] += T.shfl_xor(tot[r], 2)
                    l_run[r] = l_run[r] * alpha[r] + tot[r]
                for t in T.unroll(vt):
                    for i in T.unroll(4):
                        o[t * 4 + i] *= alpha[i // 2]
                for k in T.unroll(kt):
                    for i in T.unroll(4):
                        # a0: row g, keys 2q..; a1: row g + 8; a2, a3: the keys 8 further on.
                        c = (2 * k + i // 2) * 4 + (i % 2) * 2
                        pa[i] = T.call_extern("uint32", "dsa_pack_bf16", sc[c], sc[c + 1])
                    key = k * 16 + lane % 8 + ((lane // 8) % 2) * 8
                    for t in T.unroll(vt // 2):
                        col = warp * cols_w + t * 16 + (lane // 16) * 8
                        T.call_extern(
                            "handle",
                            "dsa_mma_pair<true>",
                            T.address_of(ks[stage0 + key * pitch + col]),
                            T.address_of(o[8 * t]),
                            T.address_of(pa[0]),
                        )

            for r in T.unroll(2):
                h = lane // 4 + 8 * r
                if h < hg:
                    has_key = l_run[r] > 0
                    lse2[0] = T.if_then_else(has_key, T.log2(l_run[r]) + m_run[r], -T.infinity(f32))
                    if has_sink:
                        sink2 = Sink[bg * hg + h] * LOG2E
                        alpha[r] = T.if_then_else(
                            has_key, 1 / (l_run[r] + T.exp2(sink2 - m_run[r])), 0
                        )
                        top = T.max(lse2[0], sink2)
                        lse2[0] = top + T.log2(T.exp2(lse2[0] - top) + T.exp2(sink2 - top))
                    else:
                        alpha[r] = T.if_then_else(has_key, 1 / l_run[r], 0)
                    for t in T.unroll(vt):
                        for v in T.vectorized(2):
                            Out[bb, bs, bg * hg + h, warp * cols_w + t * 8 + (lane % 4) * 2 + v] = (
                                o[t * 4 + 2 * r + v] * alpha[r]
                            )
                    if (warp == 0) & (lane % 4 == 0):
                        Lse[bb, bs, bg * hg + h] = lse2[0]

    return few_head_fwd


@functools.cache
def compile_few_head_forward(
    heads: int, groups: int, dim: int, d_v: int, has_sink: bool, block: int, stages: int, arch: str
) -> tilelang.JITKernel:
    """The compiled kernel of :func:`build` for ``{"kind": "cuda", "arch": arch}`` (safe from
    several threads: the library's build lock)."""
    return compile_kernel(
        lambda: build(heads, groups, dim, d_v, has_sink, block, stages),
        target={"kind": "cuda", "arch": arch},
        pass_configs=PASS_CONFIGS,
    )


def few_head_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    *,
    block: int,
    stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out bf16 [B, S, H, d_v], lse2 fp32 [B, S, H])`` (log2 units) for the library forward's
    arguments (q ``[B, S, H, D]``, kv ``[B, S_kv, G, D]``, indices int32 ``[B, S, G, topk]``,
    sink fp32 ``[H]`` or None); S_kv >= 1."""
    b, s, h, d = q.shape
    q, kv = q.contiguous(), kv.contiguous()
    if q.data_ptr() % 16 or kv.data_ptr() % 16:
        raise ValueError("q and kv must start 16-byte aligned (uint4 loads, bulk copies)")
    kernel = compile_few_head_forward(
        h, kv.shape[2], d, d_v, sink is not None, block, stages, "sm_90a"
    )
    out = torch.empty(b, s, h, d_v, dtype=q.dtype, device=q.device)
    lse2 = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    sink_arg = sink.contiguous() if sink is not None else lse2.new_empty(h)
    kernel(q, kv, indices.contiguous(), sink_arg, out, lse2, sm_scale)
    return out, lse2
