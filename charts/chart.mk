# Helm chart, images and their checks (issue 6). Included by the top Makefile:
#   -include charts/chart.mk
# Uses $(PY), $(VENV) and the `install` target of the top Makefile. helm is the one
# hack/build-binaries.sh builds (version in hack/versions.env); checkov lives in its own
# virtual environment next to it, because installed into .venv it would downgrade packages
# the trainer uses (boto3, packaging).

SFTJOB_CACHE ?= $(HOME)/.cache/sftjob
HELM_VERSION := $(shell sed -n 's/^HELM_VERSION=//p' hack/versions.env)
HELM := $(SFTJOB_CACHE)/helm-$(HELM_VERSION)/bin/helm
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV := $(SFTJOB_CACHE)/checkov-$(CHECKOV_VERSION)
CHECKOV := $(CHECKOV_VENV)/bin/checkov
CHART := charts/sftjob-operator
IMAGE_REGISTRY ?= ghcr.io/sftjob
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' $(CHART)/Chart.yaml)
OPERATOR_IMAGE := $(IMAGE_REGISTRY)/operator:$(IMAGE_TAG)
TRAINER_IMAGE := $(IMAGE_REGISTRY)/trainer:$(IMAGE_TAG)
KIND_CLUSTER ?= sftjob
KIND_CTX := kind-$(KIND_CLUSTER)

.PHONY: chart-lint chart-scan chart-test chart-test-cluster checkov-install images kind-e2e

$(HELM):
	hack/build-binaries.sh helm

$(CHECKOV):
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==$(CHECKOV_VERSION)

checkov-install: $(CHECKOV) ## Install checkov into its own venv under ~/.cache/sftjob (the chart tests need it)

chart-lint: install $(HELM) ## helm lint --strict the chart; hadolint both Dockerfiles
	$(HELM) lint --strict $(CHART)
	$(VENV)/bin/hadolint images/operator/Dockerfile images/trainer/Dockerfile

chart-scan: $(HELM) $(CHECKOV) ## checkov on the rendered chart and both Dockerfiles (skips: charts/checkov.yaml)
	@out=$$(mktemp -d); trap 'rm -rf $$out' EXIT; \
	$(HELM) template sftjob $(CHART) -n sftjob-system > $$out/default.yaml && \
	$(HELM) template sftjob $(CHART) -n sftjob-system --set 'watchNamespaces={team-a}' --set dashboard.enabled=true > $$out/namespaced.yaml && \
	$(CHECKOV) --config-file charts/checkov.yaml --quiet --framework kubernetes -d $$out && \
	$(CHECKOV) --config-file charts/checkov.yaml --quiet --framework dockerfile -f images/operator/Dockerfile -f images/trainer/Dockerfile

chart-test: install $(HELM) $(CHECKOV) ## Chart unit tests: lint, schema typos, CRD drift, RBAC table, hadolint, checkov
	$(PY) -m pytest tests/chart -m unit $(PYTEST_OPTS) $(PYTEST_ARGS)

chart-test-cluster: install ## Chart on the local cluster: install, example to Succeeded, upgrade, uninstall, RBAC
	$(PY) -m pytest tests/chart -m cluster $(PYTEST_OPTS) $(PYTEST_ARGS)

# With a docker engine: docker build, the published bases. Without one (this project's
# machines): hack/localcluster/images/ builds the base, pause, operator and trainer images
# with buildah on a Debian base made here (CPU trainer, no flash-attn) and caches them as
# archives under $(SFTJOB_CACHE)/images (images/README.md).
images: ## Build the operator and trainer images: docker build if a docker engine answers, else buildah here (images/README.md)
	@if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then \
	  set -x; \
	  docker build -f images/operator/Dockerfile -t $(OPERATOR_IMAGE) . && \
	  docker build -f images/trainer/Dockerfile -t $(TRAINER_IMAGE) .; \
	else \
	  echo "no docker engine answers: building with buildah (hack/localcluster/images)"; \
	  SFTJOB_CACHE=$(SFTJOB_CACHE) $(PYTHON) -m hack.localcluster.images --operator-image $(OPERATOR_IMAGE) --trainer-image $(TRAINER_IMAGE) build; \
	fi

# Not runnable on the project's own machines (no docker): kind cluster, images, chart, MinIO,
# the example's assets, the example, and a wait for Succeeded. Needs docker, kind, kubectl, helm.
kind-e2e: images install ## (needs docker+kind) kind cluster, load images, install the chart, run examples/sftjob.yaml
	kind get clusters | grep -qx $(KIND_CLUSTER) || kind create cluster --name $(KIND_CLUSTER) --wait 120s
	kind load docker-image --name $(KIND_CLUSTER) $(OPERATOR_IMAGE) $(TRAINER_IMAGE)
	helm --kube-context $(KIND_CTX) upgrade --install sftjob $(CHART) -n sftjob-system --create-namespace \
	  --set image.tag=$(IMAGE_TAG) --set image.repository=$(IMAGE_REGISTRY)/operator \
	  --set trainer.image=$(TRAINER_IMAGE) --wait --timeout 5m
	kubectl --context $(KIND_CTX) apply -f charts/kind/minio.yaml
	kubectl --context $(KIND_CTX) -n sftjob-demo rollout status deployment/minio --timeout=5m
	@# The example's assets are made here (tools/ does not ship in the trainer image) and uploaded
	@# through a port-forward, with the credentials read from the Secret minio.yaml made.
	kubectl --context $(KIND_CTX) -n sftjob-demo port-forward svc/minio 19000:9000 >/dev/null & pf=$$!; \
	  trap 'kill $$pf' EXIT; sleep 3; \
	  key() { kubectl --context $(KIND_CTX) -n sftjob-demo get secret sftjob-s3 -o jsonpath="{.data.$$1}" | base64 -d; }; \
	  AWS_ENDPOINT_URL=http://127.0.0.1:19000 AWS_REGION=us-east-1 \
	  AWS_ACCESS_KEY_ID="$$(key AWS_ACCESS_KEY_ID)" AWS_SECRET_ACCESS_KEY="$$(key AWS_SECRET_ACCESS_KEY)" \
	  $(PY) -c 'from pathlib import Path; from examples import assets as a; a.upload(a.make_local_assets(Path(".assets/tiny")))'
	sed 's#http://10.244.0.1:9000#http://minio.sftjob-demo:9000#' examples/sftjob.yaml \
	  | kubectl --context $(KIND_CTX) -n sftjob-demo apply -f -
	kubectl --context $(KIND_CTX) -n sftjob-demo wait --for=jsonpath='{.status.phase}'=Succeeded sftjob/tiny-lora --timeout=30m
	kubectl --context $(KIND_CTX) -n sftjob-demo get sft tiny-lora
