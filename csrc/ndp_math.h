// Per-element math shared by the CPU (.cpp) and CUDA (.cu) implementations of the ndp ops.
//
// Everything here is a __host__ __device__ function of plain scalars: the CPU ops call it in their loops
// and the CUDA kernels call it per thread, so the math that runs on GPUs is exactly the math the CPU
// tests check. This header must stay free of torch and of the CUDA runtime API.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define NDP_HD __host__ __device__ __forceinline__
#else
#define NDP_HD inline
#endif

namespace ndp {

// Sequence layouts of the context-parallel sharding (docs/design.md "Layouts").
enum Layout : int {
  kContiguous = 0,  // rank r holds chunk r of N
  kZigzag = 1,      // 2N chunks; rank r holds chunk r then chunk 2N-1-r
  kStriped = 2,     // rank r holds tokens r, r+N, r+2N, ...
};

// ---------------------------------------------------------------------------------------------
// Merge of partial attention states by log-sum-exp.
//
//   lse_new = logaddexp(lse_acc, lse_blk)
//   out_new = out_acc * exp(lse_acc - lse_new) + out_blk * exp(lse_blk - lse_new)
//
// Computed relative to m = max(lse_acc, lse_blk) so no exp overflows: the larger side has weight
// 1 / (1 + e) and the smaller e / (1 + e) with e = exp(min - m) in [0, 1]; lse_new = m + log1p(e).
// Both -inf (no key seen by either part): weights (1, 0) and lse stays -inf, i.e. the accumulator is
// unchanged, never NaN (a naive formula gives exp(-inf - -inf) = exp(nan)).
struct MergeWeights {
  float w_acc;  // weight of the running accumulator
  float w_blk;  // weight of the block result
  float lse;    // merged log-sum-exp
};

NDP_HD MergeWeights merge_weights(float lse_acc, float lse_blk) {
  MergeWeights r;
  const float m = fmaxf(lse_acc, lse_blk);
  if (m == -INFINITY) {
    r.w_acc = 1.0f;
    r.w_blk = 0.0f;
    r.lse = -INFINITY;
    return r;
  }
  const bool acc_is_max = lse_acc >= lse_blk;
  const float lo = acc_is_max ? lse_blk : lse_acc;
  const float e = expf(lo - m);  // exp(-inf) = 0 when the smaller side is empty
  const float inv = 1.0f / (1.0f + e);
  r.w_acc = acc_is_max ? inv : e * inv;
  r.w_blk = acc_is_max ? e * inv : inv;
  r.lse = m + log1pf(e);
  return r;
}

// One output element. A side with weight 0 is not read into the sum, so garbage (even inf/NaN) in a row
// that carries no probability mass (lse = -inf) cannot leak into the result.
NDP_HD float merge_value(float acc, float blk, MergeWeights w) {
  const float a = w.w_acc == 0.0f ? 0.0f : acc * w.w_acc;
  const float b = w.w_blk == 0.0f ? 0.0f : blk * w.w_blk;
  return a + b;
}

// Geometry of a merge: out_acc / block_out [B, S, H, D] (head_dim stride 1), lse_acc / block_lse [B, H, S];
// strides in elements. Packed [T, H, D] / [H, T] inputs are B = 1 with batch strides 0.
// (batch, seq, head) strides of one tensor of a merge, in elements.
struct RowStrides {
  int64_t b, s, h;
};

NDP_HD int64_t row_offset(const RowStrides& st, int64_t b, int64_t s, int64_t h) {
  return b * st.b + s * st.s + h * st.h;
}

struct MergeGeometry {
  int64_t B, S, H, D;
  RowStrides out, lse, blk_out, blk_lse;  // out_acc, lse_acc, block_out, block_lse
};

// Element offsets of row `row` (= (b * S + s) * H + h) in the four tensors of a merge.
struct MergeRowOffsets {
  int64_t out, lse, blk_out, blk_lse;
};

NDP_HD MergeRowOffsets merge_row_offsets(const MergeGeometry& g, int64_t row) {
  const int64_t h = row % g.H;
  const int64_t s = (row / g.H) % g.S;
  const int64_t b = row / (g.H * g.S);
  MergeRowOffsets r;
  r.out = row_offset(g.out, b, s, h);
  r.lse = row_offset(g.lse, b, s, h);
  r.blk_out = row_offset(g.blk_out, b, s, h);
  r.blk_lse = row_offset(g.blk_lse, b, s, h);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Sequence sharding position maps. seqlen must be divisible by world_size (zigzag: by 2*world_size);
// the ops check that before calling these.

// Number of tokens each rank holds.
NDP_HD int64_t shard_local_len(int64_t seqlen, int64_t world_size) { return seqlen / world_size; }

// Global position of local token `i` of rank `rank`.
NDP_HD int64_t shard_global_pos(int64_t i, int64_t seqlen, int64_t world_size, int64_t rank, int layout) {
  if (layout == kZigzag) {
    const int64_t c = seqlen / (2 * world_size);  // chunk length
    return i < c ? rank * c + i : (2 * world_size - 1 - rank) * c + (i - c);
  }
  if (layout == kStriped) return i * world_size + rank;
  return rank * (seqlen / world_size) + i;  // kContiguous
}

// Inverse map: the rank that holds global position `g` and the token's local position there.
NDP_HD void shard_owner(int64_t g, int64_t seqlen, int64_t world_size, int layout, int64_t* rank,
                        int64_t* local) {
  if (layout == kZigzag) {
    const int64_t c = seqlen / (2 * world_size);
    const int64_t chunk = g / c;
    const int64_t off = g - chunk * c;
    if (chunk < world_size) {
      *rank = chunk;
      *local = off;
    } else {
      *rank = 2 * world_size - 1 - chunk;
      *local = c + off;
    }
    return;
  }
  if (layout == kStriped) {
    *rank = g % world_size;
    *local = g / world_size;
    return;
  }
  const int64_t l = seqlen / world_size;  // kContiguous
  *rank = g / l;
  *local = g - *rank * l;
}

// Row maps of the shard copies. Contiguous tensors are viewed as rows of `inner` elements; a copy writes
// every destination row once, from the source row these functions return.
//
// shard_gather: src = full [outer, seqlen] rows, dst = local [outer, seqlen / world_size] rows.
NDP_HD int64_t gather_src_row(int64_t dst_row, int64_t seqlen, int64_t world_size, int64_t rank, int layout) {
  const int64_t local_len = seqlen / world_size;
  const int64_t o = dst_row / local_len;
  const int64_t i = dst_row - o * local_len;
  return o * seqlen + shard_global_pos(i, seqlen, world_size, rank, layout);
}

// unshard: src = stacked shards [world_size, outer, seqlen / world_size] rows, dst = full [outer, seqlen] rows.
NDP_HD int64_t unshard_src_row(int64_t dst_row, int64_t outer, int64_t seqlen, int64_t world_size, int layout) {
  const int64_t o = dst_row / seqlen;
  const int64_t g = dst_row - o * seqlen;
  int64_t rank, local;
  shard_owner(g, seqlen, world_size, layout, &rank, &local);
  return (rank * outer + o) * (seqlen / world_size) + local;
}

// ---------------------------------------------------------------------------------------------
// Packed-document planning: causal attention work of a piece [offset, offset + len) of one document,
// i.e. the number of (query, key) pairs it adds: sum over its tokens t of (t + 1).
NDP_HD int64_t causal_piece_work(int64_t offset, int64_t len) { return len * offset + len * (len + 1) / 2; }

// Start offset (within its document) of piece `i` when a document of length `len` is cut in `npieces`
// nearly equal pieces (lengths differ by at most one; piece i spans [start(i), start(i + 1))).
NDP_HD int64_t even_piece_start(int64_t i, int64_t len, int64_t npieces) { return (i * len) / npieces; }

}  // namespace ndp
