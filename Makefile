# Quick start: `make demo` (set up + dvc repro on the demo dataset), `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install install-dev demo test lint docs mutation

install: $(VENV)/.installed        # what the demo needs

install-dev: $(VENV)/.installed-dev  # and every extra, with the test tools

$(VENV)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "error: Python >= 3.11 is needed; run e.g. 'make PYTHON=python3.11 $(MAKECMDGOALS)'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	touch $@

demo: install
	dvc repro

test: install-dev  # two workers (pytest-xdist), each test file on one of them
	pytest -n 2 --dist loadfile

lint: install-dev
	ruff check flows features models tests tools benchmarks docs/_hooks

docs: install-dev  # the documentation site into build/site (tests/test_docs.py builds it too)
	mkdocs build --strict

mutation: install-dev  # slow (about an hour on 2 cores), not in CI: tools/mutation.py
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev,mutation]'
	$(BIN)/python tools/mutation.py
