// CUDA implementations of torch.ops.ndp.* (compiled only when torch is a CUDA build and nvcc is present).
//
// This translation unit holds no device code of its own: it validates with the checks shared with the CPU
// ops (ops.h) and calls the torch-free launchers in kernels/*.cu, whose per-element math is ndp_math.h.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/merge.cuh"
#include "kernels/shard.cuh"
#include "ndp_math.h"
#include "ops.h"

namespace ndp {
namespace {

void merge_attn_states_cuda(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& block_out,
                            const at::Tensor& block_lse) {
  const MergeGeometry g = check_merge_args(out_acc, lse_acc, block_out, block_lse);
  TORCH_CHECK_VALUE(out_acc.is_cuda(), "merge_attn_states_: CUDA kernel got tensors on ", out_acc.device());
  const c10::cuda::CUDAGuard guard(out_acc.device());
  kernels::MergeArgs a;
  a.out_acc = out_acc.data_ptr<float>();
  a.lse_acc = lse_acc.data_ptr<float>();
  a.blk_out = block_out.const_data_ptr();
  a.blk_lse = block_lse.const_data_ptr<float>();
  switch (block_out.scalar_type()) {
    case at::kFloat: a.blk_dtype = kernels::kFloat32; break;
    case at::kHalf: a.blk_dtype = kernels::kFloat16; break;
    default: a.blk_dtype = kernels::kBFloat16; break;
  }
  a.g = g;
  C10_CUDA_CHECK(kernels::launch_merge_attn_states(a, c10::cuda::getCurrentCUDAStream()));
}

kernels::ShardCopyArgs copy_args(const ShardCopy& c) {
  kernels::ShardCopyArgs a;
  a.dst = c.dst.data_ptr();
  a.src = c.src.const_data_ptr();
  a.elem_size = c.src.element_size();
  a.outer = c.outer;
  a.inner = c.inner;
  a.seqlen = c.seqlen;
  a.world_size = c.world_size;
  a.rank = c.rank;
  a.layout = c.layout;
  return a;
}

at::Tensor shard_gather_cuda(const at::Tensor& x, int64_t dim, int64_t world_size, int64_t rank,
                             c10::string_view layout) {
  TORCH_CHECK_VALUE(x.is_cuda(), "shard_gather: CUDA kernel got a tensor on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const ShardCopy c = prepare_shard_gather(x, dim, world_size, rank, layout);
  C10_CUDA_CHECK(kernels::launch_shard_gather(copy_args(c), c10::cuda::getCurrentCUDAStream()));
  return c.dst;
}

at::Tensor unshard_cuda(const at::Tensor& chunks, int64_t dim, int64_t world_size, c10::string_view layout) {
  TORCH_CHECK_VALUE(chunks.is_cuda(), "unshard: CUDA kernel got a tensor on ", chunks.device());
  const c10::cuda::CUDAGuard guard(chunks.device());
  const ShardCopy c = prepare_unshard(chunks, dim, world_size, layout);
  C10_CUDA_CHECK(kernels::launch_unshard(copy_args(c), c10::cuda::getCurrentCUDAStream()));
  return c.dst;
}

// The plan is a few hundred integers computed by a sequential greedy: it runs on the host (one small
// device-to-host copy of cu_seqlens) and the plan is returned on the device of cu_seqlens.
at::Tensor packed_shard_plan_cuda(const at::Tensor& cu_seqlens, int64_t world_size, int64_t min_piece) {
  return packed_shard_plan_cpu(cu_seqlens.cpu(), world_size, min_piece).to(cu_seqlens.device());
}

}  // namespace
}  // namespace ndp

TORCH_LIBRARY_IMPL(ndp, CUDA, m) {
  m.impl("merge_attn_states_", &ndp::merge_attn_states_cuda);
  m.impl("shard_gather", &ndp::shard_gather_cuda);
  m.impl("unshard", &ndp::unshard_cuda);
  m.impl("packed_shard_plan", &ndp::packed_shard_plan_cuda);
}
