"""Kueue (kubernetes-sigs/kueue) on the local cluster, optional: `make cluster-up KUEUE=1`,
`python -m hack.localcluster kueue-up`, or `kueue_up()` from the tests that need it.

Kueue runs as a host process like the other components (pid file, log, stopped by `down`),
with the `pod` integration only: pods carrying `kueue.x-k8s.io/queue-name` in a namespace
labelled `localcluster.sftjob.io/kueue=true` are gated by its webhook until their Workload
is admitted. Namespaces without the label never see Kueue's pod webhook, so the rest of the
test suite is unaffected whether Kueue runs or not.

What running it outside a Deployment takes:
- its webhook serves on the bridge address with a certificate signed by the cluster's CA (IP
  SAN), and the webhook configurations call it by URL instead of by Service;
- with internal certificate management off, v0.17 reads its metrics certificate from the
  fixed path /etc/kueue/metrics/certs: it runs in its own mount namespace with an overlay on
  /etc whose upper layer (under the state directory) holds that certificate, so the host's
  /etc is never written;
- the VisibilityOnDemand feature gate (on by default) wants its own certificates: it is off.
"""
from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

from . import cluster, proc
from . import config as C
from .components import kube_bin, start
from .kube import ApiError, Kube, wait_crds_established
from .proc import log, sh

NAMESPACE_LABEL = "localcluster.sftjob.io/kueue"
WEBHOOK_PORT = int(os.environ.get("SFTJOB_KUEUE_WEBHOOK_PORT", "19443"))
HEALTH_PORT = int(os.environ.get("SFTJOB_KUEUE_HEALTH_PORT", "18081"))
METRICS_PORT = int(os.environ.get("SFTJOB_KUEUE_METRICS_PORT", "18443"))
MUTATING = "sftjob-local-kueue-mutating"
VALIDATING = "sftjob-local-kueue-validating"


# _yaml_note: PyYAML is imported where it is used. `python3 -m hack.localcluster` (make's
# cluster-down, and the heartbeat around `make install`'s pip) runs before .venv holds it, and
# the package imports this module.
def _dump(obj: dict) -> str:
    import yaml
    return yaml.safe_dump(obj)


def _home() -> Path:
    return C.bin_dir("kueue").parent


def _dir(cfg: C.ClusterConfig) -> Path:
    return cfg.state_dir / "kueue"


def _certs(cfg: C.ClusterConfig) -> None:
    """Webhook and metrics serving certificates (IP SAN: the bridge address), signed by the
    cluster's CA so the API server trusts the webhook with the CA it already has."""
    d, pki = _dir(cfg), cfg.pki
    webhook = d / "webhook-certs"
    metrics = d / "etc" / "kueue" / "metrics" / "certs"
    if (webhook / "tls.crt").exists() and (metrics / "tls.crt").exists():
        return
    webhook.mkdir(parents=True, exist_ok=True)
    metrics.mkdir(parents=True, exist_ok=True)
    ext = d / "serving.ext"
    ext.write_text("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                   f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{cfg.host_ip},IP:127.0.0.1\n")
    sh("openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(webhook / "tls.key"),
                "-out", str(d / "serving.csr"), "-subj", "/CN=kueue-webhook")
    sh("openssl", "x509", "-req", "-in", str(d / "serving.csr"), "-CA", str(pki / "ca.crt"),
                "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650", "-extfile", str(ext),
                "-out", str(webhook / "tls.crt"))
    for f in ("tls.crt", "tls.key"):
        (metrics / f).write_bytes((webhook / f).read_bytes())


def _config(cfg: C.ClusterConfig) -> Path:
    d = _dir(cfg)
    conf = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{HEALTH_PORT}"},
        "metrics": {"bindAddress": f"127.0.0.1:{METRICS_PORT}"},
        "webhook": {"host": cfg.host_ip, "port": WEBHOOK_PORT, "certDir": str(d / "webhook-certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
        "integrations": {"frameworks": ["pod"]},
    }
    path = d / "config.yaml"
    import yaml  # here, not at the top: see _yaml_note
    path.write_text(yaml.safe_dump(conf, sort_keys=False))
    return path


def _webhooks(cfg: C.ClusterConfig) -> list[dict]:
    """Kueue's webhook configurations, reduced to its own objects and pods, called by URL."""
    import base64
    ca = base64.b64encode((cfg.pki / "ca.crt").read_bytes()).decode()
    out = []
    import yaml  # see _yaml_note
    for doc in yaml.safe_load_all((_home() / "config" / "webhook.yaml").read_text()):
        if not doc:
            continue
        keep = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if "kueue-x-k8s-io" not in path and path not in ("/mutate--v1-pod", "/validate--v1-pod"):
                continue
            hook["clientConfig"] = {"url": f"https://{cfg.host_ip}:{WEBHOOK_PORT}{path}", "caBundle": ca}
            if path.endswith("--v1-pod"):
                hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
            keep.append(hook)
        doc["metadata"] = {"name": MUTATING if doc["kind"].startswith("Mutating") else VALIDATING}
        doc["webhooks"] = keep
        out.append(doc)
    return out


def _kubectl(cfg: C.ClusterConfig, *args: str, input: str | None = None) -> None:
    subprocess.run([kube_bin("kubectl"), f"--kubeconfig={cfg.kubeconfig}", *args], check=True,
                   capture_output=True, text=True, input=input, timeout=180)


def _healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{HEALTH_PORT}/readyz", timeout=3) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - any failure to answer is 'not ready'
        return False


def is_up(cfg: C.ClusterConfig | None = None) -> bool:
    cfg = cfg or C.load()
    return proc.alive(proc.read_pid(cfg, "kueue"), str(cfg.state_dir)) and _healthy()


def kueue_up(cfg: C.ClusterConfig | None = None, timeout: float = 180) -> C.ClusterConfig:
    """Build Kueue if needed, install its CRDs, start it and register its webhooks. A no-op
    when it runs and is ready. The cluster itself must be up."""
    cfg = cfg or C.load()
    cluster.ensure_binaries(("kueue",))
    if is_up(cfg):
        return cfg
    with proc.locked(cfg):
        if not proc.alive(proc.read_pid(cfg, "kueue"), str(cfg.state_dir)):
            t0 = time.time()
            _certs(cfg)
            conf = _config(cfg)
            _kubectl(cfg, "apply", "--server-side", "--force-conflicts", "-f", str(_home() / "config" / "crd"))
            kube = Kube.from_state(cfg)
            wait_crds_established(kube, *[f"{p.name.split('_', 1)[1][:-len('.yaml')]}.{p.name.split('_', 1)[0]}"
                                          for p in sorted((_home() / "config" / "crd").glob("*.yaml"))])
            try:
                kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": "kueue-system"}})
            except ApiError as e:
                if e.status != 409:
                    raise
            d = _dir(cfg)
            for sub in ("overlay-work",):
                (d / sub).mkdir(parents=True, exist_ok=True)
            # Own mount namespace; /etc overlaid so /etc/kueue/metrics/certs exists only here.
            script = ('mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc && '
                      'shift 2 && exec "$@"')
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                    str(d / "etc"), str(d / "overlay-work"),
                    str(_home() / "bin" / "kueue"), f"--config={conf}", "--feature-gates=VisibilityOnDemand=false",
                    "--zap-log-level=info"]
            start(cfg, "kueue", argv, {**os.environ, "KUBECONFIG": str(cfg.kubeconfig)})
            deadline = time.time() + timeout
            while not _healthy():
                if time.time() > deadline or not proc.running(proc.read_pid(cfg, "kueue")):
                    tail = "\n".join((cfg.logs / "kueue.log").read_text(errors="replace").splitlines()[-30:])
                    raise RuntimeError(f"kueue did not become ready; last log lines:\n{tail}")
                time.sleep(0.5)
            hooks = _webhooks(cfg)
            _kubectl(cfg, "apply", "--server-side", "--force-conflicts", "-f", "-",
                     input="\n---\n".join(_dump(h) for h in hooks))
            log(f"kueue ready in {time.time() - t0:.1f}s (webhook https://{cfg.host_ip}:{WEBHOOK_PORT})")
    # The webhook configuration is read by the API server asynchronously: wait until a
    # Kueue object is actually defaulted through it (a ResourceFlavor dry-run).
    _wait_webhook(cfg)
    return cfg


def _wait_webhook(cfg: C.ClusterConfig, timeout: float = 60) -> None:
    kube = Kube.from_state(cfg)
    body = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}}
    deadline = time.time() + timeout
    while True:
        try:
            kube.request("POST", "/apis/kueue.x-k8s.io/v1beta2/resourceflavors", body, params={"dryRun": "All"})
            return
        except (ApiError, OSError) as e:
            if time.time() > deadline:
                raise RuntimeError(f"kueue's webhook not reachable through the API server: {e}") from None
            time.sleep(0.5)


def enable_namespace(namespace: str, cfg: C.ClusterConfig | None = None) -> None:
    """Let Kueue manage the pods of one namespace (its pod webhook and namespace selector)."""
    Kube.from_state(cfg or C.load()).merge_patch(f"/api/v1/namespaces/{namespace}",
                                                 {"metadata": {"labels": {NAMESPACE_LABEL: "true"}}})


def kueue_down(cfg: C.ClusterConfig | None = None) -> None:
    """Unregister the webhooks (a pod create would otherwise fail in labelled namespaces) and
    stop Kueue. Its CRDs and objects stay."""
    cfg = cfg or C.load()
    kube = Kube.from_state(cfg)
    for kind, name in (("mutatingwebhookconfigurations", MUTATING), ("validatingwebhookconfigurations", VALIDATING)):
        try:
            kube.delete(f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}")
        except (ApiError, OSError):
            pass
    proc.stop(cfg, "kueue")
