# Two commands set up everything on a fresh machine: `make demo` (the main job) and `make test`.
# Both create and reuse a local venv (.venv), install what they need and build the extension ndp._C.
PY       ?= python3
VENV     ?= .venv
VPY      := $(VENV)/bin/python
TORCH    ?= torch==2.13.0
DEPS     := triton==3.9.0 numpy ninja setuptools wheel pytest pytest-timeout transformers==5.24.0 safetensors \
            accelerate==1.15.0 trl==1.16.0 peft==0.21.2 \
            pyyaml tqdm matplotlib pytest-benchmark
PYTEST   := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(VPY) -m pytest
EXT_SRC  := $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu csrc/kernels/*) setup.py

.PHONY: venv build test test-fast test-kernels test-dist aot-report cuda-variant demo bench gpu-report wheel clean

venv: $(VENV)/.deps
$(VENV)/.deps:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q $(DEPS)
	touch $@

build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.deps $(EXT_SRC)
	$(VPY) -m pip install -q --no-build-isolation -e .
	touch $@

# Everything CI runs: kernels under the Triton interpreter, compiled ops, gloo multi-process tests,
# ahead-of-time compiles for sm_80/sm_90 (static resource check) and nvcc compiles of the CUDA sources.
test: build
	$(PYTEST) -q -p no:cacheprovider --durations=15 tests

# The fast part alone (no multi-process jobs, no AOT/nvcc compiles, nothing marked slow).
test-fast: build
	$(PYTEST) -q -m "not slow and not distributed and not aot and not nvcc" tests

test-kernels: build
	$(PYTEST) -q tests/kernels tests/csrc tests/ops

test-dist: build
	$(PYTEST) -q -m distributed tests

aot-report: build
	$(VPY) -m ndp_kernels.aot --markdown

demo: build
	$(VPY) -m ndp.train.demo

bench: build
	$(VPY) bench/bench_kernels.py --out bench/results/
	$(VPY) bench/bench_cp.py --out bench/results/

# The GPU measurement in one command (bench/gpu_report.py): GPU tests, kernels, engines, HF A/B, first call;
# report under bench/results/<gpu>/. PARTS=kernels,hf picks parts (PARTS=tune,kernels: tune the kernels' tiles at
# head_dim 128 bf16 first, then time them), BUDGET_S the whole run's seconds (540 on a GPU),
# ARCHIVE=FILE.tar.gz packs the report folder. Without a GPU: the smoke mode (seconds).
# On a machine with its own CUDA torch: pip install --no-build-isolation -e . && make gpu-report GPU_PY=python3
GPU_PY ?= $(VPY)
gpu-report: $(if $(filter $(VPY),$(GPU_PY)),build)
	$(GPU_PY) bench/gpu_report.py $(if $(PARTS),--parts $(PARTS)) $(if $(BUDGET_S),--budget-s $(BUDGET_S)) \
		$(if $(ARCHIVE),--archive $(ARCHIVE))

# CUDA variant of ndp._C (CPU + CUDA ops) built against the CUDA torch build in its own venv; needs nvcc,
# no GPU. Installs the wheel there and checks that the CUDA kernels are registered.
cuda-variant:
	NDP_CUDA_VENV=$(CURDIR)/.venv-cuda NDP_WHEEL_DIR=$(CURDIR)/dist/cuda csrc/build_cuda_variant.sh

wheel: build
	$(VPY) -m pip wheel --no-build-isolation --no-deps -w dist .

clean:
	rm -rf build dist *.egg-info ndp/_C*.so
