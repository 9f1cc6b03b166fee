// The gather floor with Hopper's copy engine (sm_90a), for dsa_bench.gather_floor: each program
// (one warp, one query) gathers its selected kv rows into a ring of NST shared-memory stages of
// R rows, completing on one mbarrier per stage, and reads back one value per row so that the
// output checks where each row landed. Two ways to issue the copies:
//
//   bulk:   one 1-D cp.async.bulk per row (the whole row, contiguous in shared memory);
//   tensor: 2-D cp.async.bulk.tensor copies of 1 row x 64 columns (128 B) with the 128-byte
//           swizzle, dim / 64 per row: the layout a wgmma reads its K-major operands in, which
//           a 1-D copy cannot produce.
//
// Rows outside [0, s_kv) are not copied (the stage's expected bytes count only valid rows).
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int R, int NST, bool TENSOR>
__global__ void __launch_bounds__(32)
    gather_kernel(const __grid_constant__ CUtensorMap map, const uint8_t* __restrict__ kv,
                  const int* __restrict__ idx, float* __restrict__ out, int s_kv, int topk, int dim) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes of shared-memory address: align the stages.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ __align__(8) uint64_t bars[NST];
  const int lane = threadIdx.x;
  const int row_bytes = dim * 2;
  const int chunks = dim / 64;  // tensor copies per row
  const int stage_bytes = R * row_bytes;
  const int* row_idx = idx + static_cast<int64_t>(blockIdx.x) * topk;
  if (lane == 0) {
    for (int s = 0; s < NST; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  auto selected = [&](int t) {  // this lane's row of tile t, or -1
    const int j = t * R + lane;
    const int r = (lane < R && j < topk) ? __ldg(row_idx + j) : -1;
    return (r >= 0 && r < s_kv) ? r : -1;
  };
  auto issue = [&](int t) {
    const int s = t % NST;
    const int r = selected(t);
    const uint32_t bar = smem_addr(&bars[s]);
    const unsigned valid = __ballot_sync(0xffffffffu, r >= 0);
    // The stage was read through the generic proxy; the copy engine writes it next.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (lane == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(__popc(valid) * row_bytes)
                   : "memory");
    }
    __syncwarp();
    if (r < 0) return;
    uint8_t* stage = smem + static_cast<size_t>(s) * stage_bytes;
    if (TENSOR) {  // chunk c of every row of the stage: an [R, 64] column block, rows 128 B apart
      for (int c = 0; c < chunks; ++c) {
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_addr(stage + (c * R + lane) * 128)),
            "l"(&map), "r"(c * 64), "r"(r), "r"(bar)
            : "memory");
      }
    } else {
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       smem_addr(stage + lane * row_bytes)),
                   "l"(kv + static_cast<int64_t>(r) * row_bytes), "r"(row_bytes), "r"(bar)
                   : "memory");
    }
  };
  const int tiles = (topk + R - 1) / R;
  for (int t = 0; t < NST && t < tiles; ++t) issue(t);
  float acc = 0.f;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % NST;
    const uint32_t bar = smem_addr(&bars[s]);
    uint32_t done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done)
                   : "r"(bar), "r"((t / NST) & 1)
                   : "memory");
    }
    if (selected(t) >= 0) {  // column 0 of the row; swizzled, its 16-byte chunk sits at lane % 8
      const uint8_t* stage = smem + static_cast<size_t>(s) * stage_bytes;
      const uint8_t* v = TENSOR ? stage + lane * 128 + (lane % 8) * 16 : stage + lane * row_bytes;
      acc += __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(v)) << 16);
    }
    __syncwarp();
    if (t + NST < tiles) issue(t + NST);
  }
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[blockIdx.x] = acc;
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

template <int R, int NST, bool TENSOR>
int launch(const CUtensorMap& map, const void* kv, const void* idx, void* out, int s, int s_kv, int topk, int dim,
           cudaStream_t stream) {
  auto kernel = gather_kernel<R, NST, TENSOR>;
  const int smem = NST * R * dim * 2 + 1024;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 2;
  kernel<<<s, 32, smem, stream>>>(map, static_cast<const uint8_t*>(kv), static_cast<const int*>(idx),
                                  static_cast<float*>(out), s_kv, topk, dim);
  return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

}  // namespace

// kv: bf16 [s_kv, dim] (dim a multiple of 64), idx: int32 [s, topk], out: fp32 [s]. Returns 0, or
// 1: no such (rows, stages); 2: the shared memory does not fit; 3: launch error; 4: no tensor map.
extern "C" int gather_copy(int tensor, int rows, int stages, void* kv, const void* idx, void* out, int s, int s_kv,
                           int topk, int dim, void* stream) {
  CUtensorMap map = {};
  if (tensor) {
    static EncodeTiled encode = nullptr;
    if (encode == nullptr) {
      cudaDriverEntryPointQueryResult found;
      if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                           cudaEnableDefault, &found) != cudaSuccess ||
          encode == nullptr)
        return 4;
    }
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(s_kv)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(dim) * 2};
    const cuuint32_t box[2] = {64, 1};
    const cuuint32_t steps[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, kv, dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return 4;
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define DSA_CASE(RR, NN)                                                                  \
  if (rows == RR && stages == NN)                                                         \
    return tensor ? launch<RR, NN, true>(map, kv, idx, out, s, s_kv, topk, dim, st)      \
                  : launch<RR, NN, false>(map, kv, idx, out, s, s_kv, topk, dim, st);
  DSA_CASE(8, 2) DSA_CASE(8, 4) DSA_CASE(16, 2) DSA_CASE(16, 4) DSA_CASE(32, 2) DSA_CASE(32, 3)
#undef DSA_CASE
  return 1;
}
