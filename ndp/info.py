"""Environment report: ``python -m ndp.info`` (``--json`` for machine-readable output).

Prints the versions of python, torch, triton, transformers and flash-attn, which attention engines
(sdpa, triton, flash_attn, flash_attn3, torch) can run here, the engine table that ``backend="auto"`` reads
on this device (where it comes from, and per block class, dtype and head_dim the engine it picks and the
measured times), and which compiled ops (``torch.ops.ndp.*``, CPU and CUDA kernels) are registered, each
with the reason when something is missing.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys

import torch

from . import _ops


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict:
    """Gathers the report as a dict (see ``main`` for the printed form).

    Returns:
        dict with keys ``versions``, ``cuda``, ``backends``, ``compiled_ops``; every unavailable item carries a
        ``why``.
    """
    cuda_ok = torch.cuda.is_available()
    cuda = {
        "torch_cuda": torch.version.cuda,
        "available": cuda_ok,
        "device": torch.cuda.get_device_name(0) if cuda_ok else None,
        "why": "" if cuda_ok else ("torch is a CPU-only build" if not torch.version.cuda else "no CUDA device visible"),
    }
    versions = {
        "python": platform.python_version(),
        "ndp": _version("ndp"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "flash-attn": _version("flash-attn") or _version("flash_attn"),
    }

    device = "cuda" if cuda_ok else "cpu"
    try:
        from .ops import available_backends

        backends = {name: {"available": ok, "why": why} for name, (ok, why) in available_backends(device).items()}
    except Exception as exc:  # report, do not crash: this is the tool people run when something is broken
        backends = {"error": {"available": False, "why": f"ndp.ops failed to import: {type(exc).__name__}: {exc}"}}

    engines = _engine_report(device)
    kernel_table = _kernel_table_report(device)

    ops = {}
    cuda_why = ""
    if _ops.load_error is not None:
        cuda_why = _ops.load_error
        for op in _ops.OP_NAMES:
            ops[op] = {"CPU": False, "CUDA": False, "why": _ops.load_error}
    else:
        if not _ops.WITH_CUDA:
            cuda_why = (f"not built: the CUDA kernels are compiled only when torch is a CUDA build and nvcc is "
                        f"found at build time (this torch: {torch.__version__}, CUDA {torch.version.cuda}); "
                        f"rebuild against a CUDA torch with CUDA_HOME set")
        elif not cuda_ok:
            cuda_why = "registered, but there is no CUDA device here to run them"
        for op in _ops.OP_NAMES:
            cpu, cu = _ops.has_kernel(op, "CPU"), _ops.has_kernel(op, "CUDA")
            why = ""
            if op == "shard_index":
                why = "factory op: one device-independent kernel, returns a CPU tensor"
            elif _ops.WITH_CUDA and not cu:
                why = "no CUDA kernel registered"
            ops[op] = {"CPU": cpu, "CUDA": cu, "why": why}
    compiled = {"loaded": _ops.load_error is None, "why": _ops.load_error or "", "with_cuda": _ops.WITH_CUDA,
                "cuda_why": cuda_why, "ops": ops}
    return {"versions": versions, "cuda": cuda, "backends": backends, "engines": engines,
            "kernel_configs": kernel_table, "compiled_ops": compiled}


def _kernel_table_report(device: str) -> dict:
    """Where the Triton kernels' launch configurations come from on `device`: a tuned table or the static one."""
    try:
        from ndp_kernels import configs, tuning

        dev = torch.device(device)
        path = tuning.table_path("kernels", tuning.device_key(dev))
        rows = configs.tuned_table(dev, reload=True) if dev.type == "cuda" else {}
        probe = ("; where a row is missing, the first launch measures the choices the static tables leave open "
                 "(TMA, alternate tiles, atomic vs split backward) once"
                 if dev.type in configs.AUTO_PROBE else "")
        if rows:
            probed = sum(1 for r in rows.values() if r.get("probed"))
            how = (f"{len(rows) - probed} rows tuned (python -m ndp_kernels.tune), {probed} measured on first use"
                   if probed else "tuned on this GPU model")
            return {"source": str(path), "rows": len(rows), "why": how + probe}
        return {"source": "static tables (ndp_kernels/configs.py)", "rows": 0,
                "why": ("no tuned table for this GPU; run `python -m ndp_kernels.tune` to measure one" + probe
                        if dev.type == "cuda" else "no GPU here: launch configurations matter only on a GPU")}
    except Exception as exc:  # report, do not crash
        return {"source": "?", "rows": 0, "why": f"{type(exc).__name__}: {exc}"}


def _engine_report(device: str) -> dict:
    """The auto engine table of `device`: source, measurement facts, and per row the pick and why."""
    try:
        import torch as _t

        from .ops import engines

        table = engines.engine_table(device, reload=True)
        rows = {}
        for cls in engines.CLASSES:
            for key in sorted(k for k in table.rows if k[0] == cls):
                row = table.rows[key]
                avail = [e for e in row["order"] if engines.engine_available(e, device)[0]]
                rows["/".join(str(x) for x in key)] = {
                    "auto": avail[0] if avail else None, "order": row["order"], "ms": row.get("ms", {}),
                    "why": ("no measured engine is available here" if not avail else
                            "fastest exact engine measured" + (" (shipped with ndp for this GPU model)"
                                                               if key in table.shipped else
                                                               " (on first use)" if row.get("probed") else ""))}
        dev_type = _t.device(device).type
        default = list(engines.DEFAULT_ORDER.get(dev_type, ()))
        probe = ("; on this device auto measures a missing row once on first use "
                 "and adds it to the table") if dev_type in engines.AUTO_PROBE else ""
        return {"device_key": table.device_key, "source": table.source, "measured": table.meta.get("measured"),
                "block": table.meta.get("block"), "rows": rows, "default_order": default,
                "why": "" if rows else (f"no measured table for {table.device_key}: auto uses the default order "
                                        f"{default}{probe}; run `python -m ndp.ops.tune` to measure this device")}
    except Exception as exc:  # report, do not crash
        return {"error": f"{type(exc).__name__}: {exc}", "rows": {}}


def format_report(info: dict) -> str:
    """Renders ``collect()`` as human-readable text."""
    lines = ["ndp environment", "", "versions:"]
    for name, ver in info["versions"].items():
        lines.append(f"  {name:<13} {ver or 'not installed'}")
    c = info["cuda"]
    lines += ["", f"cuda: torch built with CUDA {c['torch_cuda']}; device: "
                  f"{c['device'] if c['available'] else 'none (' + c['why'] + ')'}", "", "attention backends:"]
    for name, b in info["backends"].items():
        lines.append(f"  {name:<11} {'yes' if b['available'] else 'no '}  {b['why']}".rstrip())
    e = info.get("engines", {})
    lines += ["", f"backend='auto' engine table: {e.get('source', '?')}"
                  + (f" (measured {e['measured']}, {e['block']})" if e.get("measured") else "")]
    if e.get("error") or e.get("why"):
        lines.append(f"  {e.get('error') or e.get('why')}")
    for key, r in e.get("rows", {}).items():
        times = "  ".join(f"{n} {t:.1f} ms" for n, t in sorted(r["ms"].items(), key=lambda x: x[1]))
        lines.append(f"  {key:<22} -> {r['auto'] or 'none':<11} {times}")
    kt = info.get("kernel_configs", {})
    lines += ["", f"Triton launch configurations: {kt.get('source', '?')}"
                  + (f" ({kt['rows']} rows)" if kt.get("rows") else "") + (f"; {kt['why']}" if kt.get("why") else "")]
    co = info["compiled_ops"]
    lines += ["", "compiled ops (torch.ops.ndp.*): " + ("loaded" if co["loaded"] else "NOT loaded: " + co["why"])]
    if co["loaded"]:
        lines.append(f"  CUDA kernels: {'built' if co['with_cuda'] else 'no'}"
                     f"{'; ' + co['cuda_why'] if co['cuda_why'] else ''}")
        lines.append(f"  {'op':<20} {'CPU':<4} {'CUDA':<5}")
        for op, o in co["ops"].items():
            lines.append(f"  {op:<20} {'yes' if o['CPU'] else 'no':<4} {'yes' if o['CUDA'] else 'no':<5} "
                         f"{o['why']}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ndp.info``; returns the process exit code (always 0: it only reports)."""
    parser = argparse.ArgumentParser(prog="python -m ndp.info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
