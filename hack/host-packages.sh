#!/usr/bin/env bash
# Install the Debian packages the local cluster's real nodes and `make images` need, when
# missing. Run as root (CI and these machines run as root); otherwise print the command.
#
#   containerd runc containernetworking-plugins   the nodes' container runtime and pod network
#   iptables conntrack                            kube-proxy's Service routing
#   buildah mmdebstrap                            docker-less image builds from Debian packages
#   libtcmalloc-minimal4                          the trainer's allocator when it runs here (the
#                                                 tests, make bench), as in its image
set -euo pipefail

declare -A need=(
  [containerd]=containerd [ctr]=containerd [runc]=runc [iptables]=iptables
  [conntrack]=conntrack [buildah]=buildah [mmdebstrap]=mmdebstrap
)
missing=()
for cmd in "${!need[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${need[$cmd]}")
done
[[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
/sbin/ldconfig -p | grep libtcmalloc_minimal.so.4 >/dev/null || missing+=(libtcmalloc-minimal4)
[[ ${#missing[@]} -eq 0 ]] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if [[ $(id -u) -ne 0 ]]; then
  echo "the local cluster needs these Debian packages; as root run:" >&2
  echo "  apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "[host-packages] installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || {
  apt-get update -qq && apt-get install -y -qq "${missing[@]}"
}
