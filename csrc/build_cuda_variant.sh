#!/usr/bin/env bash
# Builds the CUDA variant of ndp._C (CPU + CUDA ops) against the CUDA build of torch, with no GPU needed,
# then installs the wheel and checks that it imports and registers the CUDA kernels.
#
#   csrc/build_cuda_variant.sh            # venv /work/cudavenv (created if missing), wheel in /tmp/ndp-dist-cuda/
#   NDP_CUDA_VENV=/path/venv NDP_WHEEL_DIR=/path/out TORCH_CUDA_ARCH_LIST="8.0;9.0" csrc/build_cuda_variant.sh
#
# The sources are copied to a scratch directory first so the build never touches the repository's build/
# directory (an editable CPU build may be running there at the same time).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NDP_CUDA_VENV:-/work/cudavenv}"
TORCH_SPEC="${NDP_CUDA_TORCH:-torch==2.14.1}"
OUT="${NDP_WHEEL_DIR:-/tmp/ndp-dist-cuda}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
export NDP_BUILD_CUDA=1  # fail instead of silently building the CPU-only variant

if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "build_cuda_variant: no nvcc at $CUDA_HOME/bin/nvcc; install the CUDA toolkit or set CUDA_HOME" >&2
  exit 2
fi

t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  "$VENV/bin/pip" install -q "$TORCH_SPEC" numpy ninja setuptools wheel
fi
t1=$(date +%s)

# torch headers that include cuBLAS/cuSPARSE need headers of the nvidia-* wheels: setup.py links in those the toolkit
# lacks (a search path of the whole folder would also put the wheels' CUDA runtime headers before nvcc's own).

SRC="$(mktemp -d /tmp/ndp-cuda-src.XXXXXX)"
trap 'rm -rf "$SRC"' EXIT
cp -r "$REPO/setup.py" "$REPO/pyproject.toml" "$REPO/csrc" "$REPO/ndp" "$REPO/ndp_kernels" "$SRC/"
for f in MANIFEST.in README.md; do [ -f "$REPO/$f" ] && cp "$REPO/$f" "$SRC/"; done
find "$SRC" \( -name '__pycache__' -o -name '_C*.so' -o -name '*.egg-info' \) -prune -exec rm -rf {} +

mkdir -p "$OUT"
"$VENV/bin/pip" wheel -v --no-build-isolation --no-deps -w "$OUT" "$SRC" > "$SRC.build.log" 2>&1 \
  || { tail -60 "$SRC.build.log"; echo "build_cuda_variant: wheel build failed (log: $SRC.build.log)" >&2; exit 1; }
t2=$(date +%s)
grep -iE "warning" "$SRC.build.log" | grep -v -iE "BuildBackendWarning|UserWarning|byte-compiling is disabled|^ *warnings.warn" || true
# per-object compile times (ms) from ninja's log: start, end, mtime, target
for log in "$SRC"/build/temp*/.ninja_log; do
  [ -f "$log" ] && awk -F'\t' '!/^#/ {n=split($4, p, "/"); printf "build_cuda_variant: compiled %-20s %6.1f s\n", p[n], ($2-$1)/1000}' "$log"
done
rm -f "$SRC.build.log"
WHEEL="$(ls -t "$OUT"/ndp-*.whl | head -1)"
"$VENV/bin/pip" install -q --force-reinstall --no-deps "$WHEEL"

cd /tmp  # import the installed wheel, not the repository
"$VENV/bin/python" - <<'PY'
import torch
import ndp._ops as ops
assert ops.load_error is None, ops.load_error
assert ops.WITH_CUDA, "ndp._C was built without its CUDA kernels"
for op in ("merge_attn_states_", "shard_gather", "unshard", "packed_shard_plan"):
    assert ops.has_kernel(op, "CPU") and ops.has_kernel(op, "CUDA"), op
out, lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), float("-inf"))
torch.ops.ndp.merge_attn_states_(out, lse, torch.ones(1, 3, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 3))
assert torch.equal(out, torch.ones_like(out)) and torch.equal(lse, torch.zeros_like(lse))
print(f"ndp._C OK: torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA kernels registered, CPU ops run")
PY
"$VENV/bin/python" -m ndp.info || true
t3=$(date +%s)
echo "build_cuda_variant: wheel $WHEEL"
echo "build_cuda_variant: venv setup $((t1 - t0)) s, wheel build $((t2 - t1)) s, install+check $((t3 - t2)) s"
