"""Start, inspect and stop the local cluster: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, MinIO, CoreDNS, kube-proxy and, per node, containerd and a kubelet, all as plain
processes of this machine (realnodes.py configures the node side).

Every component is started detached (its own session, reparented away from the caller) with a
pid file and a log under the state directory, so a cluster started by `make cluster-up` outlives
that command and can be reused by any later test session.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from . import config as C
from . import images
from . import realnodes as R
from .kube import ApiError, Kube

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "minio", "coredns")


def components(cfg: C.ClusterConfig) -> tuple[str, ...]:
    """Start order (stop order is the reverse): the control plane, containerd and the kubelet
    of each node, then kube-proxy (which waits for the Node it serves to exist)."""
    return (CONTROL_PLANE + tuple(f"{kind}-{i}" for i in range(len(cfg.nodes)) for kind in ("containerd", "kubelet"))
            + (("kube-proxy",) if cfg.service_proxy else ()))


def _node_index(name: str) -> int:
    return int(name.rsplit("-", 1)[1])

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


def log(msg: str) -> None:
    print(f"[localcluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# binaries


def ensure_binaries(components=("k8s", "etcd", "helm", "minio", "kwok", "coredns")) -> None:
    """Build what is missing from the cache (build-binaries.sh knows what a complete cache
    holds, and returns at once when everything is there). Raises when a build fails, so a test
    session that needs the cluster fails instead of skipping."""
    subprocess.run([str(C.HACK / "build-binaries.sh"), *components], check=True)


def kube_bin(name: str) -> str:
    return str(C.bin_dir("k8s") / name)


# --------------------------------------------------------------------------------------------
# processes


def _pid(cfg: C.ClusterConfig, name: str) -> int | None:
    try:
        return int((cfg.pids / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None, marker: str) -> bool:
    """True when pid runs and its command line mentions marker (guards against pid reuse).
    Zombies have an empty command line, so they count as dead."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return marker in cmdline


def _running(pid: int | None) -> bool:
    """True while pid exists and is not a zombie, whatever its command line says."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _marker(cfg: C.ClusterConfig, name: str) -> str:
    # Every component's command line names the state directory, so the marker both identifies
    # the component and tells two clusters apart.
    return str(cfg.state_dir)


def _ports(cfg: C.ClusterConfig, name: str) -> list[tuple[str, int, int]]:
    """(address, port, socket type) that a component listens on."""
    tcp, udp = socket.SOCK_STREAM, socket.SOCK_DGRAM
    if name.startswith("kubelet-"):
        ip = R.node_ip(cfg, _node_index(name))
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


def _check_ports(cfg: C.ClusterConfig, name: str) -> None:
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
                raise RuntimeError(f"cannot start {name}: {host}:{port} is in use ({e.strerror}); "
                                   "stop whatever holds it or choose other ports (see hack/localcluster/config.py)") from None


def _start(cfg: C.ClusterConfig, name: str, argv: list[str], env: dict | None = None) -> None:
    _check_ports(cfg, name)
    logf = cfg.logs / f"{name}.log"
    # `sh -c 'cmd & echo $!'` detaches the component from the caller: it keeps running after
    # `make cluster-up` or the test session that started it returns.
    script = 'exec 0</dev/null; "$@" >>"$LOG" 2>&1 & echo $!'
    out = subprocess.run(["setsid", "sh", "-c", script, "sh", *argv], check=True, capture_output=True,
                         text=True, env={**(env or os.environ), "LOG": str(logf)}, cwd=str(C.REPO))
    pid = int(out.stdout.strip())
    (cfg.pids / f"{name}.pid").write_text(str(pid))
    (cfg.pids / f"{name}.config").write_text(_fingerprint(cfg, name, argv))
    log(f"started {name} (pid {pid}, log {logf})")


def _fingerprint(cfg: C.ClusterConfig, name: str, argv: list[str]) -> str:
    """What a component was started with: its command line and the configuration files this
    code writes for it, so that a long-running cluster started by older code is noticed."""
    h = hashlib.sha256(json.dumps(argv).encode())
    h.update(R.config_text(cfg, name).encode())
    return h.hexdigest()


def stale_components(cfg: C.ClusterConfig | None = None) -> list[str]:
    """Running components whose configuration or code differs from what `up` would start now.
    They are not restarted automatically (others may be using the cluster): run
    `make cluster-down cluster-up` to apply."""
    cfg = cfg or C.load()
    try:
        sec = json.loads(cfg.secrets_file.read_text())
    except OSError:
        return []
    out = []
    for name in components(cfg):
        rec = cfg.pids / f"{name}.config"
        if _alive(_pid(cfg, name), _marker(cfg, name)):
            argv, _ = _argv(cfg, name, sec, write=False)
            if not rec.exists() or rec.read_text() != _fingerprint(cfg, name, argv):
                out.append(name)
    return out


def _stop(cfg: C.ClusterConfig, name: str, timeout: float = 20) -> None:
    pid = _pid(cfg, name)
    if _alive(pid, _marker(cfg, name)):
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + timeout
        while time.time() < deadline and _alive(pid, _marker(cfg, name)):
            time.sleep(0.2)
        if _alive(pid, _marker(cfg, name)):
            log(f"{name} ignored SIGTERM for {timeout}s: SIGKILL")
            os.kill(pid, signal.SIGKILL)
        log(f"stopped {name} (pid {pid})")
    (cfg.pids / f"{name}.pid").unlink(missing_ok=True)


def kill_component(cfg: C.ClusterConfig, name: str) -> None:
    """SIGKILL one component (node loss: a kubelet dies with its machine)."""
    pid = _pid(cfg, name)
    if _alive(pid, _marker(cfg, name)):
        os.kill(pid, signal.SIGKILL)
        while _running(pid):
            time.sleep(0.1)
        log(f"killed {name} (pid {pid})")


def start_component(cfg: C.ClusterConfig, name: str, timeout: float = 120) -> None:
    """Start one stopped component with the configuration `up` uses and wait until healthy."""
    if not _alive(_pid(cfg, name), _marker(cfg, name)):
        argv, e = _argv(cfg, name, json.loads(cfg.secrets_file.read_text()))
        _start(cfg, name, argv, e)
    _wait(cfg, name, timeout)


# --------------------------------------------------------------------------------------------
# health


def _https_ok(url: str, cafile: Path | None = None, token: str | None = None) -> bool:
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else ssl._create_unverified_context()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=3) as resp:
            return resp.status == 200
    except Exception:
        return False


def _healthy(cfg: C.ClusterConfig, name: str) -> bool:
    if not _alive(_pid(cfg, name), _marker(cfg, name)):
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
        return _sh(*R.ctr_argv(cfg, _node_index(name)), "version", check=False).returncode == 0
    if name.startswith("kubelet-"):
        try:
            node = cfg.nodes[_node_index(name)]
            conds = Kube.from_state(cfg).get(f"/api/v1/nodes/{node}")["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        except Exception:
            return False
    raise ValueError(name)


def _wait(cfg: C.ClusterConfig, name: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _healthy(cfg, name):
            return
        pid = _pid(cfg, name)
        # Just after the start the process may be between fork and exec, or mid-exec, and
        # show another (or an empty) command line: only a process that is gone ends the wait.
        if not _alive(pid, _marker(cfg, name)) and not _running(pid):
            break
        time.sleep(0.5)
    tail = ""
    logf = cfg.logs / f"{name}.log"
    if logf.exists():
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-30:])
    raise RuntimeError(f"{name} did not become healthy; last log lines:\n{tail}")


def status(cfg: C.ClusterConfig | None = None) -> dict[str, bool]:
    """Health of every component: {"etcd": True, ...}."""
    cfg = cfg or C.load()
    return {name: _healthy(cfg, name) for name in components(cfg)}


def is_up(cfg: C.ClusterConfig | None = None) -> bool:
    return all(status(cfg).values())


# --------------------------------------------------------------------------------------------
# network, certificates, credentials


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def ensure_bridge(cfg: C.ClusterConfig) -> None:
    """The bridge carries the host's address in the cluster subnet; pods hang off it."""
    if _sh("ip", "link", "show", cfg.bridge, check=False).returncode != 0:
        _sh("ip", "link", "add", cfg.bridge, "type", "bridge")
    addr = f"{cfg.host_ip}/{cfg.subnet.prefixlen}"
    if addr not in _sh("ip", "-o", "addr", "show", "dev", cfg.bridge).stdout:
        _sh("ip", "addr", "add", addr, "dev", cfg.bridge)
    _sh("ip", "link", "set", cfg.bridge, "up")


def remove_network(cfg: C.ClusterConfig) -> None:
    """Delete the pod network namespaces left with an address of this cluster's subnet (a node
    stopped without tearing its pods down; killing anything left in them) and the bridge."""
    for ns in R.pod_netns(cfg):
        for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        _sh("ip", "netns", "del", ns, check=False)
    _sh("ip", "link", "del", cfg.bridge, check=False)


def ensure_pki(cfg: C.ClusterConfig) -> None:
    """A CA, an API server certificate valid for every address clients use (host, pods, the
    in-cluster service names) and the service-account signing key."""
    pki = cfg.pki
    if (pki / "apiserver.crt").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    _sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"), "-subj", "/CN=sftjob-local-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-addext", "subjectKeyIdentifier=hash")
    sans = [f"IP:{cfg.host_ip}", "IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes",
            "DNS:kubernetes.default", "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"]
    (pki / "apiserver.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        f"subjectAltName={','.join(sans)}\n")
    _sh("openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "apiserver.key"),
        "-out", str(pki / "apiserver.csr"), "-subj", "/CN=kube-apiserver")
    _sh("openssl", "x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(pki / "ca.crt"),
        "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
        "-extfile", str(pki / "apiserver.ext"), "-out", str(pki / "apiserver.crt"))
    _sh("openssl", "genrsa", "-out", str(pki / "sa.key"), "2048")
    # each kubelet's serving certificate (logs, exec, port-forward), for its node address
    for i, node in enumerate(cfg.nodes):
        _signed(pki, f"kubelet-{i}", f"/CN={node}", "serverAuth", f"subjectAltName=IP:{R.node_ip(cfg, i)},DNS:{node}\n")
    # the API server's client certificate towards kubelets (authorised through RBAC, as
    # kubeadm's apiserver-kubelet-client)
    _signed(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth", "")


def _signed(pki: Path, name: str, subject: str, usage: str, extra: str) -> None:
    (pki / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n{extra}")
    _sh("openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / f"{name}.key"),
        "-out", str(pki / f"{name}.csr"), "-subj", subject)
    _sh("openssl", "x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"),
        "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
        "-extfile", str(pki / f"{name}.ext"), "-out", str(pki / f"{name}.crt"))


def ensure_secrets(cfg: C.ClusterConfig) -> dict:
    if cfg.secrets_file.exists():
        return json.loads(cfg.secrets_file.read_text())
    data = {
        "admin_token": secrets.token_hex(24),
        "s3_access_key": "sftjob-" + secrets.token_hex(4),
        "s3_secret_key": secrets.token_hex(16),
    }
    cfg.secrets_file.write_text(json.dumps(data))
    cfg.secrets_file.chmod(0o600)
    # Static token users: "token,user,uid,groups". The admin is in system:masters; every other
    # identity (ServiceAccounts) authenticates with real signed tokens from the TokenRequest API.
    (cfg.pki / "tokens.csv").write_text(f'{data["admin_token"]},sftjob-admin,sftjob-admin,"system:masters"\n')
    return data


def write_client_files(cfg: C.ClusterConfig, sec: dict) -> None:
    ca = base64.b64encode((cfg.pki / "ca.crt").read_bytes()).decode()
    cfg.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: sftjob-local
  cluster:
    server: {cfg.apiserver_url}
    certificate-authority-data: {ca}
users:
- name: sftjob-admin
  user:
    token: {sec["admin_token"]}
contexts:
- name: sftjob-local
  context:
    cluster: sftjob-local
    user: sftjob-admin
    namespace: default
current-context: sftjob-local
""")
    cfg.kubeconfig.chmod(0o600)
    # what the node components (kubelets, kube-proxy, CoreDNS) authenticate with: the admin
    # token, in a file of its own so that a narrower identity can replace it without touching
    # the user's kubeconfig
    node_kc = cfg.state_dir / "node-kubeconfig"
    node_kc.write_text(cfg.kubeconfig.read_text())
    node_kc.chmod(0o600)
    lines = {k: v for k, v in env(cfg).items() if k != "PATH"}
    text = "".join(f"export {k}={v}\n" for k, v in lines.items())
    text += f'export PATH={C.bin_dir("k8s")}:{C.bin_dir("helm")}:$PATH\n'
    cfg.env_file.write_text(text)


def env(cfg: C.ClusterConfig | None = None) -> dict[str, str]:
    """The variables of .cluster/env as a dict (PATH with the cached kubectl and helm first)."""
    cfg = cfg or C.load()
    sec = json.loads(cfg.secrets_file.read_text())
    return {
        "KUBECONFIG": str(cfg.kubeconfig),
        "AWS_ENDPOINT_URL": cfg.s3_endpoint,
        "AWS_ACCESS_KEY_ID": sec["s3_access_key"],
        "AWS_SECRET_ACCESS_KEY": sec["s3_secret_key"],
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PATH": f'{C.bin_dir("k8s")}:{C.bin_dir("helm")}:{os.environ.get("PATH", "")}',
    }


# --------------------------------------------------------------------------------------------
# component command lines


def _argv(cfg: C.ClusterConfig, name: str, sec: dict, write: bool = True) -> tuple[list[str], dict | None]:
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
                # kubelets renew their lease every 3 s (realnodes.kubelet_config): a stopped one
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
        i = _node_index(name)
        if write:
            R.write_node_files(cfg, i)
        return (R.containerd_argv(cfg, i) if name.startswith("containerd-") else R.kubelet_argv(cfg, i)), None
    raise ValueError(name)


# --------------------------------------------------------------------------------------------
# up / down


@contextlib.contextmanager
def _locked(cfg: C.ClusterConfig):
    """Serialise up/down of one cluster between processes (two test sessions starting at once).
    The lock file lives outside the state directory, which down() removes."""
    digest = hashlib.sha1(str(cfg.state_dir).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"sftjob-cluster-{digest}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def up(cfg: C.ClusterConfig | None = None, timeout: float = 180) -> C.ClusterConfig:
    """Build missing binaries, then start whatever is not running. A no-op on a healthy cluster."""
    cfg = cfg or C.load()
    ensure_binaries()
    with _locked(cfg):
        return _up(cfg, timeout)


def _up(cfg: C.ClusterConfig, timeout: float) -> C.ClusterConfig:
    t0 = time.time()
    st = status(cfg)
    if all(st.values()):
        log(f"cluster already up ({cfg.state_dir})")
        # the images follow the checkout: rebuilt when their inputs changed, re-imported then
        for i in range(len(cfg.nodes)):
            images.load(R.containerd_address(cfg, i), names=cfg.node_images)
        stale = stale_components(cfg)
        if stale:
            log(f"WARNING: {', '.join(stale)} run(s) with an older configuration or code than this checkout; "
                "`make cluster-down cluster-up` applies it")
        return cfg
    # the nodes' Debian packages: installed when missing (as root), else named with the
    # apt-get line to run
    pkgs = subprocess.run([str(C.HACK / "host-packages.sh")], capture_output=True, text=True)
    if pkgs.returncode != 0:
        raise RuntimeError(f"hack/host-packages.sh failed:\n{pkgs.stderr.strip()}")
    if not any(_alive(_pid(cfg, n), _marker(cfg, n)) for n in components(cfg)):
        # Nothing of it runs (first start, or a machine that lost its processes): start clean
        # instead of resurrecting stale pods and half-written state.
        _clean(cfg)
    for sub in ("logs", "pids"):
        (cfg.state_dir / sub).mkdir(parents=True, exist_ok=True)
    ensure_bridge(cfg)
    R.ensure_host_network(cfg)
    ensure_pki(cfg)
    sec = ensure_secrets(cfg)
    write_client_files(cfg, sec)
    for name in components(cfg):
        if st.get(name):
            continue
        if name.startswith("kubelet-"):
            i = _node_index(name)
            # containers a crashed earlier cluster left in the node's (persistent) store
            R.stop_pods(cfg, i)
            # the images the pods run, into this node's containerd (never pulled: no registry)
            images.load(R.containerd_address(cfg, i), names=cfg.node_images)
        # A running but (momentarily) unhealthy component is waited for, never restarted: on a
        # loaded machine a slow health check must not take down a cluster that others use.
        if not _alive(_pid(cfg, name), _marker(cfg, name)):
            argv, e = _argv(cfg, name, sec)
            _start(cfg, name, argv, e)
        _wait(cfg, name, timeout)
        if name == "kube-apiserver":
            _wait_default_ready(cfg)
            _ensure_dns_service(cfg)
    _wait_service_accounts(cfg, timeout)
    log(f"cluster up in {time.time() - t0:.1f}s: source {cfg.env_file}")
    return cfg


def _wait_default_ready(cfg: C.ClusterConfig) -> None:
    kube = Kube.from_state(cfg)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            kube.get("/api/v1/namespaces/default")
            return
        except (ApiError, OSError):
            time.sleep(0.5)
    raise RuntimeError("namespace default never appeared")


def _ensure_dns_service(cfg: C.ClusterConfig) -> None:
    kube = Kube.from_state(cfg)
    for path, obj in R.dns_service_manifests(cfg):
        try:
            kube.create(path, obj)
        except ApiError as e:
            if e.status != 409:
                raise


def _wait_service_accounts(cfg: C.ClusterConfig, timeout: float) -> None:
    """Pods are refused until their namespace has a `default` ServiceAccount (created by the
    controller manager) and projected volumes need kube-root-ca.crt: wait for both."""
    kube = Kube.from_state(cfg)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            kube.get("/api/v1/namespaces/default/serviceaccounts/default")
            kube.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt")
            return
        except (ApiError, OSError):
            time.sleep(0.5)
    raise RuntimeError("default ServiceAccount/kube-root-ca.crt never appeared: is kube-controller-manager running?")


def _clean(cfg: C.ClusterConfig) -> None:
    for i in range(len(cfg.nodes)):
        R.kill_containers(cfg, i)
    remove_network(cfg)
    R.remove_host_state(cfg)
    if cfg.state_dir.exists():
        shutil.rmtree(cfg.state_dir, ignore_errors=True)


def down(cfg: C.ClusterConfig | None = None) -> None:
    """Stop every process of the cluster (pods included) and remove its state and network."""
    cfg = cfg or C.load()
    with _locked(cfg):
        _down(cfg)


def _down(cfg: C.ClusterConfig) -> None:
    if cfg.pids.exists():
        for name in ("kueue", "kwok") + tuple(reversed(components(cfg))):  # optional: kueue.py, kwok.py
            if name.startswith("containerd-"):
                R.stop_pods(cfg, _node_index(name))
            _stop(cfg, name)
    _clean(cfg)
    log(f"cluster down ({cfg.state_dir} removed)")


def kubeconfig_path(cfg: C.ClusterConfig | None = None) -> Path:
    return (cfg or C.load()).kubeconfig


def leftover_processes(cfg: C.ClusterConfig | None = None) -> list[str]:
    """Live (non-zombie) processes that belong to this cluster: a command line naming its state
    directory or its socket directory (containerd shims), a root file system under its state
    directory (containers), or living in one of its pod network namespaces."""
    cfg = cfg or C.load()
    out = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and (str(cfg.state_dir) in cmd or str(R.socket_dir(cfg)) in cmd):
            out.append(f"{d.name}: {cmd[:200]}")
            continue
        try:
            if cmd and os.readlink(d / "root").startswith(str(cfg.state_dir)):
                out.append(f"{d.name}: {cmd[:200]} (container)")
        except OSError:
            pass
    for ns in R.pod_netns(cfg):
        out += [f"{p}: in netns {ns}" for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
    return out
