// A scratch sparse-attention forward for few heads (sm_90a), for dsa_bench.small_head_forward:
// how fast a forward can be whose K/V gather goes through the copy engine (one 1-D
// cp.async.bulk per selected row, the 9 TB/s of gather_copy.cu) instead of 16-byte cp.async.
// Not a library kernel: it answers whether the design is worth building in TileLang.
//
// One program (4 warps) per query; the query's heads (<= 16, one kv group, no sink) are the M
// side of m16n8k16 mma.sync, padded to 16 rows. Rows land contiguously in shared memory at a
// pitch of D + 8 elements (an odd multiple of 16 bytes, so ldmatrix's 8 row addresses hit 8
// different bank groups), which ldmatrix reads directly (wgmma could not: its descriptors need
// 8-row core matrices or a swizzle).
//
// Per block of BK keys: each warp computes S over a quarter of the D columns (its Q fragments
// stay in registers) for all BK keys, the four partial S meet in shared memory and every warp
// sums them in the same order (so all warps hold the same bits of S, m and P), runs the online
// softmax and accumulates O for its quarter of the 512 value columns with P from registers and
// V through ldmatrix.trans. Warp 0 refills a stage once every warp has passed the barrier after
// the next block's partial S (so every warp is done with the stage). Invalid rows (index < 0 or
// >= s_kv, or past topk) are not copied; the stages are zeroed first, so what they hold is finite
// and its probability is exactly 0.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int HB = 16;    // M rows: the query's heads, padded
constexpr int WARPS = 4;  // threads 128
constexpr int DV = 512;   // value columns

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <int D, int BK>
constexpr int smem_bytes(int nst) {
  return (HB + nst * BK) * (D + 8) * 2 + 2 * WARPS * HB * BK * 4;
}

template <int D, int BK, int NST>
__global__ void __launch_bounds__(128) small_head_forward_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ idx,
    __nv_bfloat16* __restrict__ out, float* __restrict__ lse, int heads, int s_kv, int topk, float scale_log2) {
  constexpr int PITCH = D + 8;  // elements
  constexpr int ROW_BYTES = D * 2;
  constexpr int KS = D / 16 / WARPS;  // S k-steps per warp
  constexpr int NT = BK / 8;          // S n-tiles (8 keys each)
  constexpr int KT = BK / 16;         // P V k-steps
  constexpr int VT = DV / WARPS / 8;  // P V n-tiles per warp
  constexpr int MW = (BK + 31) / 32;  // mask words per block
  static_assert(D % (16 * WARPS) == 0 && BK % 16 == 0 && BK <= 64, "tiling");
  extern __shared__ __align__(128) uint8_t smem_raw[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* ks = qs + HB * PITCH;
  float* sp = reinterpret_cast<float*>(ks + NST * BK * PITCH);  // [2][WARPS][NT * 32 lanes * 4]
  __shared__ __align__(8) uint64_t bars[NST];
  __shared__ uint32_t masks[NST][MW];

  const int query = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* row_idx = idx + static_cast<int64_t>(query) * topk;
  const int blocks = (topk + BK - 1) / BK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  {
    uint4* z = reinterpret_cast<uint4*>(smem_raw);
    const int n = (HB + NST * BK) * PITCH / 8;
    for (int i = threadIdx.x; i < n; i += 128) z[i] = make_uint4(0, 0, 0, 0);
    // The copy engine writes these bytes next (a different proxy).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * (D / 8); i += 128) {
    const int h = i / (D / 8), c = i % (D / 8);
    *reinterpret_cast<uint4*>(qs + h * PITCH + c * 8) =
        *reinterpret_cast<const uint4*>(q + (static_cast<int64_t>(query) * heads + h) * D + c * 8);
  }
  __syncthreads();

  // Warp 0 loads a block's indices (lane l: slots l, l + 32, ...; -1 where invalid) one block
  // before it issues the copies, so the index loads are not on the path between two barriers.
  auto load_rows = [&](int j, int (&rows)[MW]) {
#pragma unroll
    for (int w = 0; w < MW; ++w) {
      const int k = w * 32 + lane, col = j * BK + k;
      const int r = (k < BK && col < topk) ? __ldg(row_idx + col) : -1;
      rows[w] = (r >= 0 && r < s_kv) ? r : -1;
    }
  };
  auto issue = [&](int j, const int (&rows)[MW]) {  // warp 0: block j into stage j % NST
    const int s = j % NST;
    const uint32_t bar = smem_addr(&bars[s]);
    uint32_t words[MW];
    int valid = 0;
#pragma unroll
    for (int w = 0; w < MW; ++w) {
      words[w] = __ballot_sync(0xffffffffu, rows[w] >= 0);
      valid += __popc(words[w]);
    }
    // The stage was last read through the generic proxy (ldmatrix); the copy engine writes it next.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (lane == 0) {
#pragma unroll
      for (int w = 0; w < MW; ++w) masks[s][w] = words[w];
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(valid * ROW_BYTES) : "memory");
    }
    __syncwarp();
    __nv_bfloat16* stage = ks + s * BK * PITCH;
#pragma unroll
    for (int w = 0; w < MW; ++w) {
      if (rows[w] >= 0) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_addr(stage + (w * 32 + lane) * PITCH)),
            "l"(kv + static_cast<int64_t>(rows[w]) * D), "r"(ROW_BYTES), "r"(bar)
            : "memory");
      }
    }
  };

  int next_rows[MW];  // warp 0: the indices of the next block to issue, block NST - 1 + j at step j
  if (warp == 0) {
    for (int j = 0; j < NST && j < blocks; ++j) {
      load_rows(j, next_rows);
      issue(j, next_rows);
    }
    if (NST < blocks) load_rows(NST, next_rows);
  }

  uint32_t qa[KS][4];
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const int col = (warp * KS + k) * 16 + (lane / 16) * 8;
    ldsm_x4(smem_addr(qs + (lane % 16) * PITCH + col), qa[k]);
  }

  float o[VT][4];
#pragma unroll
  for (int t = 0; t < VT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-1e30f, -1e30f}, l_run[2] = {0.f, 0.f};

  for (int j = 0; j < blocks; ++j) {
    const int s = j % NST;
    {
      const uint32_t bar = smem_addr(&bars[s]);
      uint32_t done = 0;
      while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"((j / NST) & 1)
            : "memory");
      }
    }
    const __nv_bfloat16* stage = ks + s * BK * PITCH;
    float sc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      const int col = (warp * KS + k) * 16 + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int t = 0; t < NT; t += 2) {
        uint32_t b[4];
        ldsm_x4(smem_addr(stage + (t * 8 + (lane / 16) * 8 + lane % 8) * PITCH + col), b);
        mma(sc[t], qa[k], b[0], b[1]);
        mma(sc[t + 1], qa[k], b[2], b[3]);
      }
    }
    float4* part = reinterpret_cast<float4*>(sp) + (j & 1) * WARPS * NT * 32;
#pragma unroll
    for (int t = 0; t < NT; ++t) part[(warp * NT + t) * 32 + lane] = make_float4(sc[t][0], sc[t][1], sc[t][2], sc[t][3]);
    asm volatile("bar.sync 1, 128;" ::: "memory");
    // Every warp is past block j - 1: its stage is free.
    if (warp == 0 && j >= 1 && j - 1 + NST < blocks) {
      issue(j - 1 + NST, next_rows);
      if (j + NST < blocks) load_rows(j + NST, next_rows);  // lands while this block computes
    }
    // The full S, summed in warp order by every warp: the same bits everywhere.
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float4 acc = part[t * 32 + lane];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) {
        const float4 v = part[(w * NT + t) * 32 + lane];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      sc[t][0] = acc.x;
      sc[t][1] = acc.y;
      sc[t][2] = acc.z;
      sc[t][3] = acc.w;
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = t * 8 + (lane % 4) * 2 + (i & 1);
        const bool ok = (masks[s][key / 32] >> (key % 32)) & 1u;
        sc[t][i] = ok ? sc[t][i] * scale_log2 : -INFINITY;
        mx[i / 2] = fmaxf(mx[i / 2], sc[t][i]);
      }
    }
    float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m_run[r], mx[r]);
      alpha[r] = exp2f(m_run[r] - m_new);
      m_run[r] = m_new;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sc[t][i] = exp2f(sc[t][i] - m_run[i / 2]);
        sum[i / 2] += sc[t][i];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      l_run[r] = l_run[r] * alpha[r] + sum[r];
    }
#pragma unroll
    for (int t = 0; t < VT; ++t) {
      o[t][0] *= alpha[0];
      o[t][1] *= alpha[0];
      o[t][2] *= alpha[1];
      o[t][3] *= alpha[1];
    }
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      const uint32_t pa[4] = {pack_bf16(sc[2 * k][0], sc[2 * k][1]), pack_bf16(sc[2 * k][2], sc[2 * k][3]),
                              pack_bf16(sc[2 * k + 1][0], sc[2 * k + 1][1]),
                              pack_bf16(sc[2 * k + 1][2], sc[2 * k + 1][3])};
      const int key = k * 16 + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int t = 0; t < VT; t += 2) {
        uint32_t b[4];
        const int col = warp * (DV / WARPS) + t * 8 + (lane / 16) * 8;
        ldsm_x4_trans(smem_addr(stage + key * PITCH + col), b);
        mma(o[t], pa, b[0], b[1]);
        mma(o[t + 1], pa, b[2], b[3]);
      }
    }
  }

  const int g = lane / 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    if (h >= heads) continue;
    const float inv = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
    __nv_bfloat16* dst = out + (static_cast<int64_t>(query) * heads + h) * DV + warp * (DV / WARPS) + (lane % 4) * 2;
#pragma unroll
    for (int t = 0; t < VT; ++t)
      *reinterpret_cast<uint32_t*>(dst + t * 8) = pack_bf16(o[t][2 * r] * inv, o[t][2 * r + 1] * inv);
    if (warp == 0 && lane % 4 == 0)
      lse[static_cast<int64_t>(query) * heads + h] =
          l_run[r] > 0.f ? (m_run[r] + log2f(l_run[r])) * 0.6931471805599453f : -INFINITY;
  }
}

template <int D, int BK, int NST>
int launch(const void* q, const void* kv, const void* idx, void* out, void* lse, int s, int heads, int s_kv,
           int topk, float scale_log2, cudaStream_t stream) {
  auto kernel = small_head_forward_kernel<D, BK, NST>;
  const int smem = smem_bytes<D, BK>(NST);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 2;
  kernel<<<s, 128, smem, stream>>>(static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(kv),
                                   static_cast<const int*>(idx), static_cast<__nv_bfloat16*>(out),
                                   static_cast<float*>(lse), heads, s_kv, topk, scale_log2);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

}  // namespace

// q: bf16 [s, heads, dim], kv: bf16 [s_kv, dim], idx: int32 [s, topk], out: bf16 [s, heads, 512],
// lse: fp32 [s, heads] (natural log). heads 1..16, dim 512 or 576. Returns 0, or 1: no such
// (dim, block, stages); 2: the shared memory does not fit; 3: launch error.
extern "C" int small_head_forward(int dim, int block, int stages, const void* q, const void* kv, const void* idx,
                                  void* out, void* lse, int s, int heads, int s_kv, int topk, float scale_log2,
                                  void* stream) {
  if (heads < 1 || heads > HB) return 1;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define DSA_CASE(DD, BB, NN)                   \
  if (dim == DD && block == BB && stages == NN) \
    return launch<DD, BB, NN>(q, kv, idx, out, lse, s, heads, s_kv, topk, scale_log2, st);
#define DSA_DIM(DD) \
  DSA_CASE(DD, 16, 2) DSA_CASE(DD, 16, 3) DSA_CASE(DD, 16, 4) DSA_CASE(DD, 32, 2) DSA_CASE(DD, 32, 3) DSA_CASE(DD, 64, 2)
  DSA_DIM(512) DSA_DIM(576)
#undef DSA_DIM
#undef DSA_CASE
  return 1;
}
