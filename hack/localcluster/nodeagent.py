"""The node agent: a kubelet stand-in that registers Nodes and runs their pods as local processes.

One agent process serves every node of the cluster. Each pod gets a network namespace with a
veth on the cluster bridge and its own IP; each container is a process started through
podshim.py (own mount and UTS namespaces, volumes bind-mounted at their mountPaths), so pods
reach each other by IP and, through the agent's DNS server, by the names a real cluster gives
them. Images are not pulled: the container's command runs on this host with the project's
.venv/bin first on PATH.

Run by `hack.localcluster.up()`; logs to .cluster/logs/node-agent.log; pod output goes to
.cluster/pods/<namespace>_<pod>/<container>.log.
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from . import config as C
from . import kubeletapi
from .dns import DnsServer
from .kube import ApiError, Kube

LOST_ANNOTATION = C.LOST_ANNOTATION
CLUSTER_DOMAIN = "cluster.local"
SHIM = str(Path(__file__).with_name("podshim.py"))
KUBELET_VERSION = C.VERSIONS["K8S_VERSION"]


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(msg: str) -> None:
    print(f"{now()} {msg}", flush=True)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


class ConfigError(Exception):
    """The container cannot be created yet (missing ConfigMap/Secret key...): retried."""


class Container:
    def __init__(self, spec: dict, init: bool):
        self.spec, self.name, self.init = spec, spec["name"], init
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = ""
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.termlog = ""
        self.log_path = ""
        self.next_start = 0.0  # back-off after a restartable exit

    def status(self, image_id: str) -> dict:
        running = "running" in self.state
        return {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": image_id,
            "containerID": f"sftjob://{self.proc.pid}" if self.proc else "",
            "ready": running and not self.init, "started": running, "restartCount": self.restarts,
            "state": self.state, "lastState": self.last_state,
        }


class PodRunner(threading.Thread):
    def __init__(self, agent: "Agent", pod: dict):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.agent, self.kube, self.cfg = agent, agent.kube, agent.cfg
        self.pod = pod
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.node = pod["spec"]["nodeName"]
        self.cond = threading.Condition()
        self.kill_reason: str | None = None  # set: stop at once (pod object gone, node lost, agent exit)
        self.netns = f"{self.cfg.netns_prefix}{self.uid.replace('-', '')[:10]}"
        self.ip: str | None = None
        self.dir = self.cfg.pods_dir / f"{self.ns}_{self.name}"
        self.run_dir = self.dir / self.uid
        self.inits = [Container(c, True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c, False) for c in pod["spec"]["containers"]]
        self.phase = "Pending"
        self.conditions: dict[str, dict] = {}
        self.start_time = now()
        self.reason = self.message = None

    # ---- events from the agent -------------------------------------------------------------

    def update(self, pod: dict) -> None:
        with self.cond:
            self.pod = pod
            self.cond.notify_all()

    def kill(self, reason: str) -> None:
        with self.cond:
            self.kill_reason = self.kill_reason or reason
            self.cond.notify_all()

    @property
    def deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    def _wait(self, seconds: float) -> None:
        with self.cond:
            if not self.kill_reason:
                self.cond.wait(seconds)

    # ---- status ----------------------------------------------------------------------------

    def _set_cond(self, type_: str, status: bool, reason: str | None = None) -> None:
        s = "True" if status else "False"
        old = self.conditions.get(type_)
        if old and old["status"] == s:
            return
        c = {"type": type_, "status": s, "lastProbeTime": None, "lastTransitionTime": now()}
        if reason:
            c["reason"] = reason
        self.conditions[type_] = c

    def push_status(self, extra_conditions: list[dict] | None = None) -> None:
        running_all = all("running" in c.state for c in self.containers)
        self._set_cond("Initialized", all("terminated" in c.state and c.state["terminated"]["exitCode"] == 0
                                          for c in self.inits) or self.phase != "Pending")
        self._set_cond("ContainersReady", running_all and self.phase == "Running",
                       None if running_all else "ContainersNotReady")
        self._set_cond("Ready", running_all and self.phase == "Running",
                       None if running_all else "ContainersNotReady")
        status = {
            "phase": self.phase, "hostIP": self.cfg.host_ip, "hostIPs": [{"ip": self.cfg.host_ip}],
            "startTime": self.start_time,
            "conditions": list(self.conditions.values()) + (extra_conditions or []),
            "containerStatuses": [c.status(self._image_id(c)) for c in self.containers],
        }
        if self.inits:
            status["initContainerStatuses"] = [c.status(self._image_id(c)) for c in self.inits]
        if self.ip:
            status["podIP"], status["podIPs"] = self.ip, [{"ip": self.ip}]
        if self.reason:
            status["reason"], status["message"] = self.reason, self.message
        try:
            # strategic merge: conditions merge by type, so ones written by others (PodScheduled
            # from the scheduler, DisruptionTarget from the Eviction API) are kept.
            self.kube.strategic_patch(f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status", {"status": status})
        except ApiError as e:
            if e.status != 404:
                log(f"{self.ns}/{self.name}: status update failed: {e}")

    def _image_id(self, c: Container) -> str:
        return f"sftjob-local://{c.spec.get('image', '')}"

    # ---- sandbox ---------------------------------------------------------------------------

    def _setup_sandbox(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ip = self.agent.allocate_ip(self.node, self.uid)
        veth = self.netns
        sh("ip", "netns", "add", self.netns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        sh("ip", "link", "set", veth, "master", self.cfg.bridge, "up")
        sh("ip", "-n", self.netns, "addr", "add", f"{self.ip}/{self.cfg.subnet.prefixlen}", "dev", "eth0")
        sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        sh("ip", "-n", self.netns, "route", "add", "default", "via", self.cfg.host_ip)
        # /etc/hosts and /etc/resolv.conf as the kubelet writes them
        spec = self.pod["spec"]
        hostname = self.hostname
        etc = self.run_dir / "etc"
        etc.mkdir(exist_ok=True)
        fq = f"{hostname}.{spec['subdomain']}.{self.ns}.svc.{CLUSTER_DOMAIN} " if spec.get("subdomain") else ""
        (etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                                   f"{self.ip}\t{fq}{hostname}\n")
        (etc / "resolv.conf").write_text(
            f"search {self.ns}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            f"nameserver {self.cfg.host_ip}\noptions ndots:5\n")

    @property
    def hostname(self) -> str:
        return (self.pod["spec"].get("hostname") or self.name)[:63]

    def _teardown_sandbox(self) -> None:
        for pid in sh("ip", "netns", "pids", self.netns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        sh("ip", "link", "del", self.netns, check=False)
        sh("ip", "netns", "del", self.netns, check=False)
        self.agent.release_ip(self.uid)
        # Volume contents (emptyDir data, Secret copies) go with the pod, as on a real node;
        # the container logs next to run_dir stay until `cluster-down`.
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # ---- volumes and env -------------------------------------------------------------------

    def _get(self, kind: str, name: str, optional: bool) -> dict | None:
        try:
            return self.kube.get(f"/api/v1/namespaces/{self.ns}/{kind}/{name}")
        except ApiError as e:
            if e.status == 404:
                if optional:
                    return None
                raise ConfigError(f'{kind[:-1]} "{name}" not found') from None
            raise

    def _keys(self, kind: str, src: dict) -> dict[str, bytes]:
        obj = self._get(kind, src["name"], src.get("optional", False))
        if obj is None:
            return {}
        if kind == "secrets":
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        else:
            data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        if src.get("items"):
            out = {}
            for it in src["items"]:
                if it["key"] not in data:
                    if src.get("optional"):
                        continue
                    raise ConfigError(f'key "{it["key"]}" not found in {kind[:-1]} {src["name"]}')
                out[it["path"]] = data[it["key"]]
            return out
        return data

    def _field(self, path: str) -> str:
        md, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (md.get(m.group(1)) or {}).get(m.group(2), "")
        simple = {
            "metadata.name": self.name, "metadata.namespace": self.ns, "metadata.uid": self.uid,
            "spec.nodeName": self.node, "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": self.ip or "", "status.podIPs": self.ip or "", "status.hostIP": self.cfg.host_ip,
            "status.hostIPs": self.cfg.host_ip,
        }
        if path == "metadata.labels":
            return "\n".join(f'{k}="{v}"' for k, v in sorted((md.get("labels") or {}).items()))
        if path == "metadata.annotations":
            return "\n".join(f'{k}="{v}"' for k, v in sorted((md.get("annotations") or {}).items()))
        if path not in simple:
            raise ConfigError(f"unsupported fieldRef {path}")
        return simple[path]

    def _write_files(self, root: Path, files: dict[str, bytes], mode: int) -> None:
        for rel, data in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            p.chmod(mode)

    def _token(self, src: dict) -> bytes:
        spec = self.pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": src.get("expirationSeconds", 3607),
                         "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid}}}
        if src.get("audience"):
            body["spec"]["audiences"] = [src["audience"]]
        tr = self.kube.create(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        return tr["status"]["token"].encode()

    def _prepare_volumes(self) -> dict[str, str]:
        """Materialise every volume; returns name -> host path to bind-mount."""
        out = {}
        vroot = self.run_dir / "volumes"
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            path = vroot / name
            if "hostPath" in v:
                hp = v["hostPath"]
                if hp.get("type") == "DirectoryOrCreate":
                    os.makedirs(hp["path"], exist_ok=True)
                elif hp.get("type") == "FileOrCreate" and not os.path.exists(hp["path"]):
                    open(hp["path"], "a").close()
                out[name] = hp["path"]
                continue
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            if "emptyDir" in v:
                path.chmod(0o777)
            elif "configMap" in v:
                src = v["configMap"]
                self._write_files(path, self._keys("configmaps", src), src.get("defaultMode", 0o644))
            elif "secret" in v:
                src = {**v["secret"], "name": v["secret"]["secretName"]}
                self._write_files(path, self._keys("secrets", src), src.get("defaultMode", 0o644))
            elif "downwardAPI" in v:
                self._write_files(path, self._downward(v["downwardAPI"]["items"]), v["downwardAPI"].get("defaultMode", 0o644))
            elif "projected" in v:
                mode = v["projected"].get("defaultMode", 0o644)
                for s in v["projected"].get("sources") or []:
                    if "serviceAccountToken" in s:
                        self._write_files(path, {s["serviceAccountToken"]["path"]: self._token(s["serviceAccountToken"])}, mode)
                    elif "configMap" in s:
                        self._write_files(path, self._keys("configmaps", s["configMap"]), mode)
                    elif "secret" in s:
                        self._write_files(path, self._keys("secrets", s["secret"]), mode)
                    elif "downwardAPI" in s:
                        self._write_files(path, self._downward(s["downwardAPI"]["items"]), mode)
            else:
                raise ConfigError(f"volume {name}: only configMap, secret, emptyDir, hostPath, downwardAPI "
                                  "and projected volumes are supported by the local node agent")
            out[name] = str(path)
        return out

    def _downward(self, items: list[dict]) -> dict[str, bytes]:
        files = {}
        for it in items:
            if "fieldRef" in it:
                files[it["path"]] = self._field(it["fieldRef"]["fieldPath"]).encode()
        return files

    def _env(self, c: dict) -> dict[str, str]:
        spec = self.pod["spec"]
        env = {
            "PATH": f"{C.REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOSTNAME": self.hostname, "HOME": "/root", "PYTHONUNBUFFERED": "1",
            "LANG": "C.UTF-8",
        }
        # In-cluster clients find the API server through these. There is no kube-proxy, so they
        # carry the API server's real address, which every pod can reach.
        if True:
            env.update({"KUBERNETES_SERVICE_HOST": self.cfg.host_ip,
                        "KUBERNETES_SERVICE_PORT": str(self.cfg.apiserver_port),
                        "KUBERNETES_SERVICE_PORT_HTTPS": str(self.cfg.apiserver_port),
                        "KUBERNETES_PORT": f"tcp://{self.cfg.host_ip}:{self.cfg.apiserver_port}"})
        for ef in c.get("envFrom") or []:
            prefix = ef.get("prefix", "")
            if "configMapRef" in ef:
                data = self._keys("configmaps", ef["configMapRef"])
            else:
                data = self._keys("secrets", ef["secretRef"])
            env.update({prefix + k: v.decode(errors="replace") for k, v in data.items()})
        for e in c.get("env") or []:
            if "valueFrom" not in e:
                env[e["name"]] = expand(e.get("value", ""), env)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = self._field(vf["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind, ref = ("configmaps", vf["configMapKeyRef"]) if "configMapKeyRef" in vf else ("secrets", vf["secretKeyRef"])
                data = self._keys(kind, {"name": ref["name"], "optional": ref.get("optional", False)})
                if ref["key"] in data:
                    env[e["name"]] = data[ref["key"]].decode(errors="replace")
                elif not ref.get("optional"):
                    raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind[:-1]} {self.ns}/{ref["name"]}')
            elif "resourceFieldRef" in vf:
                res = vf["resourceFieldRef"]["resource"]
                kind, _, rname = res.partition(".")
                val = (c.get("resources") or {}).get(kind, {}).get(rname)
                if val is None:  # unset limits default to the node's allocatable, as in k8s
                    val = {"cpu": self.cfg.node_cpu, "memory": self.cfg.node_memory}.get(rname, "0")
                env[e["name"]] = str(val)
        return env

    # ---- containers ------------------------------------------------------------------------

    def _start(self, c: Container, volumes: dict[str, str]) -> None:
        spec = c.spec
        env = self._env(spec)
        argv = [expand(a, env) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        if not spec.get("command"):
            raise ConfigError("the local node agent pulls no images, so a container needs a `command`")
        self.dir.mkdir(parents=True, exist_ok=True)
        c.log_path = str(self.dir / f"{c.name}.log")
        c.termlog = str(self.run_dir / f"termination-{c.name}-{c.restarts}")
        Path(c.termlog).write_text("")
        etc = self.run_dir / "etc"
        mounts = [{"src": str(etc / "hosts"), "dst": "/etc/hosts", "ro": True},
                  {"src": str(etc / "resolv.conf"), "dst": "/etc/resolv.conf", "ro": True},
                  {"src": c.termlog, "dst": spec.get("terminationMessagePath") or "/dev/termination-log"}]
        for vm in spec.get("volumeMounts") or []:
            if vm["name"] not in volumes:
                raise ConfigError(f'volumeMount {vm["name"]}: no such volume')
            src = volumes[vm["name"]]
            if vm.get("subPath"):
                src = os.path.join(src, vm["subPath"])
                if not os.path.exists(src):
                    os.makedirs(src)
            mounts.append({"src": src, "dst": vm["mountPath"], "ro": bool(vm.get("readOnly"))})
        # The checkout (its .venv runs the container) must stay visible even under a volume
        # mounted over one of its parents, e.g. an emptyDir at /tmp for a clone in /tmp.
        shim_spec = {"netns": f"/run/netns/{self.netns}", "hostname": self.hostname, "mounts": mounts,
                     "keep": [str(C.REPO)] + ([] if self.cfg.state_dir.resolve().is_relative_to(C.REPO)
                                              else [str(self.cfg.state_dir)]),
                     "cwd": spec.get("workingDir") or "/", "argv": argv, "env": env,
                     "termlog_host": c.termlog, "created_log": str(self.cfg.state_dir / "created-mountpoints")}
        spec_path = self.run_dir / f"{c.name}-{c.restarts}.json"
        spec_path.write_text(json.dumps(shim_spec))
        with open(c.log_path, "ab") as logf:
            c.proc = subprocess.Popen([sys.executable, SHIM, str(spec_path)], stdin=subprocess.DEVNULL,
                                      stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
        c.started_at = now()
        c.state = {"running": {"startedAt": c.started_at}}
        shown = " ".join(argv)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        log(f"{self.ns}/{self.name}: started {c.name} pid {c.proc.pid} ip {self.ip}: {shown}")

    def _reap(self, c: Container) -> bool:
        """Record the container's exit if it has exited; True when it did."""
        if c.proc is None or "running" not in c.state:
            return False
        rc = c.proc.poll()
        if rc is None:
            return False
        code = rc if rc >= 0 else 128 - rc  # killed by signal N: 128+N, as container runtimes report
        msg = ""
        try:
            msg = Path(c.termlog).read_text(errors="replace")[-4096:]
        except OSError:
            pass
        if not msg and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                lines = Path(c.log_path).read_text(errors="replace").splitlines()[-80:]
                msg = "\n".join(lines)[-2048:]
            except OSError:
                pass
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.started_at, "finishedAt": now(), "containerID": f"sftjob://{c.proc.pid}"}
        if msg:
            term["message"] = msg
        c.state = {"terminated": term}
        log(f"{self.ns}/{self.name}: {c.name} exited {code}")
        return True

    def _signal_all(self, sig: int) -> None:
        for c in self.inits + self.containers:
            if c.proc and c.proc.poll() is None:
                try:
                    if sig == signal.SIGKILL:
                        os.killpg(c.proc.pid, sig)  # the whole process group, like a cgroup kill
                    else:
                        os.kill(c.proc.pid, sig)  # SIGTERM goes to the main process only (PID 1)
                except OSError:
                    pass

    def _stop_containers(self, grace: float) -> None:
        """SIGTERM, wait up to grace seconds, then SIGKILL everything left in the sandbox."""
        if any(c.proc and c.proc.poll() is None for c in self.inits + self.containers):
            log(f"{self.ns}/{self.name}: stopping (grace {grace}s)")
            self._signal_all(signal.SIGTERM)
            deadline = time.time() + grace
            while time.time() < deadline and any(c.proc and c.proc.poll() is None for c in self.inits + self.containers):
                time.sleep(0.1)
        self._signal_all(signal.SIGKILL)
        for pid in sh("ip", "netns", "pids", self.netns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        for c in self.inits + self.containers:
            if c.proc:
                c.proc.wait()
                self._reap(c)

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log(f"{self.ns}/{self.name}: runner crashed:\n{traceback.format_exc()}")
            self._signal_all(signal.SIGKILL)
        finally:
            self._teardown_sandbox()
            self.agent.runner_done(self)

    def _restartable(self, c: Container) -> bool:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        code = c.state["terminated"]["exitCode"]
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _restart_later(self, c: Container) -> None:
        c.last_state = c.state
        c.restarts += 1
        delay = min(10 * 2 ** (c.restarts - 1), 300)  # the kubelet's crash-loop back-off
        c.next_start = time.time() + delay
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": f"back-off {delay}s restarting failed container={c.name} pod={self.name}"}}

    def _run(self) -> None:
        if self.deleting:
            self._finish_deletion()
            return
        self._setup_sandbox()
        self._set_cond("PodReadyToStartContainers", True)
        self.push_status()
        volumes = None
        # Init containers one after another, then all containers together; retry whatever
        # cannot be created yet (missing ConfigMap...) as the kubelet does.
        pending = list(self.inits)
        while True:
            if self.kill_reason:
                return self._killed()
            if self.deleting:
                return self._graceful_delete()
            try:
                if volumes is None:
                    volumes = self._prepare_volumes()
                if pending:
                    c = pending[0]
                    if c.proc is None or c.state.get("waiting"):
                        if time.time() >= c.next_start:
                            self._start(c, volumes)
                            self.push_status()
                    elif self._reap(c):
                        if c.state["terminated"]["exitCode"] == 0:
                            pending.pop(0)
                        elif self._restartable(c):
                            self._restart_later(c)
                        else:
                            self.phase = "Failed"
                            self.push_status()
                            return
                        self.push_status()
                else:
                    break
            except ConfigError as e:
                reason = "CreateContainerConfigError" if volumes is not None else "ContainerCreating"
                for c in pending[:1] or self.containers:
                    if c.state.get("waiting", {}).get("message") != str(e):
                        c.state = {"waiting": {"reason": reason, "message": str(e)}}
                        self.push_status()
                self._wait(1)
            self._wait(0.2)
        # main containers
        while True:
            if self.kill_reason:
                return self._killed()
            if self.deleting:
                return self._graceful_delete()
            changed = False
            try:
                for c in self.containers:
                    if "waiting" in c.state and time.time() >= c.next_start:
                        self._start(c, volumes)
                        changed = True
            except ConfigError as e:
                for c in self.containers:
                    if "waiting" in c.state:
                        c.next_start = time.time() + 1  # retry, without hammering the API server
                        if c.state["waiting"].get("message") != str(e):
                            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                            changed = True
            for c in self.containers:
                if self._reap(c):
                    changed = True
                    if self._restartable(c):
                        self._restart_later(c)
            states = [c.state for c in self.containers]
            if all("terminated" in s for s in states):
                self.phase = "Succeeded" if all(s["terminated"]["exitCode"] == 0 for s in states) else "Failed"
                self.push_status()
                return
            if self.phase == "Pending" and all("running" in s for s in states):
                self.phase = "Running"
                changed = True
            if changed:
                self.push_status()
            self._wait(0.2)

    def _graceful_delete(self) -> None:
        md = self.pod["metadata"]
        grace = md.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        self._stop_containers(float(grace))
        self._final_phase()
        self.push_status()
        self._finish_deletion()

    def _final_phase(self) -> None:
        codes = [c.state["terminated"]["exitCode"] for c in self.containers if "terminated" in c.state]
        ran = any(c.proc for c in self.containers)
        # a pod stopped before or while running ends Failed unless every container exited 0
        self.phase = "Succeeded" if ran and codes and all(x == 0 for x in codes) and \
            len(codes) == len(self.containers) else "Failed"

    def _finish_deletion(self) -> None:
        """The kubelet's last word on a terminated pod: remove the object for good."""
        try:
            self.kube.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                             {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiError as e:
            if e.status not in (404, 409):
                log(f"{self.ns}/{self.name}: final delete failed: {e}")
        log(f"{self.ns}/{self.name}: deleted")

    def _killed(self) -> None:
        reason = self.kill_reason
        self._stop_containers(0)
        if reason == "NodeLost":
            self.phase = "Failed"
            self.reason = "NodeLost"
            self.message = f"Node {self.node} which was running pod {self.name} is unresponsive"
            self.push_status([{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                               "message": "Taint manager: deleting due to NoExecute taint (node lost)",
                               "lastTransitionTime": now(), "lastProbeTime": None}])
        elif reason == "AgentStopping":
            self._final_phase()
            self.push_status()


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion in command, args and env values; $$ escapes a literal $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, s)


class Agent:
    def __init__(self, cfg: C.ClusterConfig):
        self.cfg = cfg
        self.kube = Kube.from_state(cfg)
        self.lock = threading.RLock()
        self.pods: dict[str, dict] = {}            # uid -> pod, every pod of the cluster (for DNS)
        self.services: dict[tuple[str, str], dict] = {}
        self.runners: dict[str, PodRunner] = {}    # uid -> runner of a pod on our nodes
        self.handled: set[str] = set()             # uids whose run is over (never run them again)
        self.ips: dict[str, str] = {}              # uid -> pod IP
        self.lost: set[str] = set()
        self.transitions: dict[str, tuple[bool, str]] = {}  # node -> (ready, since)
        self.stopping = threading.Event()
        self.synced = False

    # ---- IPs -------------------------------------------------------------------------------

    def allocate_ip(self, node: str, uid: str) -> str:
        net = self.cfg.node_subnet(self.cfg.nodes.index(node))
        with self.lock:
            used = set(self.ips.values())
            for host in list(net.hosts())[1:]:  # .1 stays free (a gateway in a real cluster)
                if str(host) not in used:
                    self.ips[uid] = str(host)
                    return str(host)
        raise RuntimeError(f"no pod IP left on {node}")

    def release_ip(self, uid: str) -> None:
        with self.lock:
            self.ips.pop(uid, None)

    # ---- nodes -----------------------------------------------------------------------------

    def _node_status(self, node: str, ready: bool) -> dict:
        cap = {"cpu": self.cfg.node_cpu, "memory": self.cfg.node_memory, "pods": self.cfg.node_pods,
               "ephemeral-storage": "100Gi"}
        t = now()
        # lastTransitionTime moves only when readiness changes, as with the kubelet
        prev = self.transitions.get(node)
        if prev is None or prev[0] != ready:
            self.transitions[node] = (ready, t)
        since = self.transitions[node][1]
        if ready:
            readyc = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                      "message": "sftjob node agent is posting ready status"}
        else:
            readyc = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                      "message": "Kubelet stopped posting node status."}
        conds = [{**readyc, "lastHeartbeatTime": t, "lastTransitionTime": since}]
        for type_, reason in (("MemoryPressure", "KubeletHasSufficientMemory"),
                              ("DiskPressure", "KubeletHasNoDiskPressure"), ("PIDPressure", "KubeletHasSufficientPID")):
            conds.append({"type": type_, "status": "False" if ready else "Unknown", "reason": reason,
                          "lastHeartbeatTime": t, "lastTransitionTime": since})
        return {"capacity": cap, "allocatable": cap, "conditions": conds,
                "addresses": [{"type": "InternalIP", "address": self.cfg.host_ip}, {"type": "Hostname", "address": node}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.cfg.kubelet_port}},
                "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": os.uname().release,
                             "osImage": "sftjob local node", "containerRuntimeVersion": "sftjob-local://1",
                             "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "", "operatingSystem": "linux",
                             "architecture": "amd64"}}

    def register_nodes(self) -> None:
        for i, node in enumerate(self.cfg.nodes):
            body = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux",
                                                          "kubernetes.io/arch": "amd64", "sftjob.io/local-node": "true"}},
                    "spec": {"podCIDR": str(self.cfg.node_subnet(i)), "podCIDRs": [str(self.cfg.node_subnet(i))]}}
            try:
                self.kube.create("/api/v1/nodes", body)
            except ApiError as e:
                if e.status != 409:
                    raise
            self._set_ready(node, node not in self.lost)
            self._set_lost_taints(node, node in self.lost)
        log(f"registered nodes {', '.join(self.cfg.nodes)}")

    def _set_ready(self, node: str, ready: bool) -> None:
        self.kube.strategic_patch(f"/api/v1/nodes/{node}/status", {"status": self._node_status(node, ready)})

    def _set_lost_taints(self, node: str, lost: bool) -> None:
        """Taints as the node lifecycle controller keeps them: none on a Ready node (the API
        server puts not-ready on every new Node), unreachable on a lost one."""
        n = self.kube.get(f"/api/v1/nodes/{node}")
        ours = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
        taints = [t for t in n["spec"].get("taints") or [] if t["key"] not in ours]
        if lost:
            taints += [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
                       {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": now()}]
        self.kube.merge_patch(f"/api/v1/nodes/{node}", {"spec": {"taints": taints or None}})

    def node_loop(self) -> None:
        """Heartbeats, and the node-loss simulation: a node annotated lost stops its pods at once
        (SIGKILL, as if the machine vanished) and reports NotReady with the unreachable taints."""
        last_beat = 0.0
        while not self.stopping.is_set():
            try:
                beat = time.time() - last_beat > 20
                for node in self.cfg.nodes:
                    try:
                        n = self.kube.get(f"/api/v1/nodes/{node}")
                    except ApiError as e:
                        if e.status == 404:
                            self.register_nodes()
                            continue
                        raise
                    lost = (n["metadata"].get("annotations") or {}).get(LOST_ANNOTATION) == "true"
                    if lost and node not in self.lost:
                        log(f"node {node}: simulating node loss")
                        self.lost.add(node)
                        with self.lock:
                            victims = [r for r in self.runners.values() if r.node == node]
                        for r in victims:
                            r.kill("NodeLost")
                        for r in victims:
                            r.join(30)
                        self._set_ready(node, False)
                        self._set_lost_taints(node, True)
                    elif not lost and node in self.lost:
                        log(f"node {node}: back")
                        self.lost.discard(node)
                        self._set_lost_taints(node, False)
                        self._set_ready(node, True)
                        self.resync_pods()
                    elif beat and node not in self.lost:
                        self._set_ready(node, True)
                if beat:
                    last_beat = time.time()
            except Exception as e:
                log(f"node loop: {e}")
            self.stopping.wait(1)

    # ---- pods ------------------------------------------------------------------------------

    def on_pod(self, etype: str, pod: dict) -> None:
        md, spec = pod["metadata"], pod["spec"]
        uid = md["uid"]
        with self.lock:
            if etype == "DELETED":
                self.pods.pop(uid, None)
            else:
                self.pods[uid] = pod
            runner = self.runners.get(uid)
        if spec.get("nodeName") not in self.cfg.nodes:
            return
        if etype == "DELETED":
            if runner:
                runner.kill("Deleted")
            return
        if runner:
            runner.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase", "Pending")
        path = f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}"
        if uid in self.handled or phase in ("Succeeded", "Failed") or spec["nodeName"] in self.lost:
            if md.get("deletionTimestamp") and (phase in ("Succeeded", "Failed") or spec["nodeName"] in self.lost
                                                or uid in self.handled):
                try:
                    self.kube.delete(path, {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
                except ApiError:
                    pass
            return
        if phase == "Running":
            # Running, but no process of ours: left over from an agent that died. Its containers
            # are gone, so report that instead of pretending.
            self.handled.add(uid)
            try:
                self.kube.strategic_patch(path + "/status", {"status": {
                    "phase": "Failed", "reason": "NodeAgentRestarted",
                    "message": "the node agent restarted and lost this pod's processes"}})
            except ApiError:
                pass
            return
        r = PodRunner(self, pod)
        with self.lock:
            self.runners[uid] = r
        r.start()

    def runner_done(self, r: PodRunner) -> None:
        with self.lock:
            self.handled.add(r.uid)
            self.runners.pop(r.uid, None)
            latest = self.pods.get(r.uid)
        # a deletion that arrived while the runner was finishing a terminal pod
        if latest and latest["metadata"].get("deletionTimestamp") and not r.kill_reason:
            self.on_pod("MODIFIED", latest)

    def resync_pods(self) -> None:
        with self.lock:
            pods = list(self.pods.values())
        for p in pods:
            self.on_pod("MODIFIED", p)

    def watch_loop(self, path: str, handler) -> None:
        while not self.stopping.is_set():
            try:
                lst = self.kube.get(path)
                rv = lst["metadata"]["resourceVersion"]
                handler("SYNC", lst["items"])
                while not self.stopping.is_set():
                    for ev in self.kube.watch(path, rv, timeout_s=240):
                        if ev["type"] == "ERROR":
                            raise RuntimeError(f"watch {path}: {ev['object'].get('message')}")
                        rv = ev["object"]["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            handler(ev["type"], ev["object"])
                        if self.stopping.is_set():
                            return
            except Exception as e:
                if not self.stopping.is_set():
                    log(f"watch {path}: {e}; relisting")
                    time.sleep(1)

    def _pods_handler(self, etype, obj) -> None:
        if etype == "SYNC":
            uids = {p["metadata"]["uid"] for p in obj}
            with self.lock:
                gone = [u for u in self.pods if u not in uids]
            for u in gone:
                old = self.pods.get(u)
                if old:
                    self.on_pod("DELETED", old)
            for p in obj:
                self.on_pod("MODIFIED", p)
            self.synced = True
        else:
            self.on_pod(etype, obj)

    def _services_handler(self, etype, obj) -> None:
        with self.lock:
            if etype == "SYNC":
                self.services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in obj}
            elif etype == "DELETED":
                self.services.pop((obj["metadata"]["namespace"], obj["metadata"]["name"]), None)
            else:
                self.services[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj

    # ---- DNS -------------------------------------------------------------------------------

    def _endpoint_ok(self, pod: dict, svc: dict) -> bool:
        sel = svc["spec"].get("selector") or {}
        labels = pod["metadata"].get("labels") or {}
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            return False
        st = pod.get("status") or {}
        if not st.get("podIP") or pod["spec"].get("nodeName") in self.lost:
            return False
        if svc["spec"].get("publishNotReadyAddresses"):
            return st.get("phase") in ("Pending", "Running")
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
        return st.get("phase") == "Running" and ready and not pod["metadata"].get("deletionTimestamp")

    def resolve(self, name: str) -> list[str] | None:
        name = name.lower().rstrip(".")
        suffix = f".svc.{CLUSTER_DOMAIN}"
        if not (name == CLUSTER_DOMAIN or name.endswith("." + CLUSTER_DOMAIN)):
            return None
        if name in (f"kubernetes.default{suffix}",):
            return [self.cfg.host_ip]  # the API server itself: no kube-proxy needed to reach it
        if not name.endswith(suffix):
            return []
        parts = name[: -len(suffix)].split(".")
        with self.lock:
            if len(parts) == 2:  # <service>.<namespace>
                svc = self.services.get((parts[1], parts[0]))
                if not svc:
                    return []
                if svc["spec"].get("clusterIP") not in (None, "None"):
                    return [svc["spec"]["clusterIP"]]
                return sorted(p["status"]["podIP"] for p in self.pods.values()
                              if p["metadata"]["namespace"] == parts[1] and self._endpoint_ok(p, svc))
            if len(parts) == 3:  # <hostname>.<subdomain>.<namespace>
                host, sub, ns = parts
                svc = self.services.get((ns, sub))
                if not svc or svc["spec"].get("clusterIP") != "None":
                    return []
                return [p["status"]["podIP"] for p in self.pods.values()
                        if p["metadata"]["namespace"] == ns and p["spec"].get("subdomain") == sub
                        and (p["spec"].get("hostname") or p["metadata"]["name"]) == host
                        and self._endpoint_ok(p, svc)][:1]
        return []

    def _pod_running(self, ns: str, name: str) -> bool:
        with self.lock:
            return any(r.ns == ns and r.name == name for r in self.runners.values())

    # ---- main ------------------------------------------------------------------------------

    def cleanup_stale(self) -> None:
        for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
            ns = line.split()[0] if line.split() else ""
            if ns.startswith(self.cfg.netns_prefix):
                for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                sh("ip", "link", "del", ns, check=False)
                sh("ip", "netns", "del", ns, check=False)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        self.cleanup_stale()
        upstream = None
        try:
            for line in Path("/etc/resolv.conf").read_text().splitlines():
                if line.startswith("nameserver"):
                    upstream = line.split()[1]
                    break
        except OSError:
            pass
        dns = DnsServer(self.cfg.host_ip, self.resolve, upstream)
        threading.Thread(target=dns.serve_forever, daemon=True, name="dns").start()
        kubelet = None
        if (self.cfg.pki / "kubelet.crt").exists():
            kubelet = kubeletapi.serve(self.cfg.host_ip, self.cfg.kubelet_port, self.cfg.pods_dir,
                                       self.cfg.pki / "kubelet.crt", self.cfg.pki / "kubelet.key", self._pod_running)
        threading.Thread(target=self.watch_loop, args=("/api/v1/services", self._services_handler),
                         daemon=True, name="services").start()
        threading.Thread(target=self.watch_loop, args=("/api/v1/pods", self._pods_handler),
                         daemon=True, name="pods").start()
        self.register_nodes()
        threading.Thread(target=self.node_loop, daemon=True, name="nodes").start()
        log(f"node agent up: nodes {self.cfg.nodes}, DNS on {self.cfg.host_ip}:53")
        self.stopping.wait()
        log("stopping: killing all pods")
        with self.lock:
            runners = list(self.runners.values())
        for r in runners:
            r.kill("AgentStopping")
        for r in runners:
            r.join(20)
        dns.close()
        if kubelet:
            kubelet.shutdown()
        self.cleanup_stale()
        log("node agent stopped")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", required=True)
    args = ap.parse_args()
    cfg = C.load()
    if cfg.state_dir != Path(args.state_dir).resolve():
        sys.exit(f"--state-dir {args.state_dir} does not match SFTJOB_CLUSTER_DIR ({cfg.state_dir})")
    Agent(cfg).run()


if __name__ == "__main__":
    main()
