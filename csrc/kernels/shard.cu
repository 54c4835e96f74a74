// Sequence sharding permutations: copy whole rows between the full sequence and a rank's shard.
//
// Which source row feeds each destination row is ndp_math.h's gather_src_row / unshard_src_row, the same
// functions the CPU ops run. Rows are copied in the widest word (16, 8, 4, 2 or 1 bytes) that divides the
// row size and both base addresses; one thread per word.
#include "../ndp_math.h"
#include "shard.cuh"

namespace ndp {
namespace kernels {
namespace {

struct alignas(16) Word16 {
  uint4 v;
};

template <typename W, bool kGather>
__global__ void shard_copy_kernel(W* dst, const W* src, int64_t outer, int64_t row_words, int64_t seqlen,
                                  int64_t world_size, int64_t rank, int layout) {
  const int64_t dst_rows = outer * (kGather ? shard_local_len(seqlen, world_size) : seqlen);
  const int64_t total = dst_rows * row_words;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t dst_row = idx / row_words;
    const int64_t w = idx - dst_row * row_words;
    const int64_t src_row = kGather ? gather_src_row(dst_row, seqlen, world_size, rank, layout)
                                    : unshard_src_row(dst_row, outer, seqlen, world_size, layout);
    dst[idx] = src[src_row * row_words + w];
  }
}

template <bool kGather>
cudaError_t launch_copy(const ShardCopyArgs& a, cudaStream_t stream) {
  const int64_t row_bytes = a.inner * a.elem_size;
  const int64_t dst_rows = a.outer * (kGather ? shard_local_len(a.seqlen, a.world_size) : a.seqlen);
  if (dst_rows == 0 || row_bytes == 0) return cudaSuccess;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(a.dst) | reinterpret_cast<uintptr_t>(a.src);
  int64_t word = 16;
  while (word > 1 && (row_bytes % word != 0 || addr % word != 0)) word /= 2;
  const int64_t row_words = row_bytes / word;
  const int64_t total = dst_rows * row_words;
  const int threads = 256;
  const int64_t want = (total + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(want < (1 << 20) ? want : (1 << 20));  // grid-stride beyond
#define NDP_SHARD_LAUNCH(W)                                                                             \
  shard_copy_kernel<W, kGather><<<grid, threads, 0, stream>>>(static_cast<W*>(a.dst),                  \
                                                             static_cast<const W*>(a.src), a.outer,     \
                                                             row_words, a.seqlen, a.world_size, a.rank, \
                                                             a.layout)
  switch (word) {
    case 16: NDP_SHARD_LAUNCH(Word16); break;
    case 8: NDP_SHARD_LAUNCH(uint64_t); break;
    case 4: NDP_SHARD_LAUNCH(uint32_t); break;
    case 2: NDP_SHARD_LAUNCH(uint16_t); break;
    default: NDP_SHARD_LAUNCH(uint8_t); break;
  }
#undef NDP_SHARD_LAUNCH
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_shard_gather(const ShardCopyArgs& a, cudaStream_t stream) { return launch_copy<true>(a, stream); }
cudaError_t launch_unshard(const ShardCopyArgs& a, cudaStream_t stream) { return launch_copy<false>(a, stream); }

}  // namespace kernels
}  // namespace ndp
