// LSE merge of partial attention states (the ring-step epilogue run as its own pass).
//
// One warp per (b, s, h) row: every lane reads the two lse values and computes the same merge weights
// (ndp_math.h, shared with the CPU op), the lanes stride over head_dim, and lane 0 writes the merged lse
// after a __syncwarp() so no lane can read an lse that was already overwritten.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "merge.cuh"

namespace ndp {
namespace kernels {
namespace {

constexpr int kRowsPerBlock = 8;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__global__ void merge_attn_states_kernel(MergeArgs a) {
  const int64_t rows = a.g.B * a.g.S * a.g.H;
  const T* blk_out = static_cast<const T*>(a.blk_out);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const MergeRowOffsets off = merge_row_offsets(a.g, row);
    const MergeWeights w = merge_weights(a.lse_acc[off.lse], a.blk_lse[off.blk_lse]);
    __syncwarp();  // all lanes hold the old lse before lane 0 replaces it
    float* out = a.out_acc + off.out;
    const T* blk = blk_out + off.blk_out;
    for (int64_t d = threadIdx.x; d < a.g.D; d += 32) out[d] = merge_value(out[d], to_float(blk[d]), w);
    if (threadIdx.x == 0) a.lse_acc[off.lse] = w.lse;
  }
}

}  // namespace

cudaError_t launch_merge_attn_states(const MergeArgs& a, cudaStream_t stream) {
  const int64_t rows = a.g.B * a.g.S * a.g.H;
  if (rows == 0) return cudaSuccess;
  const int64_t want = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const unsigned grid = static_cast<unsigned>(want < (1 << 20) ? want : (1 << 20));  // grid-stride beyond
  const dim3 block(32, kRowsPerBlock);
  switch (a.blk_dtype) {
    case kFloat32:
      merge_attn_states_kernel<float><<<grid, block, 0, stream>>>(a);
      break;
    case kFloat16:
      merge_attn_states_kernel<__half><<<grid, block, 0, stream>>>(a);
      break;
    case kBFloat16:
      merge_attn_states_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(a);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace ndp
