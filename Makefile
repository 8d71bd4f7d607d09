# Two commands from a fresh clone: `make demo` (train the digits ViT) and `make test`.
# Both create .venv on first use. torch==2.13.0 (CPU wheel) is installed only where no torch is
# importable: the venv sees the system's packages, so an existing CUDA torch is reused.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-all clean

$(STAMP): pyproject.toml setup.py
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

clean:
	rm -rf build *.egg-info runs .pytest_cache
