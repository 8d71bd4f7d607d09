# Two commands from a fresh clone: `make demo` (train the digits ViT) and `make test`.
# Both create .venv on first use. torch==2.13.0 (CPU wheel) is installed only where no torch is
# importable: the venv sees the system's packages, so an existing CUDA torch is reused.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-all test-integration bench bench-quick check-cuda clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e ".[demo,test,bench,build]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m vit.train --model vit_digits --dataset digits --epochs 200 --backend auto --out runs/demo

# Triton kernels run on the CPU through the interpreter; `slow` sweeps are left to `make test-all`.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# The drop-in layers against the real timm, transformers and torchvision, in an environment of their
# own (pins in tests/integration/requirements.txt: a matching torch/torchvision pair). The project is
# installed there as a wheel (its extension built CPU-only), so the tree's extension, built for the
# main venv's torch, stays untouched; --import-mode=importlib keeps the tree off sys.path.
INT_VENV := .venv-integration
INT_PY := $(INT_VENV)/bin/python
INT_STAMP := $(INT_VENV)/.installed
INT_SOURCES := $(shell find vit_kernels vit -name '*.py') $(wildcard csrc/*.cpp csrc/*.h)

$(INT_STAMP): pyproject.toml setup.py tests/integration/requirements.txt $(INT_SOURCES)
	test -x $(INT_PY) || $(PYTHON) -m venv $(INT_VENV)
	$(INT_PY) -m pip install -q -r tests/integration/requirements.txt
	VIT_KERNELS_CUDA=0 $(INT_PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall .
	touch $(INT_STAMP)

test-integration: $(INT_STAMP)
	cd tests/integration && ../../$(INT_VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib \
		--rootdir=. -c pytest.ini . $(PYTEST_ARGS)

# Benchmarks: the full suite (on the GPU when there is one), and the CPU smoke run that CI makes,
# which also runs the regression gate over its own results.
BENCH_OUT ?= build/bench
bench: $(STAMP)
	$(PY) -m benchmarks --out $(BENCH_OUT)/results.json --markdown $(BENCH_OUT)/results.md --plots $(BENCH_OUT)/plots

bench-quick: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m benchmarks --quick --out $(BENCH_OUT)/quick.json --markdown $(BENCH_OUT)/quick.md \
		--plots $(BENCH_OUT)/plots > /dev/null
	$(PY) -m benchmarks --compare $(BENCH_OUT)/quick.json --results $(BENCH_OUT)/quick.json --threshold 0.05 | tail -1

# Compile every CUDA source for sm_90 against torch's headers with torch's own nvcc flags (object
# files only), so a CUDA compile error fails CI on a machine without a GPU. A CPU-only torch lacks one generated header,
# c10/cuda/impl/cuda_cmake_macros.h: a one-line stand-in is searched after torch's own include dirs.
CUDA_SOURCES := $(wildcard csrc/cuda/*.cu)
CUDA_CHECK_DIR := build/check-cuda
CUDA_OBJECTS := $(patsubst csrc/cuda/%.cu,$(CUDA_CHECK_DIR)/%.o,$(CUDA_SOURCES))
NVCC ?= nvcc
NVCC_FLAGS := -std=c++20 -O2 -arch=sm_90 -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -DVIT_KERNELS_WITH_CUDA=1

check-cuda: $(CUDA_OBJECTS)
	@echo "check-cuda: compiled $(words $(CUDA_OBJECTS)) CUDA sources for sm_90"

$(CUDA_CHECK_DIR)/include/c10/cuda/impl/cuda_cmake_macros.h:
	mkdir -p $(dir $@)
	echo '#define C10_CUDA_BUILD_SHARED_LIBS' > $@

$(CUDA_CHECK_DIR)/%.o: csrc/cuda/%.cu $(wildcard csrc/cuda/*.cuh csrc/*.h) $(CUDA_CHECK_DIR)/include/c10/cuda/impl/cuda_cmake_macros.h $(STAMP)
	@command -v $(NVCC) >/dev/null || { echo "check-cuda: $(NVCC) not found (install the CUDA toolkit)"; exit 1; }
	$(NVCC) $(NVCC_FLAGS) $$($(PY) -c "import sysconfig, torch.utils.cpp_extension as e; \
		print(' '.join(e.COMMON_NVCC_FLAGS + ['-I' + p for p in e.include_paths() + [sysconfig.get_paths()['include']]]))") \
		-I$(CUDA_CHECK_DIR)/include -c $< -o $@

clean:
	rm -rf build *.egg-info runs .pytest_cache vit_kernels/_C*.so $(INT_VENV)
