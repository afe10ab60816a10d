"""The cluster's components, one place for each fact about them: start order, command
lines, the ports they listen on, how their health is checked, and starting one (detached, see
proc.py) with a record of its configuration so that a stale one is noticed."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import time
import urllib.request
from pathlib import Path

from . import config as C
from . import proc
from . import realnodes as R
from .kube import Kube
from .proc import log, sh

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "minio", "coredns")


def components(cfg: C.ClusterConfig) -> tuple[str, ...]:
    """Start order (stop order is the reverse): the control plane, every node's containerd (so
    that the images go into all of them at once), every node's kubelet, then kube-proxy (which
    waits for the Node it serves to exist)."""
    return (CONTROL_PLANE + tuple(f"{kind}-{i}" for kind in ("containerd", "kubelet") for i in range(len(cfg.nodes)))
            + (("kube-proxy",) if cfg.service_proxy else ()))


# The controllers this cluster needs (names from kube-controller-manager --help): garbage
# collection, namespace deletion, service accounts and their tokens, endpoints for headless
# Services, workload controllers used by Helm charts (Deployment/ReplicaSet/Job), the
# kube-root-ca.crt publisher for projected service-account volumes, PodDisruptionBudget status for
# the Eviction API, NoExecute taint eviction and pod garbage collection for node loss, and
# ResourceQuota usage (without it a quota's admission refuses every pod: "status unknown").
KCM_CONTROLLERS = ",".join([
    "garbage-collector-controller", "namespace-controller", "serviceaccount-controller",
    "serviceaccount-token-controller", "endpoints-controller", "endpointslice-controller",
    "endpointslice-mirroring-controller", "job-controller", "replicaset-controller",
    "deployment-controller", "statefulset-controller", "ttl-after-finished-controller",
    "root-ca-certificate-publisher-controller", "disruption-controller",
    "taint-eviction-controller", "pod-garbage-collector-controller",
    # the built-in admin/edit/view ClusterRoles are assembled by aggregation
    "clusterrole-aggregation-controller",
    "resourcequota-controller",
    # Ready=Unknown and the unreachable taints when a kubelet stops posting status
    "node-lifecycle-controller",
])


def kube_bin(name: str) -> str:
    return str(C.bin_dir("k8s") / name)


def _ports(cfg: C.ClusterConfig, name: str) -> list[tuple[str, int, int]]:
    """(address, port, socket type) that a component listens on."""
    tcp, udp = socket.SOCK_STREAM, socket.SOCK_DGRAM
    if name.startswith("kubelet-"):
        ip = R.node_ip(cfg, R.node_index(name))
        return [(ip, cfg.kubelet_port, tcp), (ip, 10248, tcp)]
    return {
        "etcd": [("127.0.0.1", cfg.etcd_port, tcp), ("127.0.0.1", cfg.etcd_peer_port, tcp)],
        "kube-apiserver": [(cfg.host_ip, cfg.apiserver_port, tcp)],
        "kube-controller-manager": [("127.0.0.1", cfg.kcm_port, tcp)],
        "kube-scheduler": [("127.0.0.1", cfg.scheduler_port, tcp)],
        "minio": [(cfg.host_ip, cfg.minio_port, tcp), ("127.0.0.1", cfg.minio_port + 1, tcp)],
        "coredns": [(cfg.host_ip, 53, udp), (cfg.host_ip, 53, tcp), ("127.0.0.1", cfg.dns_health_port, tcp),
                    ("127.0.0.1", cfg.dns_health_port + 1, tcp)],
        "kube-proxy": [("127.0.0.1", cfg.kube_proxy_port, tcp), ("127.0.0.1", cfg.kube_proxy_metrics_port, tcp)],
    }.get(name, [])


def refuse_taken_ports(cfg: C.ClusterConfig, name: str) -> None:
    """Refuse to start a component whose port is taken. Otherwise it would die at once and, worse,
    its clients would talk to whatever holds the port (an API server writing into someone
    else's etcd, say)."""
    for host, port, kind in _ports(cfg, name):
        with socket.socket(socket.AF_INET, kind) as s:
            # As the components' own listeners do: connections of a just-stopped cluster
            # lingering in TIME_WAIT do not hold the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise RuntimeError(f"cannot start {name}: {host}:{port} is in use ({e.strerror}); stop whatever "
                                   "holds it or choose other ports (see hack/localcluster/config.py)") from None


def start(cfg: C.ClusterConfig, name: str, argv: list[str], env: dict | None = None, check_ports: bool = True) -> None:
    """Start a component detached and record what it was started with. check_ports=False
    skips the free-port check (a just-stopped MinIO's connections linger in TIME_WAIT, which a
    plain bind() test mistakes for a taken port, while MinIO itself binds with SO_REUSEADDR)."""
    if check_ports:
        refuse_taken_ports(cfg, name)
    pid = proc.spawn(cfg, name, argv, env)
    (cfg.pids / f"{name}.config").write_text(fingerprint(cfg, name, argv))
    log(f"started {name} (pid {pid}, log {cfg.logs / f'{name}.log'})")


def fingerprint(cfg: C.ClusterConfig, name: str, argv: list[str]) -> str:
    """What a component was started with: its command line and the configuration files this
    code writes for it, so that a long-running cluster started by older code is noticed."""
    h = hashlib.sha256(json.dumps(argv).encode())
    h.update(R.config_text(cfg, name).encode())
    return h.hexdigest()


def start_component(cfg: C.ClusterConfig, name: str, timeout: float = 120) -> None:
    """Start one stopped component with the configuration `up` uses and wait until healthy."""
    if not proc.alive(proc.read_pid(cfg, name), proc.marker(cfg, name)):
        argv, e = command(cfg, name, json.loads(cfg.secrets_file.read_text()))
        start(cfg, name, argv, e)
    wait(cfg, name, timeout)


def _https_ok(url: str, cafile: Path | None = None, token: str | None = None) -> bool:
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else ssl._create_unverified_context()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=3) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - any failure (refused, TLS, timeout, HTTP error) is 'not healthy'
        return False


def healthy(cfg: C.ClusterConfig, name: str) -> bool:
    if not proc.alive(proc.read_pid(cfg, name), proc.marker(cfg, name)):
        return False
    if name == "etcd":
        # serializable: a local read, so a busy machine does not make a healthy etcd look down
        return _https_ok(f"http://127.0.0.1:{cfg.etcd_port}/health?serializable=true")
    if name == "kube-apiserver":
        return _https_ok(f"{cfg.apiserver_url}/readyz", cfg.pki / "ca.crt")
    if name == "kube-controller-manager":
        return _https_ok(f"https://127.0.0.1:{cfg.kcm_port}/healthz")
    if name == "kube-scheduler":
        return _https_ok(f"https://127.0.0.1:{cfg.scheduler_port}/healthz")
    if name == "minio":
        return _https_ok(f"{cfg.s3_endpoint}/minio/health/live")
    if name == "coredns":
        return _https_ok(f"http://127.0.0.1:{cfg.dns_health_port + 1}/ready")
    if name == "kube-proxy":
        # /livez: /healthz also fails while the Node it serves does not exist yet
        return _https_ok(f"http://127.0.0.1:{cfg.kube_proxy_port}/livez")
    if name.startswith("containerd-"):
        return sh(*R.ctr_argv(cfg, R.node_index(name)), "version", check=False).returncode == 0
    if name.startswith("kubelet-"):
        try:
            node = cfg.nodes[R.node_index(name)]
            conds = Kube.from_state(cfg).get(f"/api/v1/nodes/{node}")["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        except Exception:  # noqa: BLE001 - no node yet, an API error: not healthy
            return False
    raise ValueError(name)


def wait(cfg: C.ClusterConfig, name: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if healthy(cfg, name):
            return
        pid = proc.read_pid(cfg, name)
        # Just after the start the process may be between fork and exec, or mid-exec, and
        # show another (or an empty) command line: only a process that is gone ends the wait.
        if not proc.alive(pid, proc.marker(cfg, name)) and not proc.running(pid):
            break
        time.sleep(0.5)
    tail = ""
    logf = cfg.logs / f"{name}.log"
    if logf.exists():
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-30:])
    raise RuntimeError(f"{name} did not become healthy; last log lines:\n{tail}")


def command(cfg: C.ClusterConfig, name: str, sec: dict, write: bool = True) -> tuple[list[str], dict | None]:
    """A component's command line and environment (None: inherit); write: also write the
    configuration files it reads."""
    d, pki, kc = cfg.state_dir, cfg.pki, str(cfg.kubeconfig)
    if name == "etcd":
        peer = f"http://127.0.0.1:{cfg.etcd_peer_port}"
        client = f"http://127.0.0.1:{cfg.etcd_port}"
        return [str(C.bin_dir("etcd") / "etcd"), "--name=sftjob", f"--data-dir={d}/etcd",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=sftjob={peer}",
                # a throwaway test database: durability is not worth the fsync latency
                "--unsafe-no-fsync=true", "--log-level=warn"], None
    if name == "kube-apiserver":
        return [kube_bin("kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{cfg.etcd_port}",
                # The bridge address is a real interface of this host, reachable from the pods,
                # so it serves as both bind and advertise address (a loopback advertise address
                # breaks the `kubernetes` Service endpoint reconciler).
                f"--bind-address={cfg.host_ip}", f"--advertise-address={cfg.host_ip}",
                f"--secure-port={cfg.apiserver_port}",
                f"--tls-cert-file={pki}/apiserver.crt", f"--tls-private-key-file={pki}/apiserver.key",
                f"--client-ca-file={pki}/ca.crt",
                f"--service-cluster-ip-range={R.SERVICE_CIDR}", "--authorization-mode=RBAC",
                f"--token-auth-file={pki}/tokens.csv", "--allow-privileged=true",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki}/sa.key",
                f"--service-account-signing-key-file={pki}/sa.key",
                "--profiling=false", f"--cert-dir={pki}/generated",
                # reach kubelets (logs, exec, port-forward) by the Nodes' InternalIP: their
                # Hostname addresses do not resolve on this host
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
                f"--kubelet-client-key={pki}/apiserver-kubelet-client.key"], None
    if name == "kube-controller-manager":
        return [kube_bin("kube-controller-manager"), f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={cfg.kcm_port}",
                f"--cert-dir={pki}/kcm", f"--controllers={KCM_CONTROLLERS}",
                f"--service-account-private-key-file={pki}/sa.key", f"--root-ca-file={pki}/ca.crt",
                # kubelets renew their lease every 3 s (realnodes/kubelet.py): a stopped one
                # makes its Node NotReady within 20 s
                "--node-monitor-grace-period=20s", "--node-monitor-period=2s"], None
    if name == "kube-scheduler":
        conf = d / "scheduler.yaml"
        if write:
            conf.write_text("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
                            f"clientConnection:\n  kubeconfig: {kc}\nleaderElection:\n  leaderElect: false\n")
        return [kube_bin("kube-scheduler"), f"--config={conf}", "--bind-address=127.0.0.1",
                f"--secure-port={cfg.scheduler_port}", f"--cert-dir={pki}/scheduler",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}"], None
    if name == "minio":
        e = {**os.environ, "MINIO_ROOT_USER": sec["s3_access_key"], "MINIO_ROOT_PASSWORD": sec["s3_secret_key"],
             "MINIO_BROWSER": "off", "MINIO_UPDATE": "off"}
        return [str(C.bin_dir("minio") / "minio"), "server", f"{d}/minio", "--quiet",
                f"--address={cfg.host_ip}:{cfg.minio_port}",
                f"--console-address=127.0.0.1:{cfg.minio_port + 1}"], e
    if name == "coredns":
        if write:
            R.write_cluster_files(cfg)
        return R.coredns_argv(cfg), None
    if name == "kube-proxy":
        if write:
            R.write_cluster_files(cfg)
        return R.kube_proxy_argv(cfg), None
    if name.startswith(("containerd-", "kubelet-")):
        i = R.node_index(name)
        if write:
            R.write_node_files(cfg, i)
        return (R.containerd_argv(cfg, i) if name.startswith("containerd-") else R.kubelet_argv(cfg, i)), None
    raise ValueError(name)
