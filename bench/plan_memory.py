"""ndp.plan's memory terms against the bytes counted in gloo runs and in the ops (CPU, fp32).

    python bench/plan_memory.py                  # both parts below
    python bench/plan_memory.py --only bytes     # bytes per rank of the parallel configs
    python bench/plan_memory.py --only options   # the fused loss and selective checkpointing terms

1. Bytes per rank, exact: each config is set up the way ``ndp.train`` does it (fp32 model from the preset,
   ``ndp.hf.parallelize``, AdamW foreach=False) in a gloo job; per rank we count the parameter bytes (local
   shards), AdamW state bytes after one step, and the bytes autograd saves during one forward
   (``torch.autograd.graph.saved_tensors_hooks``, parameter storages excluded), and compare them with
   ``ndp.plan``'s params, optimizer and activations (+ root) terms.
2. Memory options: the fused loss's working bytes and the bytes selective checkpointing keeps per layer, counted
   as the storages the ops allocate (``LiveTensorBytes``), against ``fused_loss_bytes`` and
   ``selective_layer_bytes``.
Results: printed tables and <out>/plan_memory.json (bench/plan_vs_measured.py runs this with the time checks).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _common import CONFIGS, config_names, rank_job, parser, spawn_json, write_results
from ndp.parallel import ParallelismConfig
from ndp.plan import Topology, estimate, load_model_spec
from ndp.plan.cost import fused_loss_bytes, selective_layer_bytes


# ---------------------------------------------------------------------------------------------- exact bytes

def _config_bytes(name, model, seq_len, batch) -> dict:
    """This rank's parameter, AdamW state and saved-activation bytes of config ``name`` (process group up)."""
    import ndp.hf
    from ndp.train.presets import build_model

    pc = ParallelismConfig(**CONFIGS[name])
    mesh = pc.build_device_mesh("cpu")
    m = build_model(model, seed=0)
    ndp.hf.parallelize(m, pc, mesh, loss_parallel=True)  # as ndp-train's fused loss under TP
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = sum(local(p).numel() * local(p).element_size() for p in m.parameters())
    pstores = {local(p).untyped_storage().data_ptr() for p in m.parameters()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (batch // pc.dp_size, seq_len), generator=g)
    pos = torch.arange(seq_len).expand_as(ids)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # shifted before sharding
    b = ndp.hf.shard_batch(m, input_ids=ids, labels=labels, position_ids=pos)
    seen = {}

    def pack(t):
        # Parameters (also FSDP's gathered, unsharded ones) are weights, not activations.
        if not isinstance(t, torch.nn.Parameter):
            st = local(t).untyped_storage()
            # FSDP2 swaps in the gathered parameters during forward: their storages (and views of
            # them, e.g. the weight.t() a linear saves) are weights too.
            now = {local(p).untyped_storage().data_ptr() for p in m.parameters()}
            if st.data_ptr() not in pstores and st.data_ptr() not in now:
                seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = m(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    logits.float().sum().backward()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
    opt.step()
    opt_bytes = sum(local(v).numel() * local(v).element_size() for s in opt.state.values()
                    for k, v in s.items() if torch.is_tensor(v) and k != "step")
    return dict(params=params, optimizer=opt_bytes, saved=sum(seen.values()), tokens=b["input_ids"].numel())


def _bytes_worker(rank, tmp, out_file, world, model, names, seq_len, batch):
    def body():
        import torch.distributed as dist

        # one config at a time: its model and optimizer are freed before the next one
        res = {name: _config_bytes(name, model, seq_len, batch) for name in names}
        allres = [None] * world
        dist.all_gather_object(allres, res)
        return allres

    rank_job(rank, world, tmp, out_file, body)


def measure_bytes(model="small-llama", names=tuple(CONFIGS), seq_len=128, batch=4):
    """Per-rank measured bytes and the planner's prediction for each config. Returns a list of rows."""
    spec = load_model_spec(model)
    rows = []
    for world in (2, 4):
        todo = [n for n in names if ParallelismConfig(**CONFIGS[n]).world_size == world]
        if not todo:
            continue
        per_rank = spawn_json(_bytes_worker, world, world, model, todo, seq_len, batch)
        for name in todo:
            pc = ParallelismConfig(**CONFIGS[name])
            e = estimate(spec, pc, _dummy_profile(), Topology(world, world), seq_len=seq_len, batch_size=batch,
                         dtype="fp32")
            meas = max(r[name]["params"] for r in per_rank), max(r[name]["optimizer"] for r in per_rank), \
                max(r[name]["saved"] for r in per_rank)
            pred_act = e.mem["activations"]
            rows.append(dict(config=name, world=world, params_measured=meas[0], params_predicted=e.mem["params"],
                             optimizer_measured=meas[1], optimizer_predicted=e.mem["optimizer"],
                             activations_measured=meas[2], activations_predicted=pred_act))
    return rows


def _dummy_profile():
    # Memory terms do not depend on the rates; any valid profile works for them.
    from ndp.plan import load_gpu_profile

    return load_gpu_profile("h100")


# ---------------------------------------------------------------------------------------------- memory options

class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages the ops run inside it allocate, while they live (``cur``) and at most
    (``peak``): a view or an in-place result shares an argument's storage and is not counted again."""

    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak = {}, 0, 0

    def _free(self, ptr):
        self.cur -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr and ptr not in given and ptr not in self.live:
                self.live[ptr] = st.nbytes()
                self.cur += st.nbytes()
                self.peak = max(self.peak, self.cur)
                weakref.finalize(st, self._free, ptr)
        return out


def measure_loss_bytes(tokens=4096, vocab=8192, hidden=64, chunk_bytes=2 ** 20):
    """The fused loss's peak bytes beyond its inputs and returned gradients, measured and predicted
    (``fused_loss_bytes``), fp32 and bf16. Returns rows."""
    from ndp.ops import linear_cross_entropy

    spec = load_model_spec("tiny-llama").replace(vocab_size=vocab, hidden_size=hidden)
    rows = []
    for dtype, es in ((torch.float32, 4), (torch.bfloat16, 2)):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
        w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), generator=g)
        live = LiveTensorBytes()
        with live:
            grads = torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_bytes=chunk_bytes), (h, w))
        measured = live.peak - sum(t.numel() * t.element_size() for t in grads)
        rows.append(dict(term="logits (fused loss)", dtype=str(dtype).split(".")[-1], measured=measured,
                         predicted=fused_loss_bytes(spec, tokens, es, chunk_bytes)))
    return rows


def measure_selective_bytes(seq_len=64):
    """Bytes a forward keeps per token and layer under selective checkpointing (the tensors alive after it, 1 vs 2
    layers), measured and predicted (``selective_layer_bytes``), fp32 and bf16. Returns rows."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ndp.hf

    spec = load_model_spec("tiny-llama").replace(hidden_size=96, intermediate_size=160, num_heads=6,
                                                 num_kv_heads=2, head_dim=16)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for dtype, es in ((torch.float32, 4), (torch.bfloat16, 2)):
            kept = []
            for layers in (1, 2):
                cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                                  vocab_size=128, num_hidden_layers=layers)
                cfg._attn_implementation = "sdpa"
                torch.manual_seed(0)
                m = AutoModelForCausalLM.from_config(cfg).to(dtype)
                p = ParallelismConfig()
                ndp.hf.parallelize(m, p, p.build_device_mesh("cpu"), activation_checkpointing="selective")
                live = LiveTensorBytes()
                with live:
                    out = m(input_ids=torch.randint(0, 128, (1, seq_len)), use_cache=False).logits
                kept.append(live.cur - out.untyped_storage().nbytes())
            rows.append(dict(term="activations per layer (selective)", dtype=str(dtype).split(".")[-1],
                             measured=(kept[1] - kept[0]) / seq_len, predicted=selective_layer_bytes(spec, 1, es)))
    finally:
        if owned:
            dist.destroy_process_group()
    return rows


# ---------------------------------------------------------------------------------------------- report

def report_bytes(model="small-llama", names=tuple(CONFIGS), seq_len=128, batch=4) -> list[dict]:
    """measure_bytes, printed as a table of predicted / measured bytes per rank."""
    rows = measure_bytes(model, names, seq_len, batch)
    print(f"bytes per rank, {model}, S={seq_len}, batch {batch}, fp32 (predicted / measured):")
    print(f"{'config':<16} {'params':>22} {'optimizer':>22} {'activations':>26}")
    for r in rows:
        cells = []
        for t in ("params", "optimizer", "activations"):
            p, m = r[f"{t}_predicted"], r[f"{t}_measured"]
            cells.append(f"{p / 1e6:8.3f}/{m / 1e6:8.3f} MB {p / m:5.3f}")
        print(f"{r['config']:<16} " + " ".join(cells))
    return rows


def report_options() -> list[dict]:
    """measure_loss_bytes and measure_selective_bytes, printed."""
    rows = measure_loss_bytes() + measure_selective_bytes()
    print("\nmemory options, predicted / measured bytes (tensors the ops allocate, LiveTensorBytes):")
    for r in rows:
        print(f"{r['term']:<36} {r['dtype']:<9} {r['predicted']:>12,.0f} / {r['measured']:>12,.0f}  "
              f"{r['predicted'] / r['measured']:.4f}")
    return rows


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--only", choices=("bytes", "options"))
    ap.add_argument("--configs", type=config_names, default=tuple(CONFIGS), help="bytes per rank: comma-separated")
    ap.add_argument("--seq-len", type=int, default=128, help="bytes per rank")
    ap.add_argument("--batch", type=int, default=4, help="bytes per rank: the global batch")
    args = ap.parse_args(argv)
    result = {}
    if args.only in (None, "bytes"):
        result["bytes"] = report_bytes(args.model, args.configs, args.seq_len, args.batch)
    if args.only in (None, "options"):
        result["memory_options"] = report_options()
    write_results(args.out, "plan_memory", result)


if __name__ == "__main__":
    main()
