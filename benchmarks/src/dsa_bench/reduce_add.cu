// The dKV reduce floor of the sparse-attention backward, for dsa_bench.reduce_floor: each program
// (256 threads, one query) adds one value to every element of the dkv rows its indices select,
// the reduce-adds that the backward does per (query, key) and nothing else. dkv ends up holding,
// in each column, the number of times its row was selected, which the caller checks.
//
//   red:  atomics from registers, VEC values (4 or 8 bytes each) per instruction; LPR lanes of
//         a warp cover one row per instruction, so one instruction touches 32 / LPR rows.
//         VEC = 2, LPR = 4 is the layout of a wgmma accumulator (each thread holds two
//         neighbouring columns of a row): what the TileLang backward's atomic path issues.
//   bulk: one cp.reduce.async.bulk (the TMA engine) per row and column slice, read from a shared
//         buffer: the backward's "tma" path without its staging.
//
// Rows outside [0, s_kv) are not added (as the backward's padding slots).
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T one();
template <>
__device__ __forceinline__ float one<float>() {
  return 1.f;
}
template <>
__device__ __forceinline__ unsigned long long one<unsigned long long>() {
  return 1ull;
}

template <typename T, int VEC>
__device__ __forceinline__ void red_add(T* p) {
  if constexpr (VEC == 4) {
    atomicAdd(reinterpret_cast<float4*>(p), make_float4(1.f, 1.f, 1.f, 1.f));
  } else if constexpr (VEC == 2) {
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(1.f, 1.f));
  } else {
    atomicAdd(p, one<T>());
  }
}

template <typename T, int VEC, int LPR>
__global__ void __launch_bounds__(kThreads)
    red_kernel(T* __restrict__ dkv, const int* __restrict__ idx, int s_kv, int topk, int dim) {
  constexpr int kRows = 32 / LPR;  // rows per warp instruction
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* row_idx = idx + static_cast<int64_t>(blockIdx.x) * topk;
  for (int j0 = warp * kRows; j0 < topk; j0 += kWarps * kRows) {
    const int j = j0 + lane / LPR;
    const int r = j < topk ? __ldg(row_idx + j) : -1;
    if (r < 0 || r >= s_kv) continue;
    T* row = dkv + static_cast<int64_t>(r) * dim;
    for (int c = (lane % LPR) * VEC; c < dim; c += LPR * VEC) red_add<T, VEC>(row + c);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    bulk_kernel(T* __restrict__ dkv, const int* __restrict__ idx, int s_kv, int topk, int dim, int slice) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* ones = reinterpret_cast<T*>(smem_raw);
  for (int c = threadIdx.x; c < dim; c += kThreads) ones[c] = one<T>();
  // Written through the generic proxy, read by the TMA engine (the async proxy).
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(ones));
  const int* row_idx = idx + static_cast<int64_t>(blockIdx.x) * topk;
  for (int j = threadIdx.x; j < topk; j += kThreads) {
    const int r = __ldg(row_idx + j);
    if (r < 0 || r >= s_kv) continue;
    T* row = dkv + static_cast<int64_t>(r) * dim;
    for (int c0 = 0; c0 < dim; c0 += slice) {
      const int bytes = min(slice, dim - c0) * static_cast<int>(sizeof(T));
      if constexpr (sizeof(T) == 8) {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;" ::"l"(row + c0),
                     "r"(src), "r"(bytes)
                     : "memory");
      } else {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(row + c0),
                     "r"(src), "r"(bytes)
                     : "memory");
      }
    }
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  // The shared source must outlive the reads of every reduce-add this thread issued.
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

template <typename T, int VEC, int LPR>
int launch_red(void* dkv, const void* idx, int s, int s_kv, int topk, int dim, cudaStream_t stream) {
  if (dim % VEC) return 2;
  red_kernel<T, VEC, LPR><<<s, kThreads, 0, stream>>>(static_cast<T*>(dkv), static_cast<const int*>(idx), s_kv,
                                                        topk, dim);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <typename T>
int launch_bulk(void* dkv, const void* idx, int s, int s_kv, int topk, int dim, int slice, cudaStream_t stream) {
  // Bulk copies move multiples of 16 bytes between 16-byte aligned addresses.
  if (slice <= 0 || (slice * sizeof(T)) % 16 || (dim * sizeof(T)) % 16) return 2;
  const int smem = dim * static_cast<int>(sizeof(T));
  if (cudaFuncSetAttribute(bulk_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 2;
  bulk_kernel<T><<<s, kThreads, smem, stream>>>(static_cast<T*>(dkv), static_cast<const int*>(idx), s_kv, topk, dim,
                                                slice);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

}  // namespace

// dkv: [s_kv, dim] fp32 (u64 = 0) or uint64 (u64 = 1), added to; idx: int32 [s, topk].
// method 0: red with (vec, lanes_per_row) in {(1, 32), (2, 4), (2, 16), (4, 4), (4, 8)} (fp32) or
// (1, 32), (1, 4) (u64); method 1: bulk in slices of `slice` elements. Returns 0, or 1: no such
// variant; 2: a shape it cannot run; 3: launch error.
extern "C" int reduce_add(int method, int u64, int vec, int lanes_per_row, int slice, void* dkv, const void* idx,
                          int s, int s_kv, int topk, int dim, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (method == 1)
    return u64 ? launch_bulk<unsigned long long>(dkv, idx, s, s_kv, topk, dim, slice, st)
               : launch_bulk<float>(dkv, idx, s, s_kv, topk, dim, slice, st);
#define DSA_RED(TT, VV, LL) \
  if (vec == VV && lanes_per_row == LL) return launch_red<TT, VV, LL>(dkv, idx, s, s_kv, topk, dim, st);
  if (u64) {
    DSA_RED(unsigned long long, 1, 32) DSA_RED(unsigned long long, 1, 4)
  } else {
    DSA_RED(float, 1, 32) DSA_RED(float, 2, 4) DSA_RED(float, 2, 16) DSA_RED(float, 4, 4) DSA_RED(float, 4, 8)
  }
#undef DSA_RED
  return 1;
}
