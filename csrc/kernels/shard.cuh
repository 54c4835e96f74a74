// Torch-free launchers of the sequence sharding permutations (compile alone with `nvcc -c`).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace ndp {
namespace kernels {

// Contiguous tensors viewed as rows of `inner` elements of elem_size bytes (row maps in ndp_math.h):
//   gather  (shard_gather): src = full [outer, seqlen] rows, dst = local [outer, seqlen / world_size] rows
//   unshard:                src = stacked shards [world_size, outer, seqlen / world_size] rows,
//                           dst = full [outer, seqlen] rows
struct ShardCopyArgs {
  void* dst;
  const void* src;
  int64_t elem_size;  // bytes
  int64_t outer, inner;
  int64_t seqlen, world_size, rank;  // rank is ignored by unshard
  int layout;                         // ndp::Layout
};

cudaError_t launch_shard_gather(const ShardCopyArgs& args, cudaStream_t stream);
cudaError_t launch_unshard(const ShardCopyArgs& args, cudaStream_t stream);

}  // namespace kernels
}  // namespace ndp
