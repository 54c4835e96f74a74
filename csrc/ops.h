// Declarations shared by the CPU (ops.cpp) and CUDA (ops_cuda.cu) implementations of torch.ops.ndp.*:
// input validation (one message per constraint, same on every device) and the host-side packed planner.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "ndp_math.h"

namespace ndp {

// Parses a layout name; TORCH_CHECK with the accepted names otherwise.
int parse_layout(const std::string& layout);

// Checks world_size >= 1, 0 <= rank < world_size (rank < 0 skips the rank check) and the divisibility
// the layout needs; `op` names the calling op in the messages.
void check_shard_args(const char* op, int64_t seqlen, int64_t world_size, int64_t rank, int layout,
                      const std::string& layout_name);

// Wraps a possibly negative dim against `ndim`; TORCH_CHECK when out of range.
int64_t wrap_dim(const char* op, const char* what, int64_t dim, int64_t ndim);

// Validates the merge arguments (dtypes, shapes, devices, last-dim stride) and returns their geometry.
MergeGeometry check_merge_args(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& block_out,
                               const at::Tensor& block_lse);

// A validated shard copy: dst (fresh, contiguous) gets rows of src (contiguous) by the row maps of ndp_math.h
// (gather_src_row / unshard_src_row). Rows are `inner` elements.
struct ShardCopy {
  at::Tensor src, dst;
  int64_t outer, inner, seqlen, world_size, rank;
  int layout;
};
ShardCopy prepare_shard_gather(const at::Tensor& x, int64_t dim, int64_t world_size, int64_t rank,
                               c10::string_view layout);
ShardCopy prepare_unshard(const at::Tensor& chunks, int64_t dim, int64_t world_size, c10::string_view layout);

// Validates cu_seqlens (1-D int32/int64 on CPU, starts at 0, non-decreasing) and plans the pieces.
at::Tensor packed_shard_plan_cpu(const at::Tensor& cu_seqlens, int64_t world_size, int64_t min_piece);

}  // namespace ndp
