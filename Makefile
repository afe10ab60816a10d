# sftjob: the verbs a newcomer uses. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help install lint-install lint test test-unit demo clean

help: ## List the make targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  \033[1m%-18s\033[0m %s\n", $$1, $$2}'

# pip is quiet and a cold install is GBs of wheels (torch): a line every 30 s says how far it is
# and where the background build of the cluster stands (issue 29: never silent for a minute).
BEAT = $(PYTHON) -m hack.localcluster beat --venv $(VENV) --what

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(BEAT) "installing .venv: pip, setuptools, wheel" -- $(PY) -m pip install -q --upgrade pip setuptools wheel
	$(BEAT) "installing .venv: the trainer, operator and dev extras (torch: GBs when cold)" -- \
		$(PY) -m pip install -q -e '.[trainer,operator,dev]'
	@touch $@

install: $(VENV)/.installed ## Create/update .venv with the trainer, operator and dev dependencies

# ruff and mypy, pinned apart from pyproject.toml (whose content keys the trainer image's layers).
$(VENV)/.lint-installed: requirements-lint.txt $(VENV)/.installed
	$(PY) -m pip install -q -r requirements-lint.txt
	@touch $@

lint-install: $(VENV)/.lint-installed ## Install ruff, mypy and the stubs (requirements-lint.txt) into .venv

lint: lint-install ## Run ruff and mypy
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy

# A passing run removes its temporary directories (the suite writes GBs of checkpoints, models
# and cluster state); a failing run keeps those of its failed tests to read. Set here, not in
# pyproject.toml, whose content keys the images' layers. CI shares one disk with the binary cache.
PYTEST_OPTS := -o tmp_path_retention_policy=failed

# The cluster tests need every binary, Kueue's included; they build while the venv installs.
test: PREPARE = k8s etcd helm minio kwok coredns kueue netpol
test: cluster-prepare install checkov-install lint-install ## Run the whole test suite (unit, distributed, cluster)
	$(PY) -m pytest tests $(PYTEST_OPTS) $(PYTEST_ARGS)

test-unit: install checkov-install lint-install ## Run only the fast tests (no torchrun, no cluster)
	$(PY) -m pytest tests -m "unit" $(PYTEST_OPTS) $(PYTEST_ARGS)

-include hack/cluster.mk
-include operator/operator.mk
-include charts/chart.mk
-include bench/bench.mk
-include hack/chaos.mk

demo: cluster-prepare install ## End to end: local cluster, Helm chart, SFTJob preempted and resumed, model from S3, Prometheus (DEMO_STEPS=N: shorter)
	OMP_NUM_THREADS=1 $(PY) -m demo.run

clean: ## Remove local run outputs (.demo, caches); keeps .venv and the binary cache
	rm -rf .demo .pytest_cache

train-local: install ## Train the tiny model on this machine only (2 processes, no cluster); prints where the model went
	$(PY) -m tools.assets .demo/assets
	OMP_NUM_THREADS=1 $(PY) -m sftjob_trainer.launch --standalone --nproc-per-node=2 -- --config examples/trainer-local.yaml
