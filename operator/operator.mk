# SFTJob API and operator (issue 4). Included by the top Makefile: -include operator/operator.mk
# Uses $(PY) and the `install` target from the top Makefile; cluster targets read .cluster/env.

CLUSTER_ENV = set -a; . $(CURDIR)/.cluster/env; set +a
NAMESPACE ?= default

.PHONY: crds crds-install operator-run operator-test operator-test-cluster example-assets

crds: install ## Regenerate the CRD from the pydantic API models, and the generated references in docs/reference/
	$(PY) -m sftjob_operator.crd > crds/.sftjob.io_sftjobs.yaml.tmp && mv crds/.sftjob.io_sftjobs.yaml.tmp crds/sftjob.io_sftjobs.yaml
	$(PY) -m tools.reference --write docs/reference/sftjob.md
	$(PY) -m tools.reference --trainer --write docs/reference/trainer-config.md

crds-install: ## Apply the SFTJob CRD to the local cluster
	@$(CLUSTER_ENV); kubectl apply --server-side -f crds/sftjob.io_sftjobs.yaml

operator-run: crds-install ## Run the operator against the local cluster (all namespaces, foreground)
	@$(CLUSTER_ENV); $(VENV)/bin/sftjob-operator --all-namespaces --metrics-port 8090 --liveness-port 8091

operator-test: install ## Operator unit tests (API/CRD drift, builders, failure policy, reconcile)
	$(PY) -m pytest tests/operator -m unit $(PYTEST_OPTS) $(PYTEST_ARGS)

operator-test-cluster: install ## Operator acceptance tests on the local cluster (starts it if needed)
	$(PY) -m pytest tests/operator -m cluster $(PYTEST_OPTS) $(PYTEST_ARGS)

example-assets: install ## Tiny model+data in the cluster's MinIO and the S3 Secret in NAMESPACE (make example-assets NAMESPACE=demo)
	@$(CLUSTER_ENV); kubectl create namespace $(NAMESPACE) --dry-run=client -o yaml | kubectl apply -f - >/dev/null
	@$(CLUSTER_ENV); $(PY) -m examples.assets --namespace $(NAMESPACE)
