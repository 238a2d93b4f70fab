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

.PHONY: install demo test serve
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/canary demo

test: $(VENV)/.installed
	$(PY) -m pytest

serve: $(VENV)/.installed
	$(VENV)/bin/canary serve
