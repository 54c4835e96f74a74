// torch.ops.ndp.*: schemas, CPU implementations and the Python module object of ndp._C.
//
// The per-element math (merge weights, shard position maps, causal work) comes from ndp_math.h, which the
// CUDA kernels in kernels/*.cu use too. Fake (meta) implementations for torch.compile live in ndp/_ops.py.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "ndp_math.h"
#include "ops.h"

#ifndef NDP_WITH_CUDA
#define NDP_WITH_CUDA 0
#endif

namespace ndp {

// ------------------------------------------------------------------------------------------------
// Validation shared with ops_cuda.cu.

int parse_layout(const std::string& layout) {
  if (layout == "contiguous") return kContiguous;
  if (layout == "zigzag") return kZigzag;
  if (layout == "striped") return kStriped;
  TORCH_CHECK_VALUE(false, "unknown sharding layout '", layout,
                    "'; expected one of 'contiguous', 'zigzag', 'striped'");
  return -1;
}

void check_shard_args(const char* op, int64_t seqlen, int64_t world_size, int64_t rank, int layout,
                      const std::string& layout_name) {
  TORCH_CHECK_VALUE(world_size >= 1, op, ": world_size must be >= 1, got world_size=", world_size);
  TORCH_CHECK_VALUE(rank < 0 || rank < world_size, op, ": rank must be in [0, world_size); got rank=", rank,
                    ", world_size=", world_size);
  TORCH_CHECK_VALUE(seqlen >= 0, op, ": seqlen must be >= 0, got ", seqlen);
  const int64_t mult = layout == kZigzag ? 2 * world_size : world_size;
  if (seqlen % mult != 0) {
    std::ostringstream fix;
    fix << "pad the sequence to a multiple of " << mult;
    if (layout == kZigzag && seqlen % world_size == 0) fix << " or use layout='contiguous'";
    TORCH_CHECK_VALUE(false, op, ": ", layout_name, " sharding needs seqlen divisible by ",
                      layout == kZigzag ? "2*world_size" : "world_size", "; got seqlen=", seqlen,
                      ", world_size=", world_size, "; ", fix.str());
  }
}

int64_t wrap_dim(const char* op, const char* what, int64_t dim, int64_t ndim) {
  TORCH_CHECK_INDEX(dim >= -ndim && dim < ndim, op, ": dim=", dim, " is out of range for ", what, " with ",
                    ndim, " dims; pass a dim in [", -ndim, ", ", ndim - 1, "]");
  return dim < 0 ? dim + ndim : dim;
}

MergeGeometry check_merge_args(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& block_out,
                               const at::Tensor& block_lse) {
  const char* op = "merge_attn_states_";
  TORCH_CHECK_TYPE(out_acc.scalar_type() == at::kFloat, op,
                   ": out_acc must be float32 (accumulators are always fp32), got ", out_acc.scalar_type(),
                   "; allocate it with dtype=torch.float32");
  TORCH_CHECK_TYPE(lse_acc.scalar_type() == at::kFloat, op, ": lse_acc must be float32, got ",
                   lse_acc.scalar_type(), "; allocate it with dtype=torch.float32");
  TORCH_CHECK_TYPE(block_lse.scalar_type() == at::kFloat, op, ": block_lse must be float32, got ",
                   block_lse.scalar_type(), "; pass the kernel's fp32 lse");
  const auto bt = block_out.scalar_type();
  TORCH_CHECK_TYPE(bt == at::kFloat || bt == at::kHalf || bt == at::kBFloat16, op,
                   ": block_out must be float32, float16 or bfloat16, got ", bt, "; cast it with .float()");
  TORCH_CHECK_VALUE(out_acc.dim() == 4 || out_acc.dim() == 3, op,
                    ": out_acc must be [batch, seq, heads, head_dim] or packed [tokens, heads, head_dim], got "
                    "shape ",
                    out_acc.sizes());
  TORCH_CHECK_VALUE(block_out.sizes() == out_acc.sizes(), op, ": block_out shape ", block_out.sizes(),
                    " must equal out_acc shape ", out_acc.sizes());
  const bool packed = out_acc.dim() == 3;
  MergeGeometry g;
  g.B = packed ? 1 : out_acc.size(0);
  g.S = out_acc.size(-3);
  g.H = out_acc.size(-2);
  g.D = out_acc.size(-1);
  std::vector<int64_t> want_lse = packed ? std::vector<int64_t>{g.H, g.S} : std::vector<int64_t>{g.B, g.H, g.S};
  TORCH_CHECK_VALUE(lse_acc.sizes() == at::IntArrayRef(want_lse), op, ": lse_acc must have shape ",
                    at::IntArrayRef(want_lse), " (", packed ? "[heads, tokens]" : "[batch, heads, seq]",
                    ") for out_acc of shape ", out_acc.sizes(), ", got ", lse_acc.sizes());
  TORCH_CHECK_VALUE(block_lse.sizes() == lse_acc.sizes(), op, ": block_lse shape ", block_lse.sizes(),
                    " must equal lse_acc shape ", lse_acc.sizes());
  const auto dev = out_acc.device();
  TORCH_CHECK_VALUE(lse_acc.device() == dev && block_out.device() == dev && block_lse.device() == dev, op,
                    ": all tensors must be on one device; got out_acc on ", dev, ", lse_acc on ", lse_acc.device(),
                    ", block_out on ", block_out.device(), ", block_lse on ", block_lse.device());
  TORCH_CHECK_VALUE(g.D <= 1 || (out_acc.stride(-1) == 1 && block_out.stride(-1) == 1), op,
                    ": out_acc and block_out must have stride 1 in the last dim, got ", out_acc.stride(-1), " and ",
                    block_out.stride(-1), "; call .contiguous()");
  // in place: an expanded accumulator (several elements on one memory location) would race / double-merge
  at::assert_no_internal_overlap(out_acc);
  at::assert_no_internal_overlap(lse_acc);
  // out: [B, S, H, D], lse: [B, H, S]; a packed tensor has no batch dim (stride 0)
  const auto strides = [packed](const at::Tensor& x, int64_t seq_dim, int64_t head_dim) {
    return RowStrides{packed ? 0 : x.stride(0), x.stride(seq_dim), x.stride(head_dim)};
  };
  g.out = strides(out_acc, -3, -2);
  g.blk_out = strides(block_out, -3, -2);
  g.lse = strides(lse_acc, -1, -2);
  g.blk_lse = strides(block_lse, -1, -2);
  return g;
}

namespace {
void outer_inner(const at::Tensor& x, int64_t dim, int64_t* outer, int64_t* inner) {
  *outer = 1;
  *inner = 1;
  for (int64_t i = 0; i < dim; ++i) *outer *= x.size(i);
  for (int64_t i = dim + 1; i < x.dim(); ++i) *inner *= x.size(i);
}
}  // namespace

ShardCopy prepare_shard_gather(const at::Tensor& x, int64_t dim, int64_t world_size, int64_t rank,
                               c10::string_view layout_sv) {
  const std::string layout_name(layout_sv);
  const int layout = parse_layout(layout_name);
  TORCH_CHECK_VALUE(x.dim() >= 1, "shard_gather: x must have at least 1 dim, got a 0-dim tensor");
  dim = wrap_dim("shard_gather", "x", dim, x.dim());
  TORCH_CHECK_VALUE(rank >= 0, "shard_gather: rank must be in [0, world_size); got rank=", rank,
                    ", world_size=", world_size);
  check_shard_args("shard_gather", x.size(dim), world_size, rank, layout, layout_name);
  ShardCopy c;
  c.src = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes[dim] = shard_local_len(x.size(dim), world_size);
  c.dst = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  outer_inner(x, dim, &c.outer, &c.inner);
  c.seqlen = x.size(dim);
  c.world_size = world_size;
  c.rank = rank;
  c.layout = layout;
  return c;
}

ShardCopy prepare_unshard(const at::Tensor& chunks, int64_t dim, int64_t world_size, c10::string_view layout_sv) {
  const std::string layout_name(layout_sv);
  const int layout = parse_layout(layout_name);
  TORCH_CHECK_VALUE(chunks.dim() >= 2, "unshard: chunks must be torch.stack of every rank's shard ([world_size, "
                    "*local_shape]) with at least 2 dims, got shape ", chunks.sizes());
  TORCH_CHECK_VALUE(chunks.size(0) == world_size, "unshard: chunks.size(0) must equal world_size (one shard per "
                    "rank, stacked along a new dim 0); got chunks.size(0)=", chunks.size(0),
                    ", world_size=", world_size);
  dim = wrap_dim("unshard", "the local shard", dim, chunks.dim() - 1);
  const int64_t seqlen = chunks.size(dim + 1) * world_size;
  check_shard_args("unshard", seqlen, world_size, -1, layout, layout_name);
  ShardCopy c;
  c.src = chunks.contiguous();  // [world_size, outer, local_len, inner] rows
  auto sizes = chunks.sizes().slice(1).vec();
  sizes[dim] = seqlen;
  c.dst = at::empty(sizes, chunks.options().memory_format(at::MemoryFormat::Contiguous));
  outer_inner(c.dst, dim, &c.outer, &c.inner);
  c.seqlen = seqlen;
  c.world_size = world_size;
  c.rank = 0;
  c.layout = layout;
  return c;
}

// ------------------------------------------------------------------------------------------------
// CPU implementations.

namespace {

template <typename T>
void merge_rows_cpu(const MergeGeometry& g, float* out_acc, float* lse_acc, const T* blk_out, const float* blk_lse) {
  const int64_t rows = g.B * g.S * g.H;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(g.D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const MergeRowOffsets off = merge_row_offsets(g, row);
      const MergeWeights w = merge_weights(lse_acc[off.lse], blk_lse[off.blk_lse]);
      float* out = out_acc + off.out;
      const T* blk = blk_out + off.blk_out;
      for (int64_t d = 0; d < g.D; ++d) out[d] = merge_value(out[d], static_cast<float>(blk[d]), w);
      lse_acc[off.lse] = w.lse;
    }
  });
}

void merge_attn_states_cpu(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& block_out,
                           const at::Tensor& block_lse) {
  const MergeGeometry g = check_merge_args(out_acc, lse_acc, block_out, block_lse);
  TORCH_CHECK_VALUE(out_acc.device().is_cpu(), "merge_attn_states_: CPU kernel got tensors on ", out_acc.device());
  float* oa = out_acc.data_ptr<float>();
  float* la = lse_acc.data_ptr<float>();
  const float* bl = block_lse.const_data_ptr<float>();
  switch (block_out.scalar_type()) {
    case at::kFloat:
      merge_rows_cpu<float>(g, oa, la, block_out.const_data_ptr<float>(), bl);
      break;
    case at::kHalf:
      merge_rows_cpu<at::Half>(g, oa, la, block_out.const_data_ptr<at::Half>(), bl);
      break;
    default:
      merge_rows_cpu<at::BFloat16>(g, oa, la, block_out.const_data_ptr<at::BFloat16>(), bl);
      break;
  }
}

// shard_index has no tensor argument, so it is registered as CompositeExplicitAutograd and always
// returns a CPU tensor (callers move it with .to(device)).
at::Tensor shard_index(int64_t seqlen, int64_t world_size, int64_t rank, c10::string_view layout_sv) {
  const std::string layout_name(layout_sv);
  const int layout = parse_layout(layout_name);
  TORCH_CHECK_VALUE(rank >= 0, "shard_index: rank must be in [0, world_size); got rank=", rank,
                    ", world_size=", world_size);
  check_shard_args("shard_index", seqlen, world_size, rank, layout, layout_name);
  const int64_t n = shard_local_len(seqlen, world_size);
  at::Tensor idx = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = shard_global_pos(i, seqlen, world_size, rank, layout);
  return idx;
}

// Row copy shared in shape with the CUDA kernel (kernels/shard.cu): same row maps, memcpy per row.
template <bool kGather>
at::Tensor copy_rows_cpu(const ShardCopy& c) {
  TORCH_CHECK_VALUE(c.src.device().is_cpu(), kGather ? "shard_gather" : "unshard", ": CPU kernel got a tensor on ",
                    c.src.device());
  const int64_t row_bytes = c.inner * static_cast<int64_t>(c.src.element_size());
  const int64_t dst_rows = c.outer * (kGather ? shard_local_len(c.seqlen, c.world_size) : c.seqlen);
  if (row_bytes == 0 || dst_rows == 0) return c.dst;
  const char* src = static_cast<const char*>(c.src.const_data_ptr());
  char* dst = static_cast<char*>(c.dst.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 65536 / row_bytes);
  at::parallel_for(0, dst_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t src_row = kGather ? gather_src_row(row, c.seqlen, c.world_size, c.rank, c.layout)
                                      : unshard_src_row(row, c.outer, c.seqlen, c.world_size, c.layout);
      std::memcpy(dst + row * row_bytes, src + src_row * row_bytes, row_bytes);
    }
  });
  return c.dst;
}

at::Tensor shard_gather_cpu(const at::Tensor& x, int64_t dim, int64_t world_size, int64_t rank,
                            c10::string_view layout) {
  return copy_rows_cpu<true>(prepare_shard_gather(x, dim, world_size, rank, layout));
}

at::Tensor unshard_cpu(const at::Tensor& chunks, int64_t dim, int64_t world_size, c10::string_view layout) {
  return copy_rows_cpu<false>(prepare_unshard(chunks, dim, world_size, layout));
}

}  // namespace

at::Tensor packed_shard_plan_cpu(const at::Tensor& cu_seqlens, int64_t world_size, int64_t min_piece) {
  const char* op = "packed_shard_plan";
  TORCH_CHECK_VALUE(world_size >= 1, op, ": world_size must be >= 1, got world_size=", world_size);
  TORCH_CHECK_VALUE(min_piece >= 1, op, ": min_piece must be >= 1, got min_piece=", min_piece);
  TORCH_CHECK_TYPE(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
                   ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type(),
                   "; build it with torch.tensor(..., dtype=torch.int32)");
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op,
                    ": cu_seqlens must be 1-D [num_docs + 1], got shape ", cu_seqlens.sizes());
  TORCH_CHECK_VALUE(cu_seqlens.device().is_cpu(), op, ": CPU planner got cu_seqlens on ", cu_seqlens.device());
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* c = cu.const_data_ptr<int64_t>();
  const int64_t ndocs = cu.numel() - 1;
  TORCH_CHECK_VALUE(c[0] == 0, op, ": cu_seqlens must start at 0, got cu_seqlens[0]=", c[0],
                    "; prepend a 0 (cu_seqlens = [0, len0, len0+len1, ...])");
  for (int64_t d = 0; d < ndocs; ++d) {
    TORCH_CHECK_VALUE(c[d + 1] >= c[d], op, ": cu_seqlens must be non-decreasing; got cu_seqlens[", d, "]=", c[d],
                      " > cu_seqlens[", d + 1, "]=", c[d + 1], "; build it as the cumulative sum of the lengths");
  }

  struct Piece {
    int64_t doc, start, len, rank;
  };
  std::vector<Piece> pieces;
  std::vector<int64_t> work(world_size, 0);
  std::vector<int64_t> whole;  // documents assigned whole
  const int64_t nsplit = 2 * world_size;
  for (int64_t d = 0; d < ndocs; ++d) {
    const int64_t len = c[d + 1] - c[d];
    if (len == 0) continue;
    if (len >= nsplit * min_piece) {
      // Zigzag within the document: pieces i and 2N-1-i go to rank i, so every rank gets the same causal work
      // (up to the one-token rounding of the piece lengths).
      for (int64_t i = 0; i < nsplit; ++i) {
        const int64_t s = even_piece_start(i, len, nsplit);
        const int64_t e = even_piece_start(i + 1, len, nsplit);
        const int64_t r = i < world_size ? i : nsplit - 1 - i;
        pieces.push_back({d, c[d] + s, e - s, r});
        work[r] += causal_piece_work(s, e - s);
      }
    } else {
      whole.push_back(d);
    }
  }
  // Longest first onto the least loaded rank (lowest rank on ties): the classic LPT greedy.
  std::stable_sort(whole.begin(), whole.end(),
                   [&](int64_t a, int64_t b) { return c[a + 1] - c[a] > c[b + 1] - c[b]; });
  for (const int64_t d : whole) {
    const int64_t len = c[d + 1] - c[d];
    const int64_t r = std::min_element(work.begin(), work.end()) - work.begin();
    pieces.push_back({d, c[d], len, r});
    work[r] += causal_piece_work(0, len);
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.start < b.start; });

  at::Tensor plan = at::empty({static_cast<int64_t>(pieces.size()), 4}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = plan.data_ptr<int64_t>();
  for (size_t i = 0; i < pieces.size(); ++i) {
    p[4 * i + 0] = pieces[i].doc;
    p[4 * i + 1] = pieces[i].start;
    p[4 * i + 2] = pieces[i].len;
    p[4 * i + 3] = pieces[i].rank;
  }
  return plan;
}

}  // namespace ndp

// ------------------------------------------------------------------------------------------------
// Registration. Mutated arguments carry alias annotations (a!)/(b!) so torch.compile functionalizes them.

TORCH_LIBRARY(ndp, m) {
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  m.def("merge_attn_states_(Tensor(a!) out_acc, Tensor(b!) lse_acc, Tensor block_out, Tensor block_lse) -> ()", tags);
  m.def("shard_index(int seqlen, int world_size, int rank, str layout) -> Tensor", tags);
  m.def("shard_gather(Tensor x, int dim, int world_size, int rank, str layout) -> Tensor", tags);
  m.def("unshard(Tensor chunks, int dim, int world_size, str layout) -> Tensor", tags);
  m.def("packed_shard_plan(Tensor cu_seqlens, int world_size, int min_piece) -> Tensor", tags);
}

TORCH_LIBRARY_IMPL(ndp, CPU, m) {
  m.impl("merge_attn_states_", &ndp::merge_attn_states_cpu);
  m.impl("shard_gather", &ndp::shard_gather_cpu);
  m.impl("unshard", &ndp::unshard_cpu);
  m.impl("packed_shard_plan", &ndp::packed_shard_plan_cpu);
}

TORCH_LIBRARY_IMPL(ndp, CompositeExplicitAutograd, m) { m.impl("shard_index", &ndp::shard_index); }

// ------------------------------------------------------------------------------------------------
// ndp._C: importing it runs the registrations above; it carries no Python functions.

static struct PyModuleDef ndp_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",                                                        // m_name
    "ndp compiled ops; registered as torch.ops.ndp.* on import",  // m_doc
    -1,                                                          // m_size
    nullptr,                                                     // m_methods
    nullptr,                                                     // m_slots
    nullptr,                                                     // m_traverse
    nullptr,                                                     // m_clear
    nullptr,                                                     // m_free
};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&ndp_c_module);
  if (m == nullptr) return nullptr;
  // WITH_CUDA: whether the CUDA kernels were compiled into this build (see `python -m ndp.info`).
  if (PyModule_AddIntConstant(m, "WITH_CUDA", NDP_WITH_CUDA) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
