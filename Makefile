# Two commands from a fresh clone: `make demo` (train the digits ViT) and `make test`.
# Both create .venv on first use, seeing the packages of $(PYTHON)'s environment: the system's, or
# those of the virtualenv / conda environment $(PYTHON) belongs to (a .pth file adds its
# site-packages), so a torch that $(PYTHON) can import (a CUDA build on a GPU machine) is the one
# used, and no second torch is installed. Only where $(PYTHON) has no torch is torch==2.13.0 (the
# CPU wheel) installed, and never on a machine with an NVIDIA GPU (nvidia-smi answers): there
# make stops and says to install a CUDA build of torch first.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The integration environment (see test-integration), defined here: coverage-report, above it,
# names its stamp as a prerequisite, which make expands where the rule is read.
INT_VENV := .venv-integration
INT_PY := $(INT_VENV)/bin/python
INT_STAMP := $(INT_VENV)/.installed
INT_SOURCES := $(shell find vit_kernels vit -name '*.py') $(wildcard csrc/*.cpp csrc/*.h)
PYTEST_ARGS ?=
# One Inductor cache per CPU capability: Inductor's cache keys leave out ATEN_CPU_CAPABILITY, on which
# the C++ it generates depends, so a run under ATEN_CPU_CAPABILITY=avx2 sharing the default folder
# (/tmp/torchinductor_$USER) with runs without it crashes them (SIGABRT in the first compiled graph
# that meets the other's entries; make test showed it on an AVX-512 machine). A folder set is kept.
# The folders stand beside the compile gate's, outside the clone (tools/gpu_check/compile.py), so a
# fresh clone's make test reads the graphs an earlier clone compiled (Inductor's keys are its own).
COMPILED_CACHE := $(or $(VIT_KERNELS_COMPILED_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/vit_kernels)
export TORCHINDUCTOR_CACHE_DIR ?= $(COMPILED_CACHE)/inductor/$(or $(ATEN_CPU_CAPABILITY),default)
# every pytest stage ends with its slowest tests, so a stage that grows says where
DURATIONS := --durations=15

.PHONY: install lint test-cuda-sim coverage-report demo test test-all test-gpu gpu-session test-integration bench bench-quick bench-gate check-cuda check-gpu check-gpu-all check-triton-oldest selftest gpu-report ci ci-cold nightly clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PYTHON) -c "import site, sysconfig; paths = dict.fromkeys([sysconfig.get_paths()[k] for k in ('purelib', 'platlib')] + site.getsitepackages()); print('\n'.join(paths))" \
		> "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_vit_kernels_parent_env.pth"
	$(PY) -m pip install -q setuptools wheel
	@$(PY) -c "import torch" 2>/dev/null || ! nvidia-smi -L >/dev/null 2>&1 || { \
		echo "make: this machine has an NVIDIA GPU, but $(PYTHON) cannot import torch: install a CUDA build of torch"; \
		echo "      (https://pytorch.org/get-started/locally/), or run make PYTHON=/path/to/python-with-torch"; exit 1; }
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e ".[demo,test,bench,build]"
	touch $(STAMP)

install: $(STAMP)

# ruff (rules and the 110-column line length in pyproject.toml) over the whole tree: an undefined
# name in a branch no CPU test reaches is found here in a second, and code that `ruff format` would
# change fails (run `ruff format` to apply it). ruff is installed on first use, not by `make install`,
# at one version, since another formats differently.
LINT_PATHS := setup.py vit_kernels vit benchmarks tests tools
RUFF_VERSION := 0.17.6
lint: $(STAMP)
	@$(PY) -m ruff --version 2>/dev/null | grep -qx "ruff $(RUFF_VERSION)" || $(PY) -m pip install -q "ruff==$(RUFF_VERSION)"
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m tools.kernel_calls

# A second `make demo` is refused while runs/demo holds the first run: DEMO_ARGS=--overwrite replaces it.
# One thread: as fast as two for this small model on a quiet machine, 3-5x faster on a busy one.
demo: $(STAMP)
	$(PY) -m vit.train --model vit_digits --dataset digits --epochs 200 --backend auto --threads 1 --out runs/demo $(DEMO_ARGS)

# Triton kernels run on the CPU through the interpreter; `slow` sweeps are left to `make test-all`,
# and so is the rest of a `pairwise` grid's product (make test runs a subset covering every pair of
# its parameter values: tests/covering.py). Tests marked `aot` compile kernels for real GPU targets,
# which needs Triton's compiler rather than its interpreter: they run in a second pytest process
# without TRITON_INTERPRET, each variant compiled once into the folder check-gpu keeps. The CUDA
# cases (marker `gpu`) are `make test-gpu`'s.
# TEST_WORKERS pytest-xdist processes (default one per core) run the interpreted stage, each test
# file whole on one of them (--dist loadfile: a file's tests keep their order).
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow and not aot and not gpu" -n $(TEST_WORKERS) --dist loadfile -p no:benchmark \
		$(DURATIONS) $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "aot and not slow" $(DURATIONS) $(PYTEST_ARGS)

# The simulated CUDA device (tests/cuda_sim): the host code of every GPU call, down to the launch,
# on sm_90 and sm_80 devices simulated on this CPU, each recorded launch compiled for its
# architecture (read from the folder check-gpu keeps where it compiled the variant); fails on any
# exception, also one that auto or a tile chooser would have caught. Its coverage of the runtime
# modules is make coverage-report's.
CUDA_SIM_OUT ?= build/cuda-sim
test-cuda-sim: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m pytest -q -p no:cacheprovider tests/cuda_sim $(DURATIONS) $(PYTEST_ARGS)

# The committed coverage report, benchmarks/results/cuda-sim-coverage.md: the simulated device's
# coverage (its tests without the compile of their launches, which runs no runtime line), each line
# it leaves unrun explained by the code around it or by the coverage of make test's first stage and
# of make test-integration, both measured here (about 25 minutes on 2 cores).
coverage-report: $(STAMP) $(INT_STAMP)
	mkdir -p build/cpu-suite build/integration $(CUDA_SIM_OUT)
	TRITON_INTERPRET=1 COVERAGE_FILE=build/cpu-suite/.coverage $(PY) -m coverage run -m pytest -q -p no:cacheprovider \
		-m "not slow and not aot and not gpu" $(PYTEST_ARGS)
	cd tests/integration && TRITON_INTERPRET=1 COVERAGE_FILE=$(abspath build/integration/.coverage) ../../$(INT_PY) \
		-m coverage run --source=vit_kernels -m $(INT_PYTEST) --ignore=$(INT_FAKE_CUDA) .
	env -u TRITON_INTERPRET COVERAGE_FILE=$(CUDA_SIM_OUT)/.coverage $(PY) -m coverage run -m pytest -q -p no:cacheprovider \
		tests/cuda_sim --deselect tests/cuda_sim/test_recorded_launches.py
	COVERAGE_FILE=$(CUDA_SIM_OUT)/.coverage $(PY) -m tests.cuda_sim.coverage_report \
		--out benchmarks/results/cuda-sim-coverage.md --cpu-suite build/cpu-suite/.coverage \
		--integration build/integration/.coverage

test-all: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not aot and not gpu" $(DURATIONS) $(PYTEST_ARGS)
	$(PY) -m pytest -q -m aot $(DURATIONS) $(PYTEST_ARGS)

# The CUDA cases of every op test file and every tile of every tile table, with
# Triton compiled for the device (no TRITON_INTERPRET). Collecting none is an error (pytest exits 5);
# without a GPU it confirms what it collects, says so and passes. The default tiles run first, on their own (HEADLINE of tools/gpu_tests.py), then the tile tables and the
# files the GPU runs found wrong (FIRST, as in the GPU report) and the rest; with
# pytest-xdist installed, GPU_TEST_WORKERS processes (tools/gpu_tests.py, default one per core, 8 to 16) share the GPU
# (compiling the kernels is most of the time), each test's CUDA faults staying its own (tests/conftest.py).
GPU_TEST_PARTS ?= headline rest
test-gpu: $(STAMP)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		workers=$$($(PY) -c "from tools.gpu_tests import xdist_args; print(*xdist_args())"); \
		ran=0; failed=0; \
		for part in $(GPU_TEST_PARTS); do \
			files=$$($(PY) -c "from tools.gpu_tests import ordered_test_files; print(*ordered_test_files('$$part'))"); \
			echo "env -u TRITON_INTERPRET $(PY) -m pytest -q -m gpu $$workers $(PYTEST_ARGS) $$files"; \
			env -u TRITON_INTERPRET $(PY) -m pytest -q -m gpu $$workers $(PYTEST_ARGS) $$files; code=$$?; \
			case $$code in 0) ran=1;; 5) ;; *) failed=1;; esac; \
		done; \
		if [ $$ran -eq 0 ] && [ $$failed -eq 0 ]; then echo "test-gpu: no gpu test collected (pytest exit 5)"; exit 1; fi; \
		exit $$failed; \
	else \
		out=$$(env -u TRITON_INTERPRET $(PY) -m pytest -q -m gpu --collect-only $(PYTEST_ARGS)); code=$$?; \
		echo "$$out" | tail -n 1; \
		if [ $$code -ne 0 ]; then echo "test-gpu: collecting the gpu tests failed (pytest exit $$code)"; exit 1; fi; \
		echo "test-gpu: no CUDA device on this machine: the gpu tests were collected, not run"; \
	fi

# A GPU lent for minutes: one command that fits one device call (at most 10 minutes), `make install`
# included: GPU_SESSION_S (540) seconds in all, everything in GPU_SESSION_OUT, each part's files
# written as soon as it ends. In this order: `make install` (the extension's CUDA code built for this
# GPU's architecture alone, unless TORCH_CUDA_ARCH_LIST is set: about 90 s on an H200); the
# end-to-end table with its profile (python -m benchmarks e2e, a budget of GPU_SESSION_E2E_S (300)
# seconds, its files rewritten after every row, stopped 90 s past it); the GPU tests of the tiles
# that run by default (GPU_SESSION_TILES_S); the per-op table (the GPU report's ops section,
# GPU_SESSION_OPS_S: gpu-report.* and ops-<gpu>-<date>.json); then the rest of the GPU tests for the
# seconds left. Tests are stopped by SIGINT so that pytest still prints its summary, each test's
# outcome and every failure in full as they happen (outcomes.txt, failures.txt).
GPU_SESSION_OUT ?= build/gpu-session
GPU_SESSION_S ?= 540
GPU_SESSION_E2E_S ?= 300
GPU_SESSION_TILES_S ?= 45
GPU_SESSION_OPS_S ?= 60
gpu-session:
	@mkdir -p $(GPU_SESSION_OUT); rm -f $(GPU_SESSION_OUT)/outcomes.txt $(GPU_SESSION_OUT)/failures.txt; \
	start=$$(date +%s); left() { echo $$(( $(GPU_SESSION_S) - $$(date +%s) + start )); }; \
	arch=$${TORCH_CUDA_ARCH_LIST:-$$($(PYTHON) -c "import torch; print('%d.%d' % torch.cuda.get_device_capability() if torch.cuda.is_available() else '')" 2>/dev/null)}; \
	echo "gpu-session: make install (TORCH_CUDA_ARCH_LIST=$$arch)"; \
	if ! TORCH_CUDA_ARCH_LIST=$$arch $(MAKE) --no-print-directory install > $(GPU_SESSION_OUT)/install.log 2>&1; then \
		tail -n 20 $(GPU_SESSION_OUT)/install.log; exit 1; fi; \
	e2e=$$(( $$(left) - 60 - $(GPU_SESSION_TILES_S) - $(GPU_SESSION_OPS_S) )); \
	[ $$e2e -le $(GPU_SESSION_E2E_S) ] || e2e=$(GPU_SESSION_E2E_S); [ $$e2e -ge 60 ] || e2e=60; \
	echo "gpu-session: python -m benchmarks e2e --budget $$e2e ($$(left) s left)"; \
	env -u TRITON_INTERPRET timeout -s INT -k 20 $$(( e2e + 90 )) \
		$(PY) -m benchmarks e2e --out $(GPU_SESSION_OUT) --budget $$e2e 2> $(GPU_SESSION_OUT)/e2e.log; \
	tail -n 2 $(GPU_SESSION_OUT)/e2e.log; \
	echo "gpu-session: the GPU tests of the default tiles for $(GPU_SESSION_TILES_S) s ($$(left) s left)"; \
	VIT_KERNELS_TEST_LOG_DIR=$(abspath $(GPU_SESSION_OUT)) timeout -s INT -k 15 $(GPU_SESSION_TILES_S) \
		$(MAKE) --no-print-directory test-gpu GPU_TEST_PARTS=headline > $(GPU_SESSION_OUT)/test-gpu-tiles.log 2>&1; \
	tail -n 3 $(GPU_SESSION_OUT)/test-gpu-tiles.log; \
	echo "gpu-session: the per-op table for $(GPU_SESSION_OPS_S) s ($$(left) s left)"; \
	env -u TRITON_INTERPRET timeout -s INT -k 20 $$(( $(GPU_SESSION_OPS_S) + 45 )) \
		$(PY) -m benchmarks.gpu_report --out $(GPU_SESSION_OUT) --total $(GPU_SESSION_OPS_S) \
		--sections ops 2> $(GPU_SESSION_OUT)/gpu-report.log; \
	tail -n 2 $(GPU_SESSION_OUT)/gpu-report.log; \
	tests=$$(( $$(left) - 15 )); \
	if [ $$tests -ge 30 ]; then echo "gpu-session: the rest of the GPU tests for $$tests s"; \
		VIT_KERNELS_TEST_LOG_DIR=$(abspath $(GPU_SESSION_OUT)) timeout -s INT -k 15 $$tests \
			$(MAKE) --no-print-directory test-gpu GPU_TEST_PARTS=rest > $(GPU_SESSION_OUT)/test-gpu.log 2>&1; \
		tail -n 3 $(GPU_SESSION_OUT)/test-gpu.log; fi; \
	echo "gpu-session: done in $$(( $$(date +%s) - start )) s"

# The drop-in layers against the real timm, transformers and torchvision, in an environment of their
# own (pins in tests/integration/requirements.txt: a matching torch/torchvision pair). The project is
# installed there as a wheel (its extension built CPU-only), so the tree's extension, built for the
# main venv's torch, stays untouched; --import-mode=importlib keeps the tree off sys.path.

$(INT_STAMP): pyproject.toml setup.py tests/integration/requirements.txt $(INT_SOURCES)
	test -x $(INT_PY) || $(PYTHON) -m venv $(INT_VENV)
	$(INT_PY) -m pip install -q -r tests/integration/requirements.txt
	VIT_KERNELS_CUDA=0 $(INT_PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall .
	touch $(INT_STAMP)

# The fake-CUDA compile tests trace Triton ops as a GPU user's process does, with Triton's compiler
# (not its interpreter, which TRITON_INTERPRET, read at import, would put under every kernel): a run apart.
INT_PYTEST := pytest -q -p no:cacheprovider --import-mode=importlib --rootdir=. -c pytest.ini
INT_FAKE_CUDA := test_compile_fake_cuda.py
test-integration: $(INT_STAMP)
	cd tests/integration && TRITON_INTERPRET=1 ../../$(INT_VENV)/bin/$(INT_PYTEST) --ignore=$(INT_FAKE_CUDA) . \
		$(DURATIONS) $(PYTEST_ARGS)
	cd tests/integration && env -u TRITON_INTERPRET ../../$(INT_VENV)/bin/$(INT_PYTEST) $(INT_FAKE_CUDA) \
		$(DURATIONS) $(PYTEST_ARGS)

# Benchmarks: the full suite (on the GPU when there is one), and the CPU smoke run that CI makes.
BENCH_OUT ?= build/bench
bench: $(STAMP)
	$(PY) -m benchmarks --out $(BENCH_OUT)/results.json --markdown $(BENCH_OUT)/results.md --plots $(BENCH_OUT)/plots

bench-quick: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m benchmarks --quick --out $(BENCH_OUT)/quick.json --markdown $(BENCH_OUT)/quick.md \
		--plots $(BENCH_OUT)/plots > /dev/null
	$(PY) -m benchmarks e2e --quick --out $(BENCH_OUT)/e2e --budget 300 > /dev/null

# The regression gate: the working tree against BENCH_BASELINE, both timed in alternating rounds.
# Exit 1 (a regression) fails; 3 (inconclusive: noise too high within the budget) is reported only.
BENCH_BASELINE ?= HEAD
BENCH_GATE_ARGS ?= --budget 300
bench-gate: $(STAMP)
	$(PY) -m benchmarks ab --baseline $(BENCH_BASELINE) --out $(BENCH_OUT)/ab.json $(BENCH_GATE_ARGS); \
	code=$$?; if [ $$code -eq 3 ]; then echo "bench-gate: inconclusive, not failing"; exit 0; fi; exit $$code

# The GPU compile gate, without a GPU. check-gpu: every Triton kernel variant a first call launches
# on CUDA (the tables' tiles; with dropout, every attention candidate) compiled ahead of time for
# sm_80 and sm_90, failing on a compile error, spills, shared memory over the limit, grids over
# CUDA's limits or int32 index overflow; GPU_CHECK_ARGS=--every-tile adds every candidate of every
# tile table, as vk.tune searches them (1,126 sm_90 variants where the tables' tiles are 398);
# check-gpu-all: the full sweep (every precision and flag, batch 1 to 16,384, every tile). What each
# variant's compile found is kept outside the clone, in ~/.cache/vit_kernels/compiled-triton<version>-
# ptxas<version>/ (VIT_KERNELS_COMPILED_CACHE replaces ~/.cache/vit_kernels), by everything that
# decides the compiled code: a second run, of this clone or another, compiles only the variants a
# kernel edit changed; make test-cuda-sim and the aot tests read the same folder. Each run prints
# how many variants it compiled, found there, and skipped as duplicates.
GPU_CHECK_OUT ?= build/check-gpu
GPU_CHECK_TARGETS ?= 80,90
check-gpu: $(STAMP)
	$(PY) -m tools.gpu_check --targets $(GPU_CHECK_TARGETS) --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

check-gpu-all: $(STAMP)
	$(PY) -m tools.gpu_check --all --out $(GPU_CHECK_OUT)-all

# The oldest Triton the package supports (3.6.0, the version on the GPUs measured so far), on this
# CPU: every kernel variant check-gpu compiles, compiled for sm_90 by that Triton and its ptxas; then
# make test's interpreted stage and the simulated device under it. Its own environment, torch
# 2.13.0's CPU wheel beside it; the tree's extension is the one make install built, for that torch.
# numpy below 2.4: Triton 3.6's interpreter turns a loop bound into an int from a 1-element array,
# which numpy 2.4 refuses (every kernel with a computed loop bound fails interpreted; compiled
# kernels are not concerned).
OLDEST_TRITON := 3.6.0
OLDEST_VENV := .venv-triton-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
check-triton-oldest: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(None if torch.__version__.startswith('2.13.0') else \
		'check-triton-oldest: the extension in the tree is built for torch ' + torch.__version__ + ', not 2.13.0')"
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q torch==2.13.0 triton==$(OLDEST_TRITON) "numpy>=1.26,<2.4" safetensors tqdm \
		"pytest>=8" "pytest-xdist>=3" "hypothesis>=6.100" scikit-learn pillow matplotlib
	PYTHONPATH=. $(OLDEST_PY) -m tools.gpu_check --targets 90 --out $(GPU_CHECK_OUT)-triton$(OLDEST_TRITON)
	TRITON_INTERPRET=1 PYTHONPATH=. $(OLDEST_PY) -m pytest -q -m "not slow and not aot and not gpu" -n $(TEST_WORKERS) \
		--dist loadfile -p no:benchmark -p no:cacheprovider $(DURATIONS) $(PYTEST_ARGS)
	env -u TRITON_INTERPRET PYTHONPATH=. $(OLDEST_PY) -m pytest -q -p no:cacheprovider tests/cuda_sim $(DURATIONS) $(PYTEST_ARGS)

# What a user with a GPU runs first: the CUDA tests and a short benchmark on their device, one
# results file to attach to a report. Without a GPU: the CPU checks, and a clear note.
selftest: $(STAMP)
	$(PY) -m vit_kernels.selftest

# Everything measured on one GPU in one command (at most ~8 minutes on an H100, each section
# time-boxed): the GPU tests, the selftest, per-op timings against PyTorch, SDPA and
# torch.compile, host cost per call, CUDA-graph capture, the issues' per-op targets. Writes
# $(GPU_REPORT_OUT)/gpu-report.json and .md. Triton compiled for the device, never interpreted.
# Without a GPU: the CPU part, and a clear note. GPU_REPORT_ARGS: e.g. --total 1200 for more time.
GPU_REPORT_OUT ?= build/gpu-report
GPU_REPORT_ARGS ?=
gpu-report: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m benchmarks.gpu_report --out $(GPU_REPORT_OUT) $(GPU_REPORT_ARGS)

# Compile every CUDA source for sm_80 and sm_90 against torch's headers with torch's own nvcc
# flags and -Xptxas -v, then fail on spills or shared memory over the limit, so a CUDA compile
# error or a spilling kernel fails CI on a machine without a GPU. Each ptxas report is kept in the
# compiled folder outside the clone, keyed by the source, csrc's headers, the flags and the nvcc and
# torch versions (tools/gpu_check/nvcc_cached.py): a fresh clone reads what an earlier one
# compiled. A CPU-only torch lacks one generated header, c10/cuda/impl/cuda_cmake_macros.h: a
# one-line stand-in is searched after torch's own include dirs.
CUDA_SOURCES := $(wildcard csrc/cuda/*.cu)
CUDA_CHECK_DIR := build/check-cuda
CUDA_LOGS := $(patsubst csrc/cuda/%.cu,$(CUDA_CHECK_DIR)/%.ptxas.log,$(CUDA_SOURCES))
NVCC ?= nvcc
NVCC_FLAGS := -std=c++20 -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -Xptxas -v \
	-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -DVIT_KERNELS_WITH_CUDA=1

check-cuda: $(CUDA_LOGS)
	$(PY) -m tools.gpu_check.ptxas $(CUDA_LOGS)

$(CUDA_CHECK_DIR)/include/c10/cuda/impl/cuda_cmake_macros.h:
	mkdir -p $(dir $@)
	echo '#define C10_CUDA_BUILD_SHARED_LIBS' > $@

$(CUDA_CHECK_DIR)/%.ptxas.log: csrc/cuda/%.cu $(wildcard csrc/cuda/*.cuh csrc/*.h) $(CUDA_CHECK_DIR)/include/c10/cuda/impl/cuda_cmake_macros.h $(STAMP)
	@command -v $(NVCC) >/dev/null || { echo "check-cuda: $(NVCC) not found (install the CUDA toolkit)"; exit 1; }
	$(PY) -m tools.gpu_check.nvcc_cached $@ -- $(NVCC) $(NVCC_FLAGS) $$($(PY) -c "import sysconfig, torch.utils.cpp_extension as e; \
		print(' '.join(e.COMMON_NVCC_FLAGS + ['-I' + p for p in e.include_paths() + [sysconfig.get_paths()['include']]]))") \
		-I$(CUDA_CHECK_DIR)/include -c $< -o $(@:.ptxas.log=.o)

# CI (.ci/run): every stage timed, a table of the stages' wall times at the end. ci-cold runs it with
# empty compile caches (this project's and Triton's), as on a fresh machine: run it before resolving
# a change to a kernel, and give its time.
ci:
	.ci/run

ci-cold:
	CI_COLD=1 .ci/run

# What CI leaves out, for a night (hours on 2 cores, not timed yet): the full parameter products and
# sweeps (test-all), every Triton variant compiled for sm_80 and sm_90 (check-gpu-all), the oldest
# Triton supported (check-triton-oldest), the coverage report, and a cold CI run. Each runs even
# when an earlier one fails (make -k).
nightly:
	$(MAKE) -k test-all check-gpu-all check-triton-oldest coverage-report ci-cold

clean:
	rm -rf build *.egg-info runs .pytest_cache vit_kernels/_C*.so $(INT_VENV) $(OLDEST_VENV)
