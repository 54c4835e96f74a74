"""ndp.plan's predictions against measured gloo runs on this machine (CPU, fp32).

    python bench/plan_vs_measured.py                       # all three parts below
    python bench/plan_vs_measured.py --only bytes          # only the in-process byte counts (quick)
    python bench/plan_vs_measured.py --only memory         # the fused loss and selective checkpointing terms
    python bench/plan_vs_measured.py --only time           # whole steps of ndp-train under torchrun
    python bench/plan_vs_measured.py --only terms          # the step split into the planner's terms

1. Bytes per rank, exact (bench/plan_memory.py ``measure_bytes``): parameter, AdamW state and saved-activation
   bytes per rank of ``ndp.train``'s setup in gloo jobs against ``ndp.plan``'s params, optimizer and activations.
2. Whole steps (bench/plan_time.py ``measure_time``): ``ndp-train`` under torchrun against ``estimate`` with a
   measured CPU profile of the config plus the step's fixed host cost (measured at S=32); peak RSS beside the
   predicted tensor bytes.
3. Time per term (bench/plan_terms.py ``measure_terms``): the profiler splits ndp-train's step on the
   critical-path rank into the planner's matmul, attention, elementwise, comm and optimizer terms.
4. Memory options (bench/plan_memory.py ``measure_loss_bytes``, ``measure_selective_bytes``): the fused loss's
   working bytes and the bytes selective checkpointing keeps per layer, as the storages the ops allocate.
The three scripts run alone too (each has its own ``--help``). Results: printed tables and <out>/plan_vs_measured.json.
"""
from __future__ import annotations

import argparse

import plan_memory
import plan_terms
import plan_time
from _common import parser, write_results


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--only", choices=("bytes", "memory", "time", "terms"))
    # one rank of measure_terms' torchrun job (kept for command lines that name this script)
    ap.add_argument("--terms-worker", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--base-seq-len", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.terms_worker:
        return plan_terms._terms_worker(args)
    result = {}
    if args.only in (None, "bytes"):
        result["bytes"] = plan_memory.report_bytes(args.model)
    if args.only in (None, "memory"):
        result["memory_options"] = plan_memory.report_options()
    if args.only in (None, "time"):
        result["time"] = plan_time.report(args.model)
    if args.only in (None, "terms"):
        result["terms"] = plan_terms.report(args.model)
    write_results(args.out, "plan_vs_measured", result)


if __name__ == "__main__":
    main()
