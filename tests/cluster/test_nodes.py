"""Pods on the real nodes (kubelet + containerd + runc, from the locally built images): DNS and
Services between pods, torch.distributed over the pod network, exit codes and termination
messages, graceful deletion, eviction, OOM kills, security contexts, missing images, node loss,
and `kubectl logs/exec/port-forward`."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import struct
import textwrap
import threading
import time
import urllib.request

import pytest

from hack import localcluster
from hack.localcluster import realnodes
from tests.fixtures.cluster import wait_for

pytestmark = pytest.mark.cluster

# The trainer image as `make images` builds it (python, torch, uid 1000); imported into every
# node's containerd, never pulled.
IMAGE = localcluster.images.image_refs()["trainer"]


def pod(name: str, script: str, **spec) -> dict:
    container = {"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                 "command": ["python", "-c", textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": spec.pop("labels", {})},
            "spec": {"restartPolicy": "Never", "containers": [container], **spec}}


def create(cluster, namespace, obj) -> dict:
    kind = obj["kind"].lower() + "s"
    return cluster.kube.create(f"/api/v1/namespaces/{namespace}/{kind}", obj)


def terminated(p: dict) -> dict:
    return p["status"]["containerStatuses"][0]["state"]["terminated"]


def container_pid(cluster, p: dict) -> int:
    """The host pid of the pod's first container, from its node's containerd."""
    cid = p["status"]["containerStatuses"][0]["containerID"]
    assert cid.startswith("containerd://"), cid
    pid = realnodes.task_pid(cluster.cfg, p["spec"]["nodeName"], cid)
    assert pid, f"container {cid} does not run on {p['spec']['nodeName']}"
    return pid


def pid_alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in open(f"/proc/{pid}/status").read()
    except OSError:
        return False


class PodEvents(threading.Thread):
    """Records every watch event of one pod until it is deleted."""

    def __init__(self, cluster, namespace, name):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.name = cluster, namespace, name
        self.rv = cluster.pod(namespace, name)["metadata"]["resourceVersion"]
        self.events: list[dict] = []
        self.deleted_at = None
        self.start()

    def run(self):
        for ev in self.cluster.kube.watch(f"/api/v1/namespaces/{self.ns}/pods", self.rv, timeout_s=120,
                                          fieldSelector=f"metadata.name={self.name}"):
            self.events.append(ev)
            if ev["type"] == "DELETED":
                self.deleted_at = time.time()
                return

    def last_status(self) -> dict:
        return self.events[-1]["object"]["status"]


ALLREDUCE = """
import datetime, json, os, socket, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
peer = f"ar-{1 - rank}"
for _ in range(240):  # the peer pod may not be running yet: its name resolves once it is
    try:
        short = socket.gethostbyname(f"{peer}.ar")
        fqdn = socket.gethostbyname(f"{peer}.ar.{ns}.svc.cluster.local")
        # The form the operator gives MASTER_ADDR: no cluster domain, found through the
        # resolv.conf search list, so it works whatever the cluster's DNS domain is.
        no_domain = socket.gethostbyname(f"{peer}.ar.{ns}.svc")
        break
    except OSError:
        time.sleep(0.5)
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
dist.destroy_process_group()
me = socket.gethostbyname(socket.gethostname())
result = {"sum": t.item(), "peer_short": short, "peer_fqdn": fqdn, "peer_no_domain": no_domain,
          "hostname": socket.gethostname(), "me": me}
print(json.dumps(result))
open("/dev/termination-log", "w").write(json.dumps(result))
"""


def test_two_pods_find_each_other_and_allreduce(cluster, namespace):
    create(cluster, namespace, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ar"},
                                "spec": {"clusterIP": "None", "selector": {"job": "ar"},
                                         "ports": [{"name": "dist", "port": 29500}]}})
    for rank in range(2):
        create(cluster, namespace, pod(
            f"ar-{rank}", ALLREDUCE, labels={"job": "ar"}, hostname=f"ar-{rank}", subdomain="ar",
            container={"env": [{"name": "RANK", "value": str(rank)}, {"name": "MASTER_ADDR", "value": "ar-0.ar"},
                               {"name": "MASTER_PORT", "value": "29500"}]}))
    pods = [cluster.wait_pod_phase(namespace, f"ar-{r}", ("Succeeded", "Failed"), timeout=240) for r in range(2)]
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 2
    for rank, p in enumerate(pods):
        assert p["status"]["phase"] == "Succeeded", cluster.pod_log(namespace, f"ar-{rank}")
        out = json.loads(terminated(p)["message"])
        assert out["sum"] == 3.0  # 1 + 2: both ranks took part
        assert out["peer_short"] == out["peer_fqdn"] == out["peer_no_domain"] == ips[1 - rank]
        assert out["hostname"] == f"ar-{rank}" and out["me"] == ips[rank]
        assert terminated(p)["reason"] == "Completed" and terminated(p)["exitCode"] == 0
    # the names resolve only while the pods run: both have finished now (CoreDNS caches an
    # answer for 5 s and sees the EndpointSlice change a moment after the pod's)
    wait_for(lambda: dns_rcode(cluster, f"ar-0.ar.{namespace}.svc.cluster.local") == 3, 30, what="NXDOMAIN")
    assert dns_rcode(cluster, "kubernetes.default.svc.cluster.local") == 0


def dns_rcode(cluster, name: str) -> int:
    """Ask the cluster DNS server directly (as a pod's resolver would) and return the rcode."""
    q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(part)]) + part.encode() for part in name.split(".")) + b"\0"
    q += struct.pack("!HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(q, (cluster.cfg.host_ip, 53))
        resp = s.recv(512)
    return struct.unpack("!H", resp[2:4])[0] & 0xF


def test_exit_code_and_termination_message(cluster, namespace):
    create(cluster, namespace, pod("fails", """
        import sys
        print("about to fail")
        open("/dev/termination-log", "w").write("bad input: no rows")
        sys.exit(3)
        """))
    p = cluster.wait_pod_phase(namespace, "fails", ("Succeeded", "Failed"))
    assert p["status"]["phase"] == "Failed"
    t = terminated(p)
    assert (t["exitCode"], t["reason"], t["message"]) == (3, "Error", "bad input: no rows")
    assert "about to fail" in cluster.pod_log(namespace, "fails")
    ready = {c["type"]: c["status"] for c in p["status"]["conditions"]}
    assert ready["Ready"] == "False" and ready["PodScheduled"] == "True"


SIGTERM_HANDLER = """
import os, signal, sys, time
def bye(*_):
    time.sleep(1)
    open("/dev/termination-log", "w").write("got SIGTERM")
    sys.exit(7)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_delete_sends_sigterm_and_keeps_exit_code(cluster, namespace):
    create(cluster, namespace, pod("graceful", SIGTERM_HANDLER, terminationGracePeriodSeconds=20))
    p = cluster.wait_pod_phase(namespace, "graceful", "Running")
    pid = container_pid(cluster, p)
    assert pid_alive(pid)
    wait_for(lambda: "ready" in cluster.pod_log(namespace, "graceful"), 30, what="handler installed")
    watch = PodEvents(cluster, namespace, "graceful")
    t0 = time.time()
    cluster.kubectl("delete", "-n", namespace, "pod", "graceful", "--wait=false")
    watch.join(60)
    assert watch.deleted_at, "pod object was not removed after its process stopped"
    assert 1 <= watch.deleted_at - t0 < 15  # the handler's 1 s, not the 20 s grace period
    t = watch.last_status()["containerStatuses"][0]["state"]["terminated"]
    assert (t["exitCode"], t["message"]) == (7, "got SIGTERM")
    assert not pid_alive(pid)


def test_grace_period_then_sigkill(cluster, namespace):
    create(cluster, namespace, pod("stubborn", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(3600)
        """, terminationGracePeriodSeconds=3))
    p = cluster.wait_pod_phase(namespace, "stubborn", "Running")
    pid = container_pid(cluster, p)
    wait_for(lambda: "ignoring" in cluster.pod_log(namespace, "stubborn"), 30, what="handler installed")
    watch = PodEvents(cluster, namespace, "stubborn")
    t0 = time.time()
    cluster.kubectl("delete", "-n", namespace, "pod", "stubborn", "--wait=false")
    watch.join(60)
    assert watch.deleted_at and 3 <= watch.deleted_at - t0 < 15
    st = watch.last_status()
    assert st["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137  # 128 + SIGKILL
    assert st["phase"] == "Failed"
    assert not pid_alive(pid)


def test_eviction_api_stops_pod_gracefully(cluster, namespace):
    create(cluster, namespace, pod("victim", SIGTERM_HANDLER))
    cluster.wait_pod_phase(namespace, "victim", "Running")
    wait_for(lambda: "ready" in cluster.pod_log(namespace, "victim"), 30, what="handler installed")
    watch = PodEvents(cluster, namespace, "victim")
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/pods/victim/eviction", {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "victim", "namespace": namespace}})
    watch.join(60)
    assert watch.deleted_at
    st = watch.last_status()
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["DisruptionTarget"]["status"] == "True"
    assert conds["DisruptionTarget"]["reason"] == "EvictionByEvictionAPI"
    assert st["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 7


ENV_AND_VOLUMES = """
import json, os, socket, ssl, urllib.request, urllib.error
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
url = f"https://kubernetes.default.svc:{os.environ['KUBERNETES_SERVICE_PORT']}/api/v1/namespaces/{os.environ['MY_NS']}/pods"
try:
    urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer " + token}), context=ctx)
    api = "allowed"
except urllib.error.HTTPError as e:
    api = f"{e.code} {json.loads(e.read())['message']}"
os.makedirs("/scratch/sub", exist_ok=True)
out = {
    "env": {k: os.environ.get(k) for k in ["MY_POD", "MY_NS", "MY_IP", "FROM_CM", "FROM_SECRET", "CFG_mode",
                                            "EXPANDED", "PATH"]},
    "cwd": os.getcwd(),
    "cm_file": open("/etc/app/settings.yaml").read(),
    "secret_file": open("/etc/creds/password").read(),
    "scratch_writable": os.access("/scratch/sub", os.W_OK),
    "cm_readonly": not os.access("/etc/app", os.W_OK),
    "api": api,
    "hostfile": open("/hostdata/marker").read(),
}
open("/dev/termination-log", "w").write(json.dumps(out))
"""


def test_env_volumes_and_serviceaccount(cluster, namespace, tmp_path):
    (tmp_path / "marker").write_text("from the host")
    tmp_path.chmod(0o755)  # the pod runs as uid 1000: pytest's directory is root's alone
    create(cluster, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                                "data": {"mode": "fast", "settings.yaml": "lr: 0.1\n"}})
    create(cluster, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                                "stringData": {"password": "s3cr3t"}})
    spec = pod("inspect", ENV_AND_VOLUMES, container={
        "workingDir": "/tmp",
        "env": [
            {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
            {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "EXPANDED", "value": "pod=$(MY_POD)"},
        ],
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "volumeMounts": [{"name": "app", "mountPath": "/etc/app", "readOnly": True},
                         {"name": "creds", "mountPath": "/etc/creds"},
                         {"name": "scratch", "mountPath": "/scratch"},
                         {"name": "host", "mountPath": "/hostdata"}],
    }, volumes=[{"name": "app",
                 "configMap": {"name": "cfg", "items": [{"key": "settings.yaml", "path": "settings.yaml"}]}},
                {"name": "creds", "secret": {"secretName": "creds"}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "host", "hostPath": {"path": str(tmp_path)}}])
    create(cluster, namespace, spec)
    p = cluster.wait_pod_phase(namespace, "inspect", ("Succeeded", "Failed"))
    assert p["status"]["phase"] == "Succeeded", cluster.pod_log(namespace, "inspect")
    out = json.loads(terminated(p)["message"])
    env = out["env"]
    assert env["MY_POD"] == "inspect" and env["MY_NS"] == namespace and env["MY_IP"] == p["status"]["podIP"]
    assert (env["FROM_CM"], env["FROM_SECRET"], env["CFG_mode"]) == ("fast", "s3cr3t", "fast")
    assert env["EXPANDED"] == "pod=inspect"
    # the image's own environment, nothing of the checkout or its .venv
    assert env["PATH"].startswith("/opt/venv/bin:") and str(localcluster.config.REPO) not in env["PATH"]
    assert out["cwd"] == "/tmp"
    assert out["cm_file"] == "lr: 0.1\n" and out["secret_file"] == "s3cr3t"
    assert out["scratch_writable"] and out["cm_readonly"]
    assert out["hostfile"] == "from the host"
    # the projected token authenticates as the pod's ServiceAccount, which has no RBAC grants
    assert out["api"].startswith("403") and f"system:serviceaccount:{namespace}:default" in out["api"]
    # the volume mounts did not leak into the host's mount table
    assert "/etc/app" not in open("/proc/self/mountinfo").read()


def test_missing_configmap_waits_then_runs(cluster, namespace):
    create(cluster, namespace, pod("later", "print('ran')", container={
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "late", "key": "x"}}}]}))

    def config_error():
        st = cluster.pod(namespace, "later").get("status", {}).get("containerStatuses") or []
        waiting = st[0]["state"].get("waiting", {}) if st else {}
        return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

    assert 'configmap "late" not found' in wait_for(config_error, 60, what="CreateContainerConfigError")["message"]
    assert cluster.pod(namespace, "later")["status"]["phase"] == "Pending"
    create(cluster, namespace,
           {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "late"}, "data": {"x": "1"}})
    assert cluster.wait_pod_phase(namespace, "later", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"


def test_host_reaches_pod_ip(cluster, namespace):
    create(cluster, namespace, pod("web", "import http.server as h; "
                                          "h.test(h.SimpleHTTPRequestHandler, port=8080, bind='0.0.0.0')",
                                   container={"workingDir": "/etc"}))
    p = cluster.wait_pod_phase(namespace, "web", "Running")
    ip = p["status"]["podIP"]
    # /etc/hosts as the pod sees it: the kubelet-style file with the pod's own name and IP
    body = wait_for(lambda: urllib.request.urlopen(f"http://{ip}:8080/hosts", timeout=3).read().decode(), 30,
                    what="pod HTTP server")
    assert f"{ip}\tweb" in body
    i = cluster.cfg.nodes.index(p["spec"]["nodeName"])
    assert p["status"]["hostIP"] == realnodes.node_ip(cluster.cfg, i)


def test_node_loss(cluster, namespace):
    """A killed kubelet: the controller manager marks the Node Ready=Unknown and taints it, the
    pod is marked not ready, its container is gone, nothing new lands there; restarted, the
    kubelet reports the pod Failed and runs new pods."""
    node = cluster.cfg.nodes[-1]
    sel = {"kubernetes.io/hostname": node}
    create(cluster, namespace, pod("doomed", "import time; time.sleep(3600)", nodeSelector=sel))
    p = cluster.wait_pod_phase(namespace, "doomed", "Running")
    assert p["spec"]["nodeName"] == node
    pid = container_pid(cluster, p)
    try:
        localcluster.node_lost(node)
        n = cluster.kube.get(f"/api/v1/nodes/{node}")
        assert {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"] == "Unknown"
        wait_for(lambda: "node.kubernetes.io/unreachable" in {t["key"] for t in cluster.kube.get(
            f"/api/v1/nodes/{node}")["spec"].get("taints") or []}, 30, what="unreachable taint")
        assert not pid_alive(pid)
        wait_for(lambda: {c["type"]: c["status"] for c in cluster.pod(namespace, "doomed")["status"]["conditions"]}
                 ["Ready"] == "False", 30, what="pod marked not ready")
        # nothing new lands on a lost node
        create(cluster, namespace, pod("next", "print('hi')", nodeSelector=sel))
        time.sleep(3)
        assert cluster.pod(namespace, "next")["status"]["phase"] == "Pending"
    finally:
        localcluster.node_restore(node)
    next_pod = cluster.wait_pod_phase(namespace, "next", ("Succeeded", "Failed"), timeout=120)
    assert next_pod["status"]["phase"] == "Succeeded"
    assert cluster.wait_pod_phase(namespace, "doomed", "Failed", timeout=120)["status"]["phase"] == "Failed"


def test_kubectl_logs_exec_and_port_forward(cluster, namespace):
    create(cluster, namespace, pod("talker", """
        import time
        for i in range(3):
            print(f"line {i}", flush=True)
            time.sleep(1)
        """))
    cluster.wait_pod_phase(namespace, "talker", ("Running", "Succeeded"))
    # -f streams until the container ends, through the API server's proxy to the kubelet
    followed = cluster.kubectl("logs", "-n", namespace, "-f", "talker", timeout=60).stdout
    assert followed.splitlines() == ["line 0", "line 1", "line 2"]
    assert cluster.kubectl("logs", "-n", namespace, "talker", "--tail=1").stdout == "line 2\n"

    create(cluster, namespace, pod("server", """
        import http.server as h
        h.test(h.SimpleHTTPRequestHandler, port=8080, bind="0.0.0.0")
        """, container={"workingDir": "/etc"}))
    cluster.wait_pod_phase(namespace, "server", "Running")
    out = cluster.kubectl("exec", "-n", namespace, "server", "--", "sh", "-c", "id -u; cat /etc/hostname").stdout
    assert out.split() == ["1000", "server"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, **cluster.env}
    pf = subprocess.Popen([cluster.kubectl_path, "port-forward", "-n", namespace, "pod/server", f"{port}:8080"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        body = wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/hostname", timeout=3).read().decode(),
                        30, what="port-forward")
        assert body.strip() == "server"
    finally:
        pf.terminate()
        pf.wait(10)


def test_security_context_is_enforced(cluster, namespace):
    """The runtime applies what the pod asks: uid/gid, no privilege escalation, a read-only root
    file system, dropped capabilities; runAsNonRoot refuses an image user 0."""
    create(cluster, namespace, pod("locked", """
        import json, os
        try:
            open("/etc/probe", "w")
            rootfs = "writable"
        except OSError as e:
            rootfs = e.strerror
        status = open("/proc/self/status").read()
        caps = [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0]
        nnp = [l.split()[1] for l in status.splitlines() if l.startswith("NoNewPrivs")][0]
        open("/dev/termination-log", "w").write(json.dumps(
            {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "rootfs": rootfs, "caps": caps,
             "nnp": nnp}))
        """, securityContext={"runAsUser": 2345, "runAsGroup": 3456, "fsGroup": 4567, "runAsNonRoot": True},
        container={"securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                       "capabilities": {"drop": ["ALL"]}}}))
    p = cluster.wait_pod_phase(namespace, "locked", ("Succeeded", "Failed"))
    assert p["status"]["phase"] == "Succeeded", cluster.pod_log(namespace, "locked")
    out = json.loads(terminated(p)["message"])
    assert (out["uid"], out["gid"]) == (2345, 3456) and 4567 in out["groups"]
    assert out["rootfs"] == "Read-only file system"
    assert int(out["caps"], 16) == 0 and out["nnp"] == "1"

    create(cluster, namespace, pod("asroot", "print('should not run')", securityContext={"runAsNonRoot": True},
                                   container={"securityContext": {"runAsUser": 0}}))

    def refused():
        st = cluster.pod(namespace, "asroot").get("status", {}).get("containerStatuses") or []
        w = st[0]["state"].get("waiting", {}) if st else {}
        return w if w.get("reason") == "CreateContainerConfigError" else None

    assert "non-root" in wait_for(refused, 60, what="runAsNonRoot refusal")["message"]


def test_memory_limit_is_enforced_by_oom_kill(cluster, namespace):
    create(cluster, namespace, pod("hog", """
        blocks = []
        while True:
            blocks.append(bytearray(16 << 20))
        """, container={"resources": {"limits": {"memory": "128Mi"}, "requests": {"memory": "128Mi"}}}))
    p = cluster.wait_pod_phase(namespace, "hog", ("Succeeded", "Failed"), timeout=120)
    t = terminated(p)
    assert (p["status"]["phase"], t["reason"], t["exitCode"]) == ("Failed", "OOMKilled", 137)


def test_missing_image_is_never_pulled(cluster, namespace):
    spec = pod("ghost", "print('unreachable')")
    spec["spec"]["containers"][0]["image"] = "localhost/sftjob/does-not-exist:0"
    create(cluster, namespace, spec)

    def waiting():
        st = cluster.pod(namespace, "ghost").get("status", {}).get("containerStatuses") or []
        w = st[0]["state"].get("waiting", {}) if st else {}
        return w if w.get("reason") == "ErrImageNeverPull" else None

    w = wait_for(waiting, 60, what="ErrImageNeverPull")
    assert "localhost/sftjob/does-not-exist:0" in w["message"]
    assert cluster.pod(namespace, "ghost")["status"]["phase"] == "Pending"


def test_nodes_are_real_kubelets_on_containerd(cluster):
    out = cluster.kubectl("get", "nodes", "-o", "wide", "--no-headers").stdout
    rows = [line.split() for line in out.splitlines()]
    assert sorted(r[0] for r in rows) == sorted(cluster.cfg.nodes)
    for r in rows:
        assert r[1] == "Ready" and r[-1].startswith("containerd://"), r
    for node in cluster.cfg.nodes:
        info = cluster.kube.get(f"/api/v1/nodes/{node}")["status"]["nodeInfo"]
        assert info["kubeletVersion"] == localcluster.config.VERSIONS["K8S_VERSION"]
        assert re.match(r"containerd://1\.", info["containerRuntimeVersion"])
