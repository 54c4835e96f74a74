"""The cost model: per-GPU peak memory by term and per-step time of one ``ParallelismConfig``.

Memory follows what ``ndp.train`` does (``ndp/train/loop.py``): the model is built in fp32, so the master
parameters, their gradients and AdamW's two moments are fp32 (4 + 4 + 8 bytes per parameter), sharded by
tensor parallel (ndp's plan: q/k/v/o and the MLP; embeddings, norms and lm_head replicated) and then by FSDP2
over ``dp_shard x cp`` (HSDP replicates over ``dp_replicate``). With ``--dtype bf16`` FSDP2 gathers bf16
parameters (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). Saved activations per token
and layer are the bytes autograd keeps for a Llama layer under ndp attention (fitted exactly against
``torch.autograd.graph.saved_tensors_hooks`` counts on CPU, see tests/plan): norms keep an fp32 copy of
their input, the rest scales with the activation dtype.

Time: matmul FLOPs (6 x matmul params x tokens, +2 with checkpointing) at the profile's measured matmul
rate; attention FLOPs (4 B H D per visible pair, x2.5 backward) at the measured kernel rate for the block
length each CP algorithm computes; memory-bound element-wise work at HBM bandwidth; every collective's
bytes from the formulas ``ndp.cp.CommStats`` counts (all-gather (N-1) local chunks, reduce-scatter and
all-to-all (N-1)/N of the input, P2P exact), over NVLink inside a node and the network across nodes. Ring
transfers overlap each step's compute (as ``ndp.cp.ring`` posts them before the compute), the all-gather
of head slice i+1 overlaps slice i, Ulysses all-to-alls and TP all-reduces are exposed, FSDP2 prefetch
hides its all-gathers and reduce-scatters behind compute except the first block's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ndp.parallel.config import ParallelismConfig

from .spec import GpuProfile, ModelSpec

GiB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
OPTIMIZER_BYTES_PER_PARAM = 104.0  # grad clip + AdamW step, see estimate()
CLIP_OPS_PER_TENSOR, ADAMW_OPS_PER_TENSOR = 4, 10
TP_FWD_ALL_REDUCES, TP_BWD_ALL_REDUCES = 2, 5    # per layer, see estimate()
OPTIMIZER_OPS_PER_TENSOR = CLIP_OPS_PER_TENSOR + ADAMW_OPS_PER_TENSOR
MEM_TERMS = ("params", "grads", "optimizer", "fsdp_buffers", "grad_accum", "activations", "attention", "logits")
AC_MODES = ("none", "full", "selective")  # ndp.parallel.AC_MODES
LOSSES = ("fused", "full")                # ndp.train.config.LOSSES
LOSS_CHUNK_BYTES = 64 * 2**20             # ndp.ops.linear_ce.CHUNK_BYTES (tests/plan checks they agree)
LOSS_MIN_BLOCK_ROWS = 256                 # ndp.ops.linear_ce.MIN_BLOCK_ROWS (likewise)


# ---------------------------------------------------------------------------------------------- parameters

def local_param_numel(spec: ModelSpec, tp: int, fsdp: int, split_head: bool = False) -> dict:
    """Parameter elements one rank holds, per FSDP unit, after TP (ndp's plan; ``split_head``: lm_head split by
    vocabulary, see ``ModelSpec.tensors``) and FSDP2 sharding.

    FSDP2 shards dim 0 of every (TP-local) tensor into ``ceil(dim0 / fsdp)`` rows per rank.

    Returns:
        dict with "block" (one decoder layer, sharded), "root" (embeddings, final norm, lm_head, sharded),
        "block_tp"/"root_tp" (the same after TP only: what an FSDP all-gather materialises), "total" (sharded
        elements of the whole model) and "tensors" (count of parameter tensors).
    """
    out = {"block": 0, "root": 0, "block_tp": 0, "root_tp": 0, "tensors": 0}
    for _, shape, tp_dim, unit in spec.tensors(split_head):
        s = list(shape)
        if tp_dim is not None:
            s[tp_dim] //= tp
        tp_numel = math.prod(s)
        s[0] = -(-s[0] // fsdp)
        out[unit] += math.prod(s)
        out[unit + "_tp"] += tp_numel
        out["tensors"] += spec.num_layers if unit == "block" else 1
    out["total"] = out["block"] * spec.num_layers + out["root"]
    return out


# ---------------------------------------------------------------------------------------------- activations

def layer_activation_bytes(spec: ModelSpec, tp: int, es: int, head_sharded: bool = False) -> float:
    """Bytes autograd saves per token for one decoder layer (ndp attention, TP degree ``tp``).

    Two RMSNorms keep their fp32 input (4h; in fp32 that is the input itself) and their normalised output
    (es*h) plus a 4-byte rsqrt each, replicated over TP; q/attention output/o_proj input (4 es h), k and v
    (2 es h_kv), the gated MLP (gate, up, silu, product: 4 es i) and the fp32 lse (4 heads) are split by TP.
    Under TP the colwise input redistribution keeps one more es*h copy of the normalised input; Ulysses and
    USP (``head_sharded``) keep the head-sharded q of the all-to-all (es * h_q / tp).
    Exact against ``saved_tensors_hooks`` counts of ndp.train's setup (bench/plan_vs_measured.py).
    """
    h, i = spec.hidden_size, spec.intermediate_size
    hkv = spec.num_kv_heads * spec.head_dim
    hq = spec.num_heads * spec.head_dim
    norms = 2 * (4 * h + es * h + 4)
    split = es * (4 * hq + 2 * hkv + 4 * i) + 4 * spec.num_heads
    extra = (es * h if tp > 1 else 0) + (es * hq / tp if head_sharded else 0)
    return norms + split / tp + extra


def root_activation_bytes(spec: ModelSpec, es: int) -> float:
    """Bytes saved per token outside the layers: final norm, its output for lm_head, RoPE cos/sin, token ids."""
    h = spec.hidden_size
    return (4 * h + es * h + 4) + es * h + 2 * es * spec.head_dim + 8


def selective_layer_bytes(spec: ModelSpec, tp: int, es: int) -> float:
    """Bytes kept per token for one decoder layer under selective checkpointing (``ndp.parallel.SAVED_OPS``): the
    layer's input (the checkpoint) and the outputs of its matmuls: q, k, v, gate and up (split by TP), o_proj and
    down_proj (whole [tokens, hidden] partial sums on every TP rank). Exact against the tensors a forward leaves
    alive (bench/plan_vs_measured.py)."""
    h, i = spec.hidden_size, spec.intermediate_size
    hkv = spec.num_kv_heads * spec.head_dim
    hq = spec.num_heads * spec.head_dim
    return es * (3 * h + (hq + 2 * hkv + 2 * i) / tp)


def fused_loss_bytes(spec: ModelSpec, tokens: float, es: int, chunk_bytes: int = LOSS_CHUNK_BYTES,
                     vocab_shards: int = 1) -> float:
    """Peak bytes of ndp's fused linear cross-entropy (``ndp.ops.linear_cross_entropy``) beyond its inputs and
    the gradients it returns, in its backward (the larger pass), which walks the vocabulary in blocks over passes of
    tokens (``ndp.ops.linear_ce.tiles``): the fp32 logits block, turned into its softmax in place (x1.5 for
    16-bit inputs: their matmul output, then the softmax's 16-bit copy); for 16-bit inputs the pass's fp32
    hidden-gradient accumulator and its 16-bit product, and where the tokens take more than one pass the fp32
    weight-gradient accumulator beyond the es-byte gradient it becomes; the pass's per-token vectors (label masks,
    target rows, row scales: 31 bytes a token at the fp32 peak, 14 at the 16-bit one) and the per-token fp32
    log-sum-exp it saved. ``vocab_shards``: loss parallel over that many TP ranks (each holds vocab / vocab_shards
    rows). Exact against the tensors the op allocates (bench/plan_vs_measured.py)."""
    v, h = -(-spec.vocab_size // vocab_shards), spec.hidden_size  # the largest shard
    per_pass = max(1, min(tokens, chunk_bytes // (4 * min(v, LOSS_MIN_BLOCK_ROWS))))
    block = 4 * per_pass * max(1, min(v, chunk_bytes // (4 * per_pass)))
    if es == 4:
        return block + 31 * per_pass + 4 * tokens
    work = 1.5 * block + (4 + es) * per_pass * h + 14 * per_pass
    if per_pass < tokens:
        work = max((4 - es) * v * h + work, 4 * v * h)
    return work + 4 * tokens


def logits_bytes(spec: ModelSpec, es: int) -> float:
    """Peak bytes per token of logits and loss (ndp.train --loss full: ``cross_entropy(logits.float(), ...)``).

    The es-byte logits stay referenced, log_softmax keeps its fp32 output, and its backward holds the fp32
    gradient of the loss and its own fp32 result: (es + 12) * vocab. lm_head is replicated over TP.
    """
    return (es + 12) * spec.vocab_size


def attention_buffer_bytes(spec: ModelSpec, cfg: ParallelismConfig, tokens: float, es: int) -> float:
    """Transient bytes of one CP attention call's backward (the larger pass) on one rank.

    ``tokens`` is the rank's local tokens. ring: two K/V blocks in flight (es) and four fp32 dK/dV blocks
    (own, in-flight partial, incoming, send) plus fp32 dq; all-gather: the full gathered K/V, its ordered
    copy and the next slice (es), fp32 dK/dV in global and rank-major order and the send buffer, per head
    slice; Ulysses: head-sharded q/k/v/out copies (send and receive) and fp32 dq/dk/dv; USP: both.
    """
    tp, n = cfg.tp_size, cfg.cp_size
    d = spec.head_dim
    hq = spec.num_heads // tp * d
    hk = spec.num_kv_heads // tp
    kv = 2 * tokens * hk * d                      # local K and V elements
    dq32 = 4 * tokens * hq
    if n == 1 or cfg.cp_impl == "ring":
        return 2 * es * kv + 4 * 4 * kv + dq32
    if cfg.cp_impl == "allgather":
        ns = 2 if hk >= 2 else 1
        full = n * kv / ns
        return 3 * es * full + (3 + ns - 1) * 4 * full + dq32 / ns
    u = cfg.head_parallel_size
    kvr = 2 * tokens * max(hk, u) * d             # kv heads replicated just to one per rank
    a2a = 2 * es * (tokens * hq + kvr) + 2 * es * tokens * hq
    fp32 = dq32 + 4 * kvr
    if cfg.cp_impl == "ulysses":
        return a2a + fp32
    return a2a + fp32 + 2 * es * kvr + 4 * 4 * kvr   # usp: ring buffers of the head-sharded group


# ---------------------------------------------------------------------------------------------- topology

@dataclass(frozen=True)
class Topology:
    """Where ranks sit: ``gpus_per_node`` consecutive ranks per node; mesh order (dp_replicate, dp_shard, cp, tp)."""
    gpus: int
    gpus_per_node: int

    def intra_node(self, size: int, stride: int) -> bool:
        """True when every group of ``size`` ranks spaced ``stride`` apart lies inside one node."""
        return _intra_node(self.gpus, self.gpus_per_node, size, stride)


@functools.lru_cache(maxsize=4096)
def _intra_node(gpus: int, gpus_per_node: int, size: int, stride: int) -> bool:
    # The groups of a mesh axis start at outer * size * stride + inner (inner < stride).
    if size == 1:
        return True
    for outer in range(gpus // (size * stride)):
        for inner in range(stride):
            base = outer * size * stride + inner
            if base // gpus_per_node != (base + (size - 1) * stride) // gpus_per_node:
                return False
    return True


def _link(profile: GpuProfile, topo: Topology, size: int, stride: int) -> tuple[float, float]:
    """(bytes/s, per-message latency s) of the slowest link a group crosses."""
    if topo.intra_node(size, stride):
        return profile.nvlink_gbps * 1e9, profile.nvlink_latency_us * 1e-6
    return profile.network_gbps * 1e9, profile.network_latency_us * 1e-6


# ---------------------------------------------------------------------------------------------- comm bytes

def cp_bytes_per_layer(spec: ModelSpec, cfg: ParallelismConfig, tokens: float, es: int) -> dict:
    """Bytes one rank sends per attention layer (one micro-batch), by phase, as ``ndp.cp.CommStats`` counts.

    Same formulas as ``bench/bench_cp.py::_theory`` with the TP-local heads: ring and all-gather send every
    other rank's K/V ((N-1) local K/V blocks) forward and again backward, plus the fp32 dK/dV partial sums
    backward; Ulysses all-to-alls move (N-1)/N of q, the kv heads replicated to one per rank, and the output
    (forward) or dout, dq, dk/dv (backward); USP is Ulysses inside plus a ring over the head-sharded group.

    Returns:
        dict with fwd_p2p, bwd_p2p, fwd_ag, bwd_ag, bwd_rs, fwd_a2a, bwd_a2a (bytes sent per rank).
    """
    out = dict.fromkeys(("fwd_p2p", "bwd_p2p", "fwd_ag", "bwd_ag", "bwd_rs", "fwd_a2a", "bwd_a2a"), 0.0)
    n = cfg.cp_size
    if n == 1:
        return out
    tp, d = cfg.tp_size, spec.head_dim
    h, hk = spec.num_heads // tp, spec.num_kv_heads // tp
    kv = 2 * tokens * hk * d * es
    kv32 = 2 * tokens * hk * d * 4
    q = tokens * h * d * es
    if cfg.cp_impl == "ring":
        out["fwd_p2p"] = (n - 1) * kv
        out["bwd_p2p"] = (n - 1) * (kv + kv32)
    elif cfg.cp_impl == "allgather":
        out["fwd_ag"] = (n - 1) * kv
        out["bwd_ag"] = (n - 1) * kv
        out["bwd_rs"] = (n - 1) * kv32
    else:
        u = cfg.head_parallel_size
        r = n // u
        f = (u - 1) / u
        kvr = 2 * tokens * max(hk, u) * d * es
        out["fwd_a2a"] = f * (2 * q + kvr)
        out["bwd_a2a"] = f * (2 * q + kvr)
        if r > 1:
            out["fwd_p2p"] = (r - 1) * kvr
            out["bwd_p2p"] = (r - 1) * (kvr + kvr // es * 4)
    return out


# ---------------------------------------------------------------------------------------------- estimate

@dataclass
class Estimate:
    """Prediction for one candidate (memory in bytes per GPU, times in seconds per optimizer step)."""
    config: ParallelismConfig
    micro_batch: int
    grad_accum: int
    activation_checkpointing: str                  # one of AC_MODES
    loss: str = "fused"                            # one of LOSSES
    activation_offload: bool = False
    sharded_grad_accum: bool = False
    mem: dict = field(default_factory=dict)       # term -> bytes
    peak_bytes: float = 0.0
    usable_bytes: float = 0.0
    time: dict = field(default_factory=dict)      # term -> seconds per step
    step_s: float = 0.0
    tokens_per_s: float = 0.0                      # per GPU
    host_bytes: float = 0.0                        # pinned host memory per GPU (activation offload)
    mfu: float = 0.0
    model_flops: float = 0.0                       # per step, all GPUs (no recomputation)

    @property
    def flags(self) -> list[str]:
        """The ndp-train flags of the memory options (checkpointing, offload, accumulators, loss)."""
        out = []
        if self.activation_checkpointing != "none":
            out.append(f"--activation-checkpointing {self.activation_checkpointing}")
        if self.activation_offload:
            out.append("--activation-offload")
        if self.sharded_grad_accum:
            out.append("--sharded-grad-accum")
        if self.loss != "fused":
            out.append(f"--loss {self.loss}")
        return out

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def largest_term(self) -> str:
        return max(self.mem, key=self.mem.get)

    def reason(self) -> str:
        """Why it does not fit ('' when it does): the overflow and the terms that cause it."""
        if self.fits:
            return ""
        over = (self.peak_bytes - self.usable_bytes) / GiB
        top = sorted(self.mem.items(), key=lambda kv: -kv[1])[:2]
        terms = ", ".join(f"{k} {v / GiB:.1f}" for k, v in top)
        return (f"needs {self.peak_bytes / GiB:.1f} GiB > {self.usable_bytes / GiB:.1f} usable "
                f"(over by {over:.1f} GiB; largest: {terms} GiB)")


def _overlap(compute: float, comm: float, overlap: float) -> float:
    """Time of ``compute`` with ``comm`` issued beside it: max() when they overlap fully (GPU streams), the
    sum when they cannot (one CPU thread per rank blocks in gloo), in between by the profile's fraction."""
    return overlap * max(compute, comm) + (1.0 - overlap) * (compute + comm)


def _all_reduce_s(n: int, nbytes: float, bw: float) -> float:
    """Transfer time of a ring all-reduce of ``nbytes`` over ``n`` ranks: 2 (n-1)/n of the bytes at the link's
    bandwidth (NCCL's ring; gloo's all-reduce measures at its all-gather bandwidth too, unlike its
    reduce-scatter, see reduce_scatter_efficiency)."""
    return 2 * (n - 1) / n * nbytes / bw


def _rate(peak: float, half: float, block: float) -> float:
    return peak * block / (block + half) if half > 0 else peak


def attention_block(spec: ModelSpec, cfg: ParallelismConfig, seq_len: int) -> float:
    """Query/key block length the local kernel sees per call (what its efficiency depends on)."""
    n = cfg.cp_size
    if n == 1 or cfg.cp_impl == "ulysses":
        return float(seq_len)
    if cfg.cp_impl == "usp":
        return seq_len / (n // cfg.ulysses_size)
    return seq_len / n


@dataclass(frozen=True)
class _Job:
    """What one estimate derives from its arguments (per rank, per micro-batch)."""
    es: int                  # bytes per element of the compute dtype
    seq_len: int
    batch_size: int
    grad_accum: int
    ac: str                  # one of AC_MODES
    loss: str
    offload: bool
    sharded_accum: bool
    shard: int               # FSDP2 shards (1: no FSDP)
    mb: int                  # sequences per rank per micro-batch
    tokens: float            # local tokens per micro-batch
    head_shards: int         # the LM head's vocabulary split (tp under the fused loss, else 1)
    pn: dict                 # local_param_numel
    layer: float             # layer_activation_bytes per token
    root: float              # root_activation_bytes per token

    @property
    def again(self) -> int:
        """Forward passes of a layer's non-matmul work (2 under any checkpointing)."""
        return 2 if self.ac != "none" else 1


def _job(spec, cfg, *, seq_len, batch_size, grad_accum, dtype, activation_checkpointing, loss, activation_offload,
         sharded_grad_accum) -> _Job:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}; got {dtype!r}")
    ac = {True: "full", False: "none"}.get(activation_checkpointing, activation_checkpointing)
    if ac not in AC_MODES or loss not in LOSSES:
        raise ValueError(f"activation_checkpointing must be one of {AC_MODES} and loss one of {LOSSES}; got "
                         f"{activation_checkpointing!r}, {loss!r}")
    if activation_offload and ac != "full":
        raise ValueError(f"the planner models activation offloading of the checkpointed layers' inputs: it needs "
                         f"activation_checkpointing='full'; got {ac!r}")
    if batch_size % (cfg.dp_size * grad_accum):
        raise ValueError(f"batch_size must be divisible by dp_replicate*dp_shard*grad_accum; got batch_size="
                         f"{batch_size}, dp_size={cfg.dp_size}, grad_accum={grad_accum}")
    tp = cfg.tp_size
    shard = cfg.dp_shard_size * cfg.cp_size if cfg.fsdp_size > 1 else 1
    mb = batch_size // cfg.dp_size // grad_accum
    split_head = loss == "fused" and tp > 1 and not spec.tie_word_embeddings   # ndp-train's loss parallel
    es = DTYPE_BYTES[dtype]
    return _Job(es, seq_len, batch_size, grad_accum, ac, loss, activation_offload, sharded_grad_accum, shard, mb,
                mb * seq_len / cfg.cp_size, tp if split_head else 1, local_param_numel(spec, tp, shard, split_head),
                layer_activation_bytes(spec, tp, es, cfg.head_parallel_size > 1), root_activation_bytes(spec, es))


def memory_terms(spec: ModelSpec, cfg: ParallelismConfig, job: _Job) -> dict:
    """Bytes per GPU by MEM_TERMS."""
    es, L, tp, pn, tokens = job.es, spec.num_layers, cfg.tp_size, job.pn, job.tokens
    m = dict.fromkeys(MEM_TERMS, 0.0)
    m["params"] = 4.0 * pn["total"]
    m["grads"] = 4.0 * pn["total"]
    m["optimizer"] = 8.0 * pn["total"]
    if cfg.fsdp_size > 1:
        # Gathered (es-byte) parameters: current + prefetched + last block (kept for backward), the root
        # unit (kept from forward to backward); backward: one block's es-byte grads and fp32 reduce input,
        # lm_head's unsharded grad until the root's reduce-scatter.
        lm = spec.vocab_size * spec.hidden_size / job.head_shards if not spec.tie_word_embeddings else 0
        m["fsdp_buffers"] = es * (3 * pn["block_tp"] + pn["root_tp"]) + (es + 4) * pn["block_tp"] + es * lm
        if job.grad_accum > 1 and not job.sharded_accum:
            m["grad_accum"] = 4.0 * (pn["block_tp"] * L + pn["root_tp"])   # unsharded fp32 accumulators
    elif es == 2:
        # no FSDP: autocast keeps bf16 copies of every matmul weight for backward
        m["fsdp_buffers"] = 2.0 * (spec.block_matmul_params // tp * L
                                   + spec.vocab_size * spec.hidden_size / job.head_shards)
    layer = job.layer
    # full: every layer's input, and one layer's activations while it is recomputed; offloaded: the inputs of
    # the layer computed and of the one being copied stay on the device; selective: the matmul outputs
    ckpt = es * spec.hidden_size
    kept = {"none": L * layer, "full": (2 if job.offload else L) * ckpt + layer,
            "selective": L * selective_layer_bytes(spec, tp, es) + layer}[job.ac]
    m["activations"] = tokens * (kept + job.root)
    m["attention"] = attention_buffer_bytes(spec, cfg, tokens, es)
    m["logits"] = (tokens * logits_bytes(spec, es) if job.loss == "full"
                   else fused_loss_bytes(spec, tokens, es, vocab_shards=job.head_shards))
    return m


def compute_terms(spec: ModelSpec, cfg: ParallelismConfig, profile: GpuProfile, job: _Job, mem: dict) -> dict:
    """Seconds per micro-batch of the matmuls, the attention (and its forward / backward parts, ``attn_fwd`` /
    ``attn_bwd``, one pass each) and the element-wise work."""
    es, L, tp, tokens = job.es, spec.num_layers, cfg.tp_size, job.tokens
    t = {}
    mm_rate = (profile.matmul_tflops if es == 2 else profile.matmul_fp32_tflops) * 1e12
    block_mm = spec.block_matmul_params / tp
    head_mm = spec.vocab_size * spec.hidden_size / job.head_shards  # lm_head: split by vocabulary, or replicated
    recompute = 2 if job.ac == "full" else 0                       # selective keeps the matmul outputs
    head = 8 if job.loss == "fused" else 6                         # the fused loss recomputes its logits
    t["matmul"] = ((6 + recompute) * tokens * block_mm * L + head * tokens * head_mm) / mm_rate

    pairs = job.mb * spec.attn_pairs(job.seq_len) / cfg.cp_size     # balanced (zigzag) share of visible pairs
    fwd_flops = 4 * spec.head_dim * (spec.num_heads / tp) * pairs * L
    blk = attention_block(spec, cfg, job.seq_len)
    scale = 1.0 if es == 2 else profile.matmul_fp32_tflops / profile.matmul_tflops
    r_f = _rate(profile.attn_fwd_tflops, profile.attn_fwd_half_block, blk) * 1e12 * scale
    r_b = _rate(profile.attn_bwd_tflops, profile.attn_bwd_half_block, blk) * 1e12 * scale
    over = profile.cp_overhead.get(cfg.cp_impl, 1.0) if cfg.cp_size > 1 else 1.0
    t["attn_fwd"] = fwd_flops / r_f / over
    t["attn_bwd"] = 2.5 * fwd_flops / r_b / over
    t["attention"] = t["attn_fwd"] * job.again + t["attn_bwd"]
    act_moved = tokens * (L * job.layer + job.root) + (mem["logits"] if job.loss == "full" else 0)
    passes = profile.elementwise_passes + (2 if job.ac != "none" else 0)
    t["elementwise"] = act_moved * passes / profile.elementwise_rate
    return t


def cp_comm_s(spec: ModelSpec, cfg: ParallelismConfig, profile: GpuProfile, topo: Topology, job: _Job,
              a_f: float, a_b: float) -> float:
    """Exposed seconds per micro-batch of CP communication (ring steps overlap their compute; the all-gather
    overlaps one slice; Ulysses all-to-alls are exposed). ``a_f`` / ``a_b``: one attention pass, all layers."""
    n_cp, tp, L = cfg.cp_size, cfg.tp_size, spec.num_layers
    if n_cp == 1:
        return 0.0
    cpb = cp_bytes_per_layer(spec, cfg, job.tokens, job.es)
    ov = profile.comm_overlap
    af, ab = a_f / L, a_b / L
    exposed = 0.0
    if cfg.cp_impl in ("ring", "usp"):
        u = cfg.head_parallel_size
        r = n_cp // u
        if r > 1:
            bw, lat = _link(profile, topo, r, tp * u)
            steps = r - 1
            cf = cpb["fwd_p2p"] / steps / bw + lat
            cb = cpb["bwd_p2p"] / steps / bw + 2 * lat
            fwd_ring = steps * _overlap(af / r, cf, ov) + af / r
            bwd_ring = steps * _overlap(ab / r, cb, ov) + ab / r
            exposed += (fwd_ring - af) * job.again + (bwd_ring - ab)
    if cfg.cp_impl == "allgather":
        bw, lat = _link(profile, topo, n_cp, tp)
        ns = 2 if spec.num_kv_heads // tp >= 2 else 1
        g_f = cpb["fwd_ag"] / bw + ns * lat
        g_b = (cpb["bwd_ag"] + cpb["bwd_rs"] / profile.reduce_scatter_efficiency) / bw + 2 * ns * lat
        fwd_x = g_f / ns + _overlap(af * (ns - 1) / ns, g_f * (ns - 1) / ns, ov) - af * (ns - 1) / ns
        bwd_x = g_b / ns + _overlap(ab * (ns - 1) / ns, g_b * (ns - 1) / ns, ov) - ab * (ns - 1) / ns
        exposed += fwd_x * job.again + bwd_x
    if cfg.cp_impl in ("ulysses", "usp"):
        bw, lat = _link(profile, topo, cfg.head_parallel_size, tp)
        exposed += (cpb["fwd_a2a"] / bw + 2 * lat) * job.again + cpb["bwd_a2a"] / bw + 2 * lat
    return exposed * L


def tp_comm_s(spec: ModelSpec, cfg: ParallelismConfig, profile: GpuProfile, topo: Topology, job: _Job) -> float:
    """Seconds per micro-batch of TP all-reduces (torch's Colwise/RowwiseParallel, as ndp.hf applies them):
    [tokens, hidden] per layer, two forward (the rowwise o_proj and down_proj outputs) and five backward (the
    gradient of the replicated input of each colwise q, k, v, gate and up projection); counted in a tp2 profile
    of ndp-train: 28 per step for 4 layers, plus the grad norm's."""
    tp = cfg.tp_size
    if tp == 1:
        return 0.0
    bw, lat = _link(profile, topo, tp, 1)
    ar = _all_reduce_s(tp, job.tokens * spec.hidden_size * job.es, bw) + 2 * lat
    return ar * spec.num_layers * (TP_FWD_ALL_REDUCES * job.again + TP_BWD_ALL_REDUCES)


def fsdp_comm_s(spec: ModelSpec, cfg: ParallelismConfig, profile: GpuProfile, topo: Topology, job: _Job,
                compute: float) -> float:
    """Exposed seconds per step of FSDP2: all-gathers each micro-batch (forward and again in backward),
    reduce-scatter (fp32) on the last micro-batch (every one with sharded accumulators), HSDP all-reduce over
    dp_replicate; prefetch hides them behind ``compute`` (one micro-batch's) but the first block."""
    if cfg.fsdp_size == 1:
        return 0.0
    L, pn, shard = spec.num_layers, job.pn, job.shard
    ag = rs = hs = 0.0
    if shard > 1:
        bw, lat = _link(profile, topo, shard, cfg.tp_size)
        full = pn["block_tp"] * L + pn["root_tp"]
        ag = 2 * (shard - 1) / shard * job.es * full / bw + 2 * (L + 1) * lat
        rs = (shard - 1) / shard * 4 * full / (bw * profile.reduce_scatter_efficiency) + (L + 1) * lat
    if cfg.dp_replicate_size > 1:
        R = cfg.dp_replicate_size
        bw, lat = _link(profile, topo, R, cfg.tp_size * shard)
        hs = _all_reduce_s(R, 4 * pn["total"], bw) + (L + 1) * lat
    ov = profile.comm_overlap
    first = (ag + rs + hs) / (L + 1)
    each = ag + (rs if job.sharded_accum else 0.0)
    per_micro = _overlap(compute, each, ov) - compute + each / (L + 1)
    last = _overlap(compute, ag + rs + hs, ov) - compute + first
    return (job.grad_accum - 1) * per_micro + last


def optimizer_s(cfg: ParallelismConfig, profile: GpuProfile, job: _Job) -> float:
    """Grad clip + AdamW (foreach=False, as ndp-train runs it): memory-bound over the fp32 shards. Bytes per
    parameter, reads + writes of 4 bytes: clip pow 2, sum 1, scale 2; decay mul_ 2, exp_avg lerp_ 3, exp_avg_sq
    mul_ 2 + addcmul_ 4, denom sqrt 2 + div 2 + add_ 2, param addcdiv_ 4 = 26 accesses = 104 bytes; 14 ops per
    tensor (clip 4, AdamW 10). Both counted in torch by tests/plan/test_plan.py."""
    dtensors = cfg.fsdp_size > 1 or cfg.tp_size > 1
    op_us = (profile.dtensor_launch_us or profile.launch_us) if dtensors else profile.launch_us
    return (OPTIMIZER_BYTES_PER_PARAM * job.pn["total"] / (profile.hbm_gbps * 1e9)
            + job.pn["tensors"] * OPTIMIZER_OPS_PER_TENSOR * op_us * 1e-6)


def estimate(spec: ModelSpec, cfg: ParallelismConfig, profile: GpuProfile, topo: Topology, *, seq_len: int,
             batch_size: int, grad_accum: int = 1, dtype: str = "bf16", activation_checkpointing: bool | str = False,
             loss: str = "fused", activation_offload: bool = False, sharded_grad_accum: bool = False) -> Estimate:
    """Predict peak memory per GPU and time per optimizer step of one configuration.

    Args:
        spec: the model. cfg: the degrees (already valid for ``topo.gpus``). profile: the GPU.
        topo: GPUs and GPUs per node. seq_len: tokens per sequence. batch_size: global batch in sequences
            (divisible by ``cfg.dp_size * grad_accum``). dtype: "bf16" | "fp32" (compute dtype; master
            weights and optimizer are fp32 either way). activation_checkpointing: one of AC_MODES (a bool: True is
            "full"). loss: "fused" (ndp-train's default: no logits tensor) or "full". activation_offload: the
            checkpointed layers' inputs go to host memory (with "full" checkpointing). sharded_grad_accum: FSDP2
            reduce-scatters every micro-batch into sharded accumulators.
    Returns:
        an Estimate.
    Raises:
        ValueError: batch not divisible by dp_size * grad_accum, unknown dtype, checkpointing mode or loss,
            offload without full checkpointing.
    """
    job = _job(spec, cfg, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, dtype=dtype,
               activation_checkpointing=activation_checkpointing, loss=loss, activation_offload=activation_offload,
               sharded_grad_accum=sharded_grad_accum)
    L = spec.num_layers
    est = Estimate(cfg, job.mb, grad_accum, job.ac, loss, activation_offload, sharded_grad_accum,
                   usable_bytes=profile.usable_bytes)
    m = est.mem = memory_terms(spec, cfg, job)
    ckpt_bytes = L * job.tokens * job.es * spec.hidden_size    # every layer's input
    est.host_bytes = ckpt_bytes if activation_offload else 0.0
    transient = m["activations"] + m["attention"] + m["logits"] + m["grad_accum"]
    est.peak_bytes = m["params"] + m["optimizer"] + m["fsdp_buffers"] + max(m["grads"], transient)

    # time: seconds per micro-batch, then per step
    c = compute_terms(spec, cfg, profile, job, m)
    t = {k: c[k] for k in ("matmul", "attention", "elementwise")}
    t["cp_comm"] = cp_comm_s(spec, cfg, profile, topo, job, c["attn_fwd"], c["attn_bwd"])
    t["tp_comm"] = tp_comm_s(spec, cfg, profile, topo, job)
    compute = t["matmul"] + t["attention"] + t["elementwise"]
    # Offload: each layer's input to the host in the forward and back in the backward, over PCIe on a side
    # stream, hidden behind the micro-batch's compute as far as it lasts.
    t["offload"] = max(0.0, 2 * ckpt_bytes / (profile.pcie_gbps * 1e9) - compute) if activation_offload else 0.0
    micro = compute + t["cp_comm"] + t["tp_comm"] + t["offload"]
    t["fsdp_comm"] = fsdp_comm_s(spec, cfg, profile, topo, job, compute)
    t["optimizer"] = optimizer_s(cfg, profile, job)
    step = grad_accum * micro + t["fsdp_comm"] + t["optimizer"]
    for k in ("matmul", "attention", "elementwise", "cp_comm", "tp_comm", "offload"):
        t[k] *= grad_accum
    est.time = t
    est.step_s = step

    gpus = cfg.world_size
    global_tokens = batch_size * seq_len
    mm_total = spec.block_matmul_params * L + spec.vocab_size * spec.hidden_size
    attn_total = 3.5 * 4 * spec.head_dim * spec.num_heads * spec.attn_pairs(seq_len) * L * batch_size
    est.model_flops = 6 * mm_total * global_tokens + attn_total
    est.tokens_per_s = global_tokens / step / gpus
    peak = profile.peak_tflops if job.es == 2 else profile.peak_fp32_tflops
    est.mfu = est.model_flops / step / gpus / (peak * 1e12)
    return est
