"""ndp.plan's step time per term against a profiler split of ndp-train's step (CPU, fp32).

    python bench/plan_terms.py                                  # small-llama: single, dp_shard2, tp2, cp2_*
    python bench/plan_terms.py --configs single,cp2_ring --seq-len 512
    python bench/plan_terms.py --term-of "aten::mm<ndp::attention_backward"   # the term an op in scopes counts to

The profiler splits ndp-train's step on the critical-path rank into the planner's matmul, attention,
elementwise, comm and optimizer terms (``measure_terms``), for one process and 2-rank configs, against
``estimate`` with the config's CPU profile (bench/plan_time.py's ``config_profile``).
Results: a printed table and <out>/plan_terms.json (bench/plan_vs_measured.py runs this with the other checks).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import tempfile
import time
from types import SimpleNamespace

import torch

import bench_cp  # end_rank: how a benchmark's rank leaves its process group
from _common import CONFIGS, config_names, parser, torchrun, write_json, write_results
from ndp.parallel import ParallelismConfig
from ndp.plan import load_model_spec
from plan_time import config_profile, predict_terms

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv"})
ATTENTION_SCOPES = ("ndp::attention", "AttnFunction", "ndp::cp_")  # ndp.ops' op, the CP Functions and ops (fwd, bwd)
OPTIMIZER_SCOPES = ("Optimizer.step", "Optimizer.zero_grad", "ndp.clip_grad_norm_")
# collectives (c10d, functional ones as DTensor/TP issue them, and their waits), FSDP2 gather/scatter
COMM_SCOPES = ("c10d::", "_c10d_functional::", "gloo:", "record_param_comms", "FSDP::")
TERMS = ("matmul", "attention", "elementwise", "comm", "optimizer")


def _term_of(event) -> str:
    """The planner term an op's self time belongs to: comm, optimizer, attention, matmul or elementwise."""
    scopes = []
    e = event
    while e is not None:
        scopes.append(e.name)
        e = e.cpu_parent
    if any(n.startswith(COMM_SCOPES) for n in scopes):
        return "comm"
    if any(n.startswith(OPTIMIZER_SCOPES) for n in scopes):
        return "optimizer"
    if any(k in n for n in scopes for k in ATTENTION_SCOPES):
        return "attention"
    return "matmul" if event.name in MATMUL_OPS else "elementwise"


def step_terms(cfg, windows=3, warmup=2) -> dict:
    """Seconds per planner term of ndp-train's step with TrainConfig ``cfg`` (this rank; runs ``train``).

    ``ndp.train``'s step hook runs at the same point of every step (after backward), so hook to hook is
    one whole step (clip, optimizer, zero_grad, data, forward, loss, backward). After ``warmup`` steps
    (first-touch page faults, lazy init), ``windows`` steps run under the profiler: each op's self time
    goes to the term of its scope (``_term_of``), the step's time outside any op (Python) to elementwise;
    then ``windows`` steps run without it for the wall time ("step"), and each term is its profiled share
    of that (the profiler's own cost is spread in proportion). Medians over the windows.
    """
    from ndp.train.loop import train

    runs, walls = [], []
    state = {}

    def hook(step, _model):
        now = time.perf_counter()
        if "prof" in state:
            state.pop("prof").stop()
            terms = dict.fromkeys(TERMS, 0.0)
            for e in state.pop("events")():
                terms[_term_of(e)] += e.self_cpu_time_total / 1e6
            terms["elementwise"] += max(0.0, now - state["t0"] - sum(terms.values()))
            runs.append({k: v / sum(terms.values()) for k, v in terms.items()})
        elif step > warmup + windows:
            walls.append(now - state["t0"])
        if warmup <= step < warmup + windows:
            p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"], state["events"] = p, p.events
            p.start()
        state["t0"] = time.perf_counter()

    torch.set_num_threads(1)
    train(dataclasses.replace(cfg, steps=warmup + 2 * windows + 1, progress=False), step_hook=hook)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    step = med(walls)
    out = {k: med([r[k] for r in runs]) * step for k in TERMS}
    out["step"] = step
    return out


def measure_terms(model="small-llama", name="single", seq_len=1024, batch=2, base_seq_len=32):
    """ndp-train's step per planner term, measured (this machine) and predicted (``estimate``, CPU profile).

    ``name``: "single" (one process, in this process) or a key of CONFIGS (a torchrun job of this script in
    ``--terms-worker`` mode; the terms of the rank that waits least in collectives, the critical path).
    Each term is compared by its size-dependent part: the step at ``seq_len`` minus the step at
    ``base_seq_len``, measured and predicted alike. The rest is the step's fixed host cost (Python, dispatch,
    FSDP2 hooks, DTensor, collective latencies on one CPU thread): the planner's device model leaves it out
    (on a GPU the host runs ahead of the device), so it is measured at ``base_seq_len`` and added to the
    predicted whole step. Returns ``(measured, predicted, profile)``: dicts of seconds per step for matmul,
    attention, elementwise, comm (CP + TP + FSDP, exposed; differences), optimizer (whole, it does not
    depend on the size), "fixed" (the step at ``base_seq_len``) and "step" (whole steps at ``seq_len``).
    """
    from ndp.train.config import TrainConfig

    spec = load_model_spec(model)
    pc = ParallelismConfig(**CONFIGS.get(name, {}))
    if pc.world_size == 1:
        full, base = (step_terms(TrainConfig(model=model, seq_len=s, batch_size=batch, device="cpu", dtype="fp32"))
                      for s in (seq_len, base_seq_len))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "terms.json")
            torchrun(pc.world_size, [os.path.abspath(__file__), "--terms-worker", name, "--model", model, "--seq-len",
                                     str(seq_len), "--base-seq-len", str(base_seq_len), "--batch", str(batch),
                                     "--out", out], cwd=tmp)
            with open(out) as f:
                full, base = json.load(f)
    prof = config_profile(spec, pc, seq_len, batch)
    est = [predict_terms(spec, pc, prof, s, batch) for s in (seq_len, base_seq_len)]
    terms = ("matmul", "attention", "elementwise", "comm")
    measured = {k: full[k] - base[k] for k in terms}
    predicted = {k: est[0][k] - est[1][k] for k in terms}
    measured["optimizer"], predicted["optimizer"] = full["optimizer"], est[0]["optimizer"]  # size-independent
    measured["fixed"] = predicted["fixed"] = base["step"]
    measured["step"] = full["step"]
    predicted["step"] = est[0]["step"] + base["step"] - est[1]["step"]
    return measured, predicted, prof


def _terms_worker(args):
    import torch.distributed as dist

    from ndp.train.config import TrainConfig

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    pc = ParallelismConfig(**CONFIGS[args.terms_worker])
    cfg = TrainConfig(model=args.model, parallel=pc, seq_len=args.seq_len, batch_size=args.batch, device="cpu",
                      dtype="fp32")
    both = []
    for s in (args.seq_len, args.base_seq_len):
        res = step_terms(dataclasses.replace(cfg, seq_len=s))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, res)
        # The critical path: the rank that waits least in collectives is the one the others wait for; its
        # comm is the transfers themselves, the others' also holds the skew between ranks.
        both.append(dict(min(every, key=lambda r: r["comm"]), ranks=every))
    if dist.get_rank() == 0:
        write_json(args.out, both)
    bench_cp.end_rank(True)


TERMS_CONFIGS = ("single", "dp_shard2", "tp2", "cp2_ring", "cp2_ulysses")
PROFILE_FIELDS = ("matmul_tflops", "attn_fwd_tflops", "attn_bwd_tflops", "hbm_gbps", "elementwise_gbps", "launch_us",
                  "nvlink_gbps", "nvlink_latency_us", "reduce_scatter_efficiency", "comm_overlap")


def report(model="small-llama", names=TERMS_CONFIGS, seq_len=1024, batch=2, base_seq_len=32) -> dict:
    """measure_terms per config, printed; returns {config: {measured, predicted, cpu_profile}}."""
    result = {}
    print(f"\nstep time per term, {model}, batch {batch}, fp32, ndp-train's step on the critical-path rank: "
          f"predicted / measured s (ratio) of the size-dependent part (S={seq_len} minus S={base_seq_len}; "
          f"optimizer: whole); comm = CP + TP + FSDP2 collectives; fixed = the measured step at S={base_seq_len} "
          f"(host cost); step = whole step at S={seq_len}, predicted = model + fixed")
    cols = ("matmul", "attention", "elementwise", "comm", "optimizer", "fixed", "step")
    print(f"{'config':<12}" + "".join(f"{k:>23}" for k in cols))
    for name in names:
        meas, pred, prof = measure_terms(model, name, seq_len, batch, base_seq_len)
        result[name] = dict(measured=meas, predicted=pred, cpu_profile={k: getattr(prof, k) for k in PROFILE_FIELDS})
        cells = []
        for k in cols:
            if k == "fixed":
                cells.append(f"{meas[k]:.3f}")
                continue
            r = f"({pred[k] / meas[k]:.2f})" if abs(meas[k]) > 1e-4 else "(-)"
            cells.append(f"{pred[k]:.3f}/{meas[k]:.3f} {r:>6}")
        print(f"{name:<12}" + "".join(f"{c:>23}" for c in cells))
    return result


def term_of_scopes(chain: str) -> str:
    """_term_of for an op given as ``OP<SCOPE<OUTER_SCOPE...`` (innermost first, as the profiler nests them)."""
    event = None
    for name in reversed(chain.split("<")):
        event = SimpleNamespace(name=name, cpu_parent=event)
    return _term_of(event)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--configs", type=lambda s: config_names(s, ("single",)), default=TERMS_CONFIGS,
                    help="comma-separated; single: one process")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="the global batch")
    ap.add_argument("--base-seq-len", type=int, default=32, help="where the fixed host cost is measured")
    ap.add_argument("--term-of", action="append", metavar="OP<SCOPE...",
                    help="print the term an op in these scopes counts to, one line each, and measure nothing")
    ap.add_argument("--terms-worker", help=argparse.SUPPRESS)   # internal: one rank of measure_terms' job
    args = ap.parse_args(argv)
    if args.terms_worker:
        return _terms_worker(args)
    if args.term_of:
        for chain in args.term_of:
            print(term_of_scopes(chain))
        return
    result = report(args.model, args.configs, args.seq_len, args.batch, args.base_seq_len)
    write_results(args.out, "plan_terms", {"terms": result})


if __name__ == "__main__":
    main()
