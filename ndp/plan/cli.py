"""``ndp-plan`` / ``python -m ndp.plan``: which ND-parallel layout for this model, these GPUs, this sequence.

Exit codes: 0 with at least one fitting candidate, 3 when nothing fits (the message names the memory term
and the smallest change that would fit), 2 for bad input (argparse style: constraint, values, fix).
"""
from __future__ import annotations

import argparse
import json
import sys

from .cost import LOSSES, GiB, MEM_TERMS
from .search import AC_CHOICES, PlanRequest, describe, plan, suggest, train_flags
from .spec import GPU_KINDS, load_gpu_profile, load_model_spec

EXIT_NOTHING_FITS = 3


def _positive_int(name):
    def conv(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer; got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer; got {v}")
        return v
    return conv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ndp-plan", description=(
        "Rank every valid dp_replicate/dp_shard/cp/tp layout and CP algorithm for a model on N GPUs: "
        "predicted peak memory per GPU, step time, tokens/s per GPU and MFU."))
    a = p.add_argument
    a("--model", required=True, help="preset (llama-3-8b, llama-3-70b, tiny-llama, ...) or a local HF directory")
    a("--gpus", required=True, type=_positive_int("--gpus"), help="total GPUs")
    a("--gpus-per-node", type=_positive_int("--gpus-per-node"), default=8)
    a("--gpu", default="h100", choices=GPU_KINDS, help="GPU profile (shipped data; see --profile)")
    a("--profile", help="YAML/JSON file overriding fields of the GPU profile (rates, memory, bandwidths)")
    a("--seq-len", required=True, type=_positive_int("--seq-len"), help="tokens per sequence")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--batch-size", type=_positive_int("--batch-size"), help="global batch, in sequences")
    g.add_argument("--global-batch-tokens", type=_positive_int("--global-batch-tokens"),
                   help="global batch, in tokens (a multiple of --seq-len)")
    a("--dtype", default="bf16", choices=("bf16", "fp32"))
    a("--activation-checkpointing", default="auto", choices=AC_CHOICES,
      help="auto: without; where nothing fits, selective, then full, then full with the layers' inputs offloaded "
           "to host memory")
    a("--loss", default="fused", choices=LOSSES, help="the token loss ndp-train computes (fused: no logits tensor)")
    a("--top", type=_positive_int("--top"), default=10, help="rows of the table")
    a("--json", help="write every candidate to this JSON file")
    return p


def _row(e) -> dict:
    c = e.config
    return {"dp_replicate_size": c.dp_replicate_size, "dp_shard_size": c.dp_shard_size, "cp_size": c.cp_size,
            "tp_size": c.tp_size, "cp_impl": c.cp_impl, "ulysses_size": c.ulysses_size,
            "mem_gb": round(e.peak_bytes / GiB, 3), "step_s": round(e.step_s, 6),
            "tokens_per_s": round(e.tokens_per_s, 2), "mfu": round(e.mfu, 4), "fits": e.fits,
            "reason": e.reason(), "grad_accum": e.grad_accum, "micro_batch": e.micro_batch,
            "activation_checkpointing": e.activation_checkpointing, "activation_offload": e.activation_offload,
            "sharded_grad_accum": e.sharded_grad_accum, "loss": e.loss, "flags": e.flags,
            "host_gb": round(e.host_bytes / GiB, 3),
            "mem_terms_gb": {k: round(v / GiB, 3) for k, v in e.mem.items()},
            "time_terms_s": {k: round(v, 6) for k, v in e.time.items()}}


def format_table(ests, top: int) -> str:
    """The ranked table (fitting candidates first)."""
    head = (f"{'#':>3}  {'layout':<34} {'ga':>3} {'AC':>9} {'mem GiB':>8} {'step s':>8} {'tok/s/GPU':>10} "
            f"{'MFU':>6}  fits")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(ests[:top], 1):
        ac = e.activation_checkpointing + ("+off" if e.activation_offload else "")
        ga = f"{e.grad_accum}{'s' if e.sharded_grad_accum else ''}"
        lines.append(f"{i:>3}  {describe(e.config):<34} {ga:>3} {ac:>9} "
                     f"{e.peak_bytes / GiB:>8.1f} {e.step_s:>8.3f} {e.tokens_per_s:>10,.0f} {e.mfu:>6.1%}  "
                     + ("yes" if e.fits else "no: " + e.reason()))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Console entry point. Returns the exit code (0 fits, 3 nothing fits; bad input exits 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = load_model_spec(args.model)
        profile = load_gpu_profile(args.gpu, args.profile)
    except ValueError as e:
        parser.error(str(e))
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens % args.seq_len:
            parser.error(f"--global-batch-tokens must be a multiple of --seq-len; got global_batch_tokens="
                         f"{args.global_batch_tokens}, seq_len={args.seq_len}. Use "
                         f"{max(1, args.global_batch_tokens // args.seq_len) * args.seq_len}.")
        batch = args.global_batch_tokens // args.seq_len
    else:
        batch = args.batch_size
    if args.gpus > 1 and args.seq_len % 2:
        parser.error(f"--seq-len must be even: ndp's zigzag CP splits a sequence into 2*cp_size chunks; got "
                     f"seq_len={args.seq_len}. Use {args.seq_len + 1} (or a multiple of {2 * args.gpus} to allow "
                     f"every CP degree up to --gpus {args.gpus}).")
    try:
        req = PlanRequest(spec=spec, profile=profile, gpus=args.gpus, seq_len=args.seq_len, batch_size=batch,
                          gpus_per_node=args.gpus_per_node, dtype=args.dtype,
                          activation_checkpointing=args.activation_checkpointing, loss=args.loss)
        ests = plan(req)
    except ValueError as e:
        parser.error(str(e))
    n_fit = sum(e.fits for e in ests)
    print(f"ndp-plan: {spec.name} ({spec.num_params / 1e9:.2f}B params), {args.gpus} x {profile.name} "
          f"({args.gpus_per_node}/node), seq_len {args.seq_len}, global batch {batch} x {args.seq_len} tokens, "
          f"{args.dtype}: {len(ests)} valid layouts, {n_fit} fit in {profile.usable_bytes / GiB:.1f} GiB")
    print(format_table(ests, args.top))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([_row(e) for e in ests], f, indent=1)
    if n_fit:
        best = ests[0]
        terms = ", ".join(f"{k} {best.mem[k] / GiB:.2f}" for k in MEM_TERMS if best.mem[k] >= 0.01 * best.peak_bytes)
        print(f"\nbest: {describe(best.config)}: {best.tokens_per_s:,.0f} tokens/s per GPU, MFU {best.mfu:.1%}, "
              f"{best.peak_bytes / GiB:.1f} GiB per GPU ({terms})")
        if best.host_bytes:
            print(f"activation offload: {best.host_bytes / GiB:.1f} GiB of pinned host memory per GPU")
        print(train_flags(req, best, args.model))
        return 0
    worst = ests[0]
    print(f"\nnothing fits: the smallest candidate ({describe(worst.config)}) {worst.reason()}", file=sys.stderr)
    hint = suggest(req)
    print("smallest change that fits: " + (hint or "none of more GPUs (64x), a shorter sequence (1/64) or "
                                          "checkpointing; use a larger GPU (--gpu) or a smaller model"),
          file=sys.stderr)
    return EXIT_NOTHING_FITS


if __name__ == "__main__":
    sys.exit(main())
