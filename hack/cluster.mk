# Local Kubernetes cluster for tests and the demo (issue 3). Included by the top Makefile.
# Binaries are built from the Go module proxy into ${SFTJOB_CACHE:-~/.cache/sftjob}; versions
# live in hack/versions.env; runtime state goes to .cluster/ (gitignored).

# cluster-down/status work even before the venv exists (they need only the standard library).
CLUSTER_PY = $(if $(wildcard $(PY)),$(PY),python3)

.PHONY: cluster-build cluster-prepare cluster-up cluster-down cluster-status cluster-env

cluster-build: ## Build (or reuse cached) the Kubernetes binaries (kubelet and kube-proxy too), etcd, helm, minio, kwok, CoreDNS
	hack/build-binaries.sh

cluster-prepare: ## Start building the binaries and images in the background (log: .cache/prepare.log); `up` waits for it
	@$(CLUSTER_PY) -m hack.localcluster prepare --background .cache/prepare.log $(PREPARE)

cluster-up: install ## Start the local cluster (control plane, MinIO, CoreDNS, kube-proxy, 2 kubelet+containerd nodes; Kueue with KUEUE=1); no-op when up
	$(PY) -m hack.localcluster up $(if $(filter 1 true yes,$(KUEUE)),--kueue)

cluster-down: ## Stop every cluster process (pods included) and remove .cluster/
	$(CLUSTER_PY) -m hack.localcluster down

cluster-status: ## Report the health of each cluster component
	$(CLUSTER_PY) -m hack.localcluster status

cluster-env: ## Print the shell exports of .cluster/env (KUBECONFIG, AWS_*, PATH)
	@$(CLUSTER_PY) -m hack.localcluster env
