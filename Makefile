# Two commands for a new user: `make demo` and `make test`. Each creates .venv and installs
# what it needs: the pinned CPU torch wheel first (an unpinned torch would pull a multi-GB CUDA
# build), then the project with its dev extra.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

.PHONY: install demo test serve gpu-report
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/canary demo

test: $(VENV)/.installed
	$(PY) -m pytest

serve: $(VENV)/.installed
	$(VENV)/bin/canary serve

# The GPU report (README "GPU report"): the kernel tests on CUDA plus benchmarks/kernels.py, one
# JSON object. No .venv needed: it runs on .venv's python when there is one, else python3 (a GPU
# image with torch, Triton, transformers and pytest); `make gpu-report PY=python3` picks one.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
BENCH_ARGS ?=

gpu-report:
	@$(GPU_PY) benchmarks/gpu_report.py $(BENCH_ARGS)
