#!/usr/bin/env bash
# Build the local cluster's binaries from the Go module proxy into a version-keyed cache.
#
#   hack/build-binaries.sh [k8s|etcd|helm|minio|kwok|coredns|kueue|health|netpol ...]
#                                                 (default: all but kueue, health and netpol, in that order)
#   hack/build-binaries.sh --print-dirs                     (print NAME=DIR per component)
#
# Each component lands in ${SFTJOB_CACHE:-$HOME/.cache/sftjob}/<name>-<version>/bin and is
# marked complete with a .built stamp written last, so an interrupted build is redone and a
# finished one is never rebuilt. Go's module and build caches (GOMODCACHE/GOCACHE) are private
# to the run, under $CACHE/.go, and removed once every component asked for is built: they
# would keep about 11 GB (Kubernetes' sources and objects) that no later run needs, on a disk
# that must also hold the node images. A failed run keeps them for its retry.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
CACHE="${SFTJOB_CACHE:-$HOME/.cache/sftjob}"

export GOTOOLCHAIN=local   # never download a toolchain behind our back
export CGO_ENABLED=0       # static binaries, as upstream ships them
export GOFLAGS="${GOFLAGS:--buildvcs=false}"
GO_P="${SFTJOB_GO_P:-2}"   # build parallelism: these machines have 2 cores shared by everyone

dir_of() {
  case "$1" in
    k8s) echo "$CACHE/k8s-$K8S_VERSION" ;;
    etcd) echo "$CACHE/etcd-$ETCD_VERSION" ;;
    helm) echo "$CACHE/helm-$HELM_VERSION" ;;
    minio) echo "$CACHE/minio-$MINIO_VERSION" ;;
    kwok) echo "$CACHE/kwok-$KWOK_VERSION" ;;
    kueue) echo "$CACHE/kueue-$KUEUE_VERSION" ;;
    coredns) echo "$CACHE/coredns-$COREDNS_VERSION" ;;
    health|netpol) echo "$CACHE/$1-$(own_version "$1")" ;;
    *) echo "unknown component $1" >&2; return 1 ;;
  esac
}

# This repository's own Go tools (hack/tools/NAME: health, the GitOps health harness; netpol,
# the NetworkPolicy enforcer) are keyed by a hash of their sources (their module versions are
# pinned in their go.mod), so an edit builds a new one. hack/localcluster/config.py
# (own_tool_key) computes the same key.
own_version() {
  (cd "$HERE/tools/$1" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-12)
}

log() { printf '[build-binaries %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# The Kubernetes binaries, control plane and node (kubelet, kube-proxy) alike.
K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)

# The binaries a component's cache must hold (beyond its .built stamp): a cache built before a
# binary joined the list is rebuilt.
binaries_of() {
  case "$1" in
    k8s) echo "${K8S_BINARIES[@]}" ;;
    coredns) echo coredns ;;
    health) echo health ;;
    netpol) echo netpol ;;
  esac
}

# cached NAME: true when NAME's cache is complete.
cached() {
  local d b; d="$(dir_of "$1")"
  [[ -f "$d/.built" ]] || return 1
  for b in $(binaries_of "$1"); do [[ -x "$d/bin/$b" ]] || return 1; done
}

# begin NAME: returns 1 (skip) when NAME is cached, else prepares DIR/src and DIR/bin.tmp.
begin() {
  local d; d="$(dir_of "$1")"
  if cached "$1"; then
    log "$1: cached in $d"
    return 1
  fi
  log "$1: building into $d"
  rm -rf "$d/bin.tmp" "$d/src"
  mkdir -p "$d/src" "$d/bin.tmp"
  START=$SECONDS
}

# finish NAME: publish bin.tmp as bin, then write the stamp (last, so it means "complete").
finish() {
  local d; d="$(dir_of "$1")"
  rm -rf "$d/bin"
  mv "$d/bin.tmp" "$d/bin"
  printf 'built=%s seconds=%s go=%s\n' "$(date -u +%FT%TZ)" "$((SECONDS - START))" "$(go env GOVERSION)" >"$d/.built"
  log "$1: done in $((SECONDS - START))s: $(ls "$d/bin" | tr '\n' ' ')"
}

# The go.mod of k8s.io/kubernetes at K8S_VERSION (downloaded into the module cache).
k8s_gomod() {
  go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p'
}

# A replace block pinning every Kubernetes staging module (k8s.io/api, client-go, ...) to the
# published tag of K8S_VERSION (v0.MINOR.PATCH). k8s.io/kubernetes requires them at v0.0.0 and
# maps them to ./staging with replace lines, which Go ignores in a dependency; the list is read
# from its real go.mod, not hard-coded.
staging_replaces() {
  local p
  echo "replace ("
  for p in $(go mod edit -json "$(k8s_gomod)" | python3 -c '
import json, sys
mod = json.load(sys.stdin)
for r in mod.get("Require") or []:
    p = r["Path"]
    if p.startswith("k8s.io/") and r["Version"] == "v0.0.0":
        print(p)'); do
    echo "	$p => $p v0.${K8S_VERSION#v1.}"
  done
  echo ")"
}

build_k8s() {
  begin k8s || return 0
  local d src minor ver=$K8S_VERSION
  d="$(dir_of k8s)"; src="$d/src"
  minor="$(echo "$ver" | cut -d. -f2)"
  # the staging modules at their published tags (staging_replaces)
  local gomod goline
  gomod="$(k8s_gomod)"
  goline="$(go mod edit -json "$gomod" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Go"])')"
  {
    echo "module local/sftjob-k8s-binaries"
    echo
    echo "go $goline"
    # Go honours only the main module's godebug defaults; use the ones upstream builds with.
    echo "godebug default=go$(echo "$goline" | cut -d. -f1,2)"
    echo
    echo "require k8s.io/kubernetes $ver"
    echo
    echo "tool ("
    for c in "${K8S_BINARIES[@]}"; do echo "	k8s.io/kubernetes/cmd/$c"; done
    echo ")"
    echo
    staging_replaces
  } >"$src/go.mod"
  (cd "$src" && go mod tidy)
  # Stamp the version the way kubernetes' hack/lib/version.sh does: without it the server
  # reports v0.0.0-master+$Format:%H$, kubectl version fails and helm's kubeVersion checks break.
  local ldf="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf+=" -X $pkg.gitVersion=$ver -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldf+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%FT%TZ)"
  done
  (cd "$src" && go build -p "$GO_P" -trimpath -ldflags "$ldf" -o "$d/bin.tmp/" \
    "${K8S_BINARIES[@]/#/k8s.io/kubernetes/cmd/}")
  finish k8s
}

# A wrapper module that has MOD@VER as its only requirement and builds PKG as a tool. Used for
# etcd, whose go.mod has replace lines (so `go install mod@ver` refuses it), and the others for
# uniformity (their own pinned dependency versions are what MVS picks, as with go install).
build_wrapped() {
  local name=$1 mod=$2 ver=$3 pkg=$4 out=$5 ldf=${6:-}
  begin "$name" || return 0
  local d src; d="$(dir_of "$name")"; src="$d/src"
  printf 'module local/sftjob-%s-binary\n\ngo 1.26.0\n\nrequire %s %s\n\ntool %s\n' \
    "$name" "$mod" "$ver" "$pkg" >"$src/go.mod"
  (cd "$src" && go mod tidy)
  (cd "$src" && go build -p "$GO_P" -trimpath -ldflags "-s -w $ldf" -o "$d/bin.tmp/$out" "$pkg")
  finish "$name"
}

build_etcd() {
  build_wrapped etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3 etcd
}

# helm, kwok and CoreDNS are built from one wrapper module, so they share one set of
# dependency versions: MVS over the three, with every Kubernetes staging module pinned to the
# cluster's own release (staging_replaces). client-go, apimachinery, gRPC and the rest then
# compile once for the three instead of once each. Each binary still links only what its main
# package imports. The module is the same whichever of them a run builds, so a binary does not
# depend on what else was missing. (Kueue cannot join: its dependencies need Kubernetes 0.35
# APIs that 0.36 removed.)
TOOLS_DIR="$CACHE/.go/tools"

tools_module() {
  # Reused within a run (and by the retry of a failed one) while its versions are the same.
  local want="helm=$HELM_VERSION kwok=$KWOK_VERSION coredns=$COREDNS_VERSION k8s=$K8S_VERSION"
  [[ "$(cat "$TOOLS_DIR/.ready" 2>/dev/null)" == "$want" ]] && return 0
  rm -rf "$TOOLS_DIR" && mkdir -p "$TOOLS_DIR/coredns"
  {
    printf 'module local/sftjob-cluster-tools\n\ngo 1.26.0\n\nrequire (\n'
    printf '\thelm.sh/helm/v3 %s\n\tsigs.k8s.io/kwok %s\n\tgithub.com/coredns/coredns %s\n)\n\n' \
      "$HELM_VERSION" "$KWOK_VERSION" "$COREDNS_VERSION"
    printf 'tool (\n\thelm.sh/helm/v3/cmd/helm\n\tsigs.k8s.io/kwok/cmd/kwok\n)\n\n'
    staging_replaces
  } >"$TOOLS_DIR/go.mod"
  # Cluster DNS. CoreDNS's own main links every plugin (cloud SDKs included); this one links the
  # few a cluster's DNS needs, in CoreDNS's directive order (bind: two clusters on one machine
  # each answer on their own bridge address).
  cat >"$TOOLS_DIR/coredns/main.go" <<'GO'
// CoreDNS with only the plugins the local cluster's DNS uses.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes", "forward"}
}

func main() { coremain.Run() }
GO
  (cd "$TOOLS_DIR" && go mod tidy)
  echo "$want" >"$TOOLS_DIR/.ready"
}

# build_tool NAME PKG [LDFLAGS]: one binary of the tools module.
build_tool() {
  local name=$1 pkg=$2 ldf=${3:-}
  begin "$name" || return 0
  tools_module
  local d; d="$(dir_of "$name")"
  (cd "$TOOLS_DIR" && go build -p "$GO_P" -trimpath -ldflags "-s -w $ldf" -o "$d/bin.tmp/$name" "$pkg")
  rm -rf "$d/src"
  finish "$name"
}

build_helm() {
  local minor; minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
  # helm v3 falls back to k8s 1.20 for offline `helm template` unless told otherwise, and
  # reports a bare "v3.21" as its own version; stamp both.
  build_tool helm helm.sh/helm/v3/cmd/helm \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
}

build_minio() {
  build_wrapped minio github.com/minio/minio "$MINIO_VERSION" github.com/minio/minio minio
}

build_kwok() {
  build_tool kwok sigs.k8s.io/kwok/cmd/kwok
  # kwok v0.8 ships no default Stages; keep the stock ones next to the binary.
  local d; d="$(dir_of kwok)"
  if [[ ! -d "$d/stage" ]]; then
    cp -r "$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage" "$d/stage.tmp"
    chmod -R u+w "$d/stage.tmp" && mv "$d/stage.tmp" "$d/stage"
  fi
}

# Kueue (optional: `make cluster-up KUEUE=1` and the Kueue tests). Its CRDs and webhook
# manifests are not embedded in the binary; keep the module's copies next to it.
build_kueue() {
  build_wrapped kueue sigs.k8s.io/kueue "$KUEUE_VERSION" sigs.k8s.io/kueue/cmd/kueue kueue \
    "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  local d m; d="$(dir_of kueue)"; m="$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE_VERSION"
  if [[ ! -d "$d/config" ]]; then
    rm -rf "$d/config.tmp" && mkdir -p "$d/config.tmp"
    cp -r "$m/config/components/crd/bases" "$d/config.tmp/crd"
    cp "$m/config/components/webhook/manifests.yaml" "$d/config.tmp/webhook.yaml"
    chmod -R u+w "$d/config.tmp" && mv "$d/config.tmp" "$d/config"
  fi
}

build_coredns() {
  build_tool coredns local/sftjob-cluster-tools/coredns
}

# build_own NAME: one of this repository's own Go tools, hack/tools/NAME, into its cache.
build_own() {
  begin "$1" || return 0
  local d; d="$(dir_of "$1")"
  (cd "$HERE/tools/$1" && go build -mod=readonly -p "$GO_P" -trimpath -ldflags "-s -w" -o "$d/bin.tmp/$1" .)
  rm -rf "$d/src"
  finish "$1"
}

# The test harness for the Argo CD, kstatus and Flux health checks (integrations/); built only
# by the tests that use it (tests/operator/health_kit.py).
build_health() { build_own health; }

# The NetworkPolicy enforcer for the local cluster (hack/localcluster/netpol.py); `make test`
# builds it with the cluster's binaries, for tests/operator/test_network_policy.py.
build_netpol() { build_own netpol; }

if [[ "${1:-}" == "--print-dirs" ]]; then
  for c in k8s etcd helm minio kwok coredns kueue health netpol; do echo "$c=$(dir_of "$c")"; done
  exit 0
fi

components=("$@")
[[ ${#components[@]} -gt 0 ]] || components=(k8s etcd helm minio kwok coredns)
mkdir -p "$CACHE"
# One build at a time per cache: two test sessions starting together must not both write the
# same bin.tmp, and two Go builds at once would only fight over the two cores.
# Everything asked for already built: done, without waiting for another build's lock (a Kueue
# build holds it for ten minutes).
all_cached=1
for c in "${components[@]}"; do cached "$c" || all_cached=0; done
[[ $all_cached == 1 ]] && exit 0
exec 9>"$CACHE/.build.lock"
flock 9
for t in "$CACHE"/.go.removing.*; do   # a background removal that did not finish
  [[ -e $t ]] && { chmod -R u+w "$t" && rm -rf "$t"; } 2>/dev/null || true
done
export GOCACHE="$CACHE/.go/build" GOMODCACHE="$CACHE/.go/mod"
for c in "${components[@]}"; do
  dir_of "$c" >/dev/null
  "build_$c"
done
# Go's caches (about 11 GB) go, but off the critical path: removing them took about 50 s of a
# cold `make demo` while the cluster waited for this lock. The directory is renamed, the lock
# released (the binaries are complete), and the files removed in the background (the module
# files are read-only, hence the chmod); what a killed removal leaves goes at the next build.
# The rename happens under the lock (the next build makes a new .go), the removal after it is
# released (the child must not inherit the lock's descriptor). Nothing to remove when every
# component was built by whoever held the lock before us.
trash=""
if [[ -d "$CACHE/.go" ]]; then
  trash="$CACHE/.go.removing.$$"
  mv "$CACHE/.go" "$trash"
fi
exec 9>&-
if [[ -n "$trash" ]]; then
  nohup bash -c 'chmod -R u+w "$1" && rm -rf "$1"' _ "$trash" >/dev/null 2>&1 &
  log "removing Go's module and build caches in the background ($trash)"
fi
