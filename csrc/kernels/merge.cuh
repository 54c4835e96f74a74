// Torch-free launcher of the LSE merge kernel (compiles alone with `nvcc -c`; used by ../ops_cuda.cu).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../ndp_math.h"

namespace ndp {
namespace kernels {

// Element type of block_out.
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// In-place merge of one block's partial attention state into fp32 accumulators (geometry and strides in
// ndp::MergeGeometry): out_acc fp32, lse_acc fp32, block_out of dtype blk_dtype, block_lse fp32.
struct MergeArgs {
  float* out_acc;
  float* lse_acc;
  const void* blk_out;
  const float* blk_lse;
  int blk_dtype;
  MergeGeometry g;
};

// Enqueues the merge on `stream`; returns the launch error (cudaSuccess if none).
cudaError_t launch_merge_attn_states(const MergeArgs& args, cudaStream_t stream);

}  // namespace kernels
}  // namespace ndp
