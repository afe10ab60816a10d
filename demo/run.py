"""`make demo`: the whole system end to end on the local cluster.

    python demo/run.py                  # what `make demo` runs
    DEMO_STEPS=12 python demo/run.py    # a shorter training run (the CI test uses this)

Stages (each printed as it starts):
  1. install what is missing (cluster binaries, Prometheus), start the local cluster,
     `helm upgrade --install` the chart (operator namespace-scoped to the demo namespace),
     start Prometheus scraping the operator and the rank-0 trainer;
  2. make the tiny model + data, upload them to MinIO, create the credentials Secret;
  3. `kubectl apply -f examples/sftjob.yaml` and follow `kubectl get sft`;
  4. after the first committed checkpoint, evict one training pod through the Eviction API
     and show the gang restart and the step it resumed from;
  5. download the exported model from status.output.uri, load it with transformers and
     generate next to the base model;
  6. summarise the run from Prometheus' HTTP API and draw the loss curve (.demo/loss.png);
  7. leave the cluster running.

Idempotent: a second run reuses the cluster, upgrades the release, re-creates the job.
A machine-readable summary goes to .demo/summary.json (the test reads it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from demo import prom as promlib  # noqa: E402
from hack import localcluster  # noqa: E402
from hack.localcluster.kube import ApiError, Kube  # noqa: E402

EXAMPLE = REPO / "examples" / "sftjob.yaml"
CHART = REPO / "charts" / "sftjob-operator"
DASHBOARD = CHART / "dashboards" / "sftjob.json"
CRD_NAME = "sftjobs.sftjob.io"
GROUP_PATH = "/apis/sftjob.io/v1alpha1"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
STAGES = 7
TTY = sys.stdout.isatty()


def _load_example_assets():
    """examples/assets.py (upload + Secret), imported by path: examples/ is not a package."""
    spec = importlib.util.spec_from_file_location("sftjob_example_assets", REPO / "examples" / "assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------ output

class Out:
    def __init__(self) -> None:
        self.t0 = time.time()
        self.stage_t0 = self.t0
        self.timings: dict[str, float] = {}
        self._current: str | None = None
        self._open_line = False

    def stage(self, n: int, title: str) -> None:
        self._close_stage()
        self.end_line()
        self._current = f"{n}. {title}"
        self.stage_t0 = time.time()
        print(f"\n\033[1m==> [{n}/{STAGES}] {title}\033[0m" if TTY else f"\n==> [{n}/{STAGES}] {title}", flush=True)

    def _close_stage(self) -> None:
        if self._current:
            self.timings[self._current] = round(time.time() - self.stage_t0, 1)

    def say(self, msg: str = "") -> None:
        self.end_line()
        print(f"    {msg}" if msg else "", flush=True)

    def cmd(self, text: str) -> None:
        self.say(f"$ {text}")

    def progress(self, line: str, newline: bool) -> None:
        """One updating line on a terminal; a new line only when asked (phase/step change)."""
        if TTY and not newline:
            print(f"\r\033[K    {line}", end="", flush=True)
            self._open_line = True
        else:
            self.end_line()
            print(f"    {line}", flush=True)

    def end_line(self) -> None:
        if self._open_line:
            print(flush=True)
            self._open_line = False

    def done(self) -> None:
        self._close_stage()
        self.end_line()
        self.timings["total"] = round(time.time() - self.t0, 1)


# ------------------------------------------------------------------------------ cluster

class Ctx:
    def __init__(self, args: argparse.Namespace, out: Out):
        self.args = args
        self.out = out
        self.cfg = None
        self.kube: Kube | None = None
        self.env: dict[str, str] = {}
        self.kubectl_bin = ""
        self.helm_bin = ""
        self.summary: dict[str, Any] = {"namespace": args.namespace, "release": args.release,
                                        "system_namespace": args.system_namespace}

    def run(self, argv: list[str], input: str | None = None, check: bool = True, show: str | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        if show:
            self.out.cmd(show)
        res = subprocess.run(argv, input=input, capture_output=True, text=True, env={**os.environ, **self.env},
                             timeout=timeout)
        if check and res.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run([self.kubectl_bin, *args], **kw)

    def helm(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run([self.helm_bin, *args], **kw)

    def job_path(self) -> str:
        return f"{GROUP_PATH}/namespaces/{self.args.namespace}/sftjobs/{self.args.job}"

    def get_job(self) -> dict | None:
        try:
            return self.kube.get(self.job_path())
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def pods(self, ns: str, selector: str) -> list[dict]:
        return self.kube.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=selector)["items"]

    def ensure_namespace(self, name: str) -> None:
        try:
            self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": name, "labels": RESTRICTED}})
        except ApiError as e:
            if e.status != 409:
                raise
            self.kube.merge_patch(f"/api/v1/namespaces/{name}", {"metadata": {"labels": RESTRICTED}})
        deadline = time.time() + 60
        while time.time() < deadline:  # pods are refused until the default ServiceAccount exists
            try:
                self.kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
                return
            except ApiError:
                time.sleep(0.5)
        raise SystemExit(f"no default ServiceAccount in {name} after 60 s")


def stage_cluster(ctx: Ctx) -> None:
    out, args = ctx.out, ctx.args
    out.stage(1, "Installing what is missing, starting the local cluster, installing the chart with Helm")
    out.say(f"venv: {sys.prefix} (python {sys.version.split()[0]})")
    missing = [c for c in ("k8s", "etcd", "helm", "minio", "kwok")
               if not (localcluster.bin_dir(c).parent / ".built").exists()]
    out.say("Go-built binaries: " + (f"building {' '.join(missing)} into {localcluster.bin_dir('k8s').parent.parent}"
                                     " (cold: about 28 min on 2 cores, see hack/README.md)" if missing else
                                     f"cached in {localcluster.bin_dir('k8s').parent.parent}"))
    t = time.time()
    ctx.cfg = localcluster.up()
    out.say(f"local cluster up ({time.time() - t:.0f} s): API server {ctx.cfg.apiserver_url}, "
            f"MinIO {ctx.cfg.s3_endpoint}, nodes {', '.join(ctx.cfg.nodes)}")
    ctx.env = localcluster.env(ctx.cfg)
    ctx.kube = Kube.from_state(ctx.cfg)
    ctx.kubectl_bin = str(localcluster.bin_dir("k8s") / "kubectl")
    ctx.helm_bin = str(localcluster.bin_dir("helm") / "helm")
    ctx.prom_exe = promlib.ensure_installed(out.say)
    out.say(f"prometheus: {ctx.prom_exe}")

    # The operator's namespace and the namespace it watches, both enforcing the `restricted`
    # Pod Security Standard (the chart's operator pod and the training pods meet it).
    for ns in (args.system_namespace, args.namespace):
        ctx.ensure_namespace(ns)
    # A CRD applied earlier with kubectl (or by another release) is adopted, as the chart
    # README says, so that the release manages it.
    try:
        crd = ctx.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
        ann = crd["metadata"].get("annotations", {})
        if (ann.get("meta.helm.sh/release-name"), ann.get("meta.helm.sh/release-namespace")) != \
                (args.release, args.system_namespace):
            out.say(f"adopting the existing CRD {CRD_NAME} into release {args.release}")
            ctx.kubectl("label", "--overwrite", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm")
            ctx.kubectl("annotate", "--overwrite", "crd", CRD_NAME, f"meta.helm.sh/release-name={args.release}",
                        f"meta.helm.sh/release-namespace={args.system_namespace}")
    except ApiError as e:
        if e.status != 404:
            raise
    t = time.time()
    existed = ctx.helm("status", args.release, "-n", args.system_namespace, check=False).returncode == 0
    ctx.helm("upgrade", "--install", args.release, str(CHART), "-n", args.system_namespace,
             "--set", f"watchNamespaces={{{args.namespace}}}", "--set", "operator.logFormat=plain",
             "--wait", "--timeout", "300s",
             show=f"helm upgrade --install {args.release} charts/sftjob-operator -n {args.system_namespace} "
                  f"--set 'watchNamespaces={{{args.namespace}}}' --wait", timeout=400)
    if existed:
        # `make images` rebuilt the operator image from this checkout under the same tag:
        # restart the Deployment so that its pods run it.
        deps = ctx.kube.get(f"/apis/apps/v1/namespaces/{args.system_namespace}/deployments",
                            labelSelector=f"app.kubernetes.io/instance={args.release}")["items"]
        deploy = f"deployment/{deps[0]['metadata']['name']}"
        ctx.kubectl("-n", args.system_namespace, "rollout", "restart", deploy,
                    show=f"kubectl -n {args.system_namespace} rollout restart {deploy}   "
                         "# pods on the operator image just rebuilt")
        ctx.kubectl("-n", args.system_namespace, "rollout", "status", deploy, "--timeout=180s", timeout=200)
    op = wait_for(lambda: _operator_pod(ctx), 120, "the operator pod to run")
    ctx.summary["operator_pod"] = op["metadata"]["name"]
    ctx.summary.setdefault("pods", {})["operator"] = _runs_as(ctx, args.system_namespace, op["metadata"]["name"])
    out.say(f"operator pod {args.system_namespace}/{op['metadata']['name']} (the leader of 2 replicas) running "
            f"as ServiceAccount {op['spec'].get('serviceAccountName')} (helm: {time.time() - t:.0f} s)")

    # Prometheus, scraping the operator and (once it exists) the rank-0 trainer.
    ctx.prom = promlib.Prometheus(args.workdir / "prometheus", args.prometheus_port)
    ctx.prom.start(ctx.prom_exe)
    ctx.scraper = TargetWriter(ctx)
    ctx.scraper.start()
    wait_for(lambda: ctx.prom.scraped_ok("sftjob-operator"), 60, "Prometheus to scrape the operator")
    out.say(f"Prometheus {ctx.prom.url} scraping the operator and the rank-0 trainer every "
            f"{promlib.SCRAPE_INTERVAL} (config {ctx.prom.workdir / 'prometheus.yml'})")


def _runs_as(ctx: Ctx, ns: str, pod: str) -> dict:
    """Which image a running pod's first container runs (the runtime's imageID) and as which
    uid, asked inside the container (kubectl exec)."""
    p = ctx.kube.get(f"/api/v1/namespaces/{ns}/pods/{pod}")
    cs = p["status"]["containerStatuses"][0]
    uid = ctx.kubectl("-n", ns, "exec", pod, "-c", cs["name"], "--", "id", "-u",
                      show=f"kubectl -n {ns} exec {pod} -- id -u").stdout.strip()
    info = {"pod": pod, "image": cs["image"], "imageID": cs["imageID"], "uid": uid}
    ctx.out.say(f"{pod} runs {cs['image']} ({cs['imageID'][:19]}...) as uid {uid}")
    return info


def _operator_pod(ctx: Ctx) -> dict | None:
    """The replica that acts: the chart runs two, and the leader-election Lease names the
    holder (its pod name, "_", a random suffix)."""
    ns, release = ctx.args.system_namespace, ctx.args.release
    pods = ctx.pods(ns, f"app.kubernetes.io/instance={release}")
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") == "Running" and p["status"].get("podIP")]
    lease = ctx.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{release}-sftjob-operator")
    holder = lease["spec"].get("holderIdentity") or ""
    leaders = [p for p in live if holder.startswith(p["metadata"]["name"] + "_")]
    return leaders[0] if len(leaders) == 1 else None


def wait_for(pred, timeout: float, what: str, interval: float = 0.5):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # transient API errors
            last = e
        time.sleep(interval)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last})" if last else ""))


def _port(pod: dict, name: str) -> int | None:
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == name:
                return p["containerPort"]
    return None


class TargetWriter(threading.Thread):
    """Keeps Prometheus' file_sd targets equal to the live operator pod and rank-0 trainer
    pods (their IPs change on every gang restart). Labels as the chart's PodMonitor sets them."""

    def __init__(self, ctx: Ctx):
        super().__init__(daemon=True, name="prometheus-targets")
        self.ctx = ctx
        self.stopped = threading.Event()

    def run(self) -> None:
        a = self.ctx.args
        while not self.stopped.is_set():
            try:
                self.update(a)
            except Exception:  # keep going through API hiccups
                pass
            self.stopped.wait(1.0)

    def update(self, a) -> None:
        ops, trainers = [], []
        for p in self.ctx.pods(a.system_namespace, f"app.kubernetes.io/instance={a.release}"):
            ip, port = p["status"].get("podIP"), _port(p, "metrics")
            if ip and port and p["status"].get("phase") == "Running":
                ops.append((f"{ip}:{port}", {"namespace": a.system_namespace, "pod": p["metadata"]["name"]}))
        for p in self.ctx.pods(a.namespace, "app.kubernetes.io/managed-by=sftjob-operator,sftjob.io/rank=0"):
            ip, port = p["status"].get("podIP"), _port(p, "metrics")
            if ip and port and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp"):
                labels = p["metadata"]["labels"]
                trainers.append((f"{ip}:{port}", {"namespace": a.namespace, "pod": p["metadata"]["name"],
                                                  "sftjob": labels.get("sftjob.io/job-name", ""),
                                                  "attempt": labels.get("sftjob.io/attempt", "")}))
        wd = self.ctx.prom.workdir
        promlib.set_targets(wd, "operator", ops)
        promlib.set_targets(wd, "trainer", trainers)

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


# ------------------------------------------------------------------------------ assets

def stage_assets(ctx: Ctx) -> None:
    out, args = ctx.out, ctx.args
    out.stage(2, "Making the tiny model and data, uploading them to MinIO, creating the credentials Secret")
    ex = _load_example_assets()
    root = args.workdir / "assets"
    if not (root / "model" / "config.json").is_file() or not (root / "data" / "val.parquet").is_file():
        out.cmd(f"python -m sftjob_trainer.assets {root.relative_to(REPO) if root.is_relative_to(REPO) else root}")
        subprocess.run([sys.executable, "-m", "sftjob_trainer.assets", str(root)], check=True, capture_output=True)
    else:
        out.say(f"tiny model and data already in {root}")
    ex.make_local_assets(root)  # a no-op now; examples/assets.py is what `make example-assets` runs
    ctx.assets = root
    ex.upload(ctx.env, root)
    out.say(f"uploaded {root}/model -> s3://{ex.BUCKET}/models/tiny, {root}/data -> s3://{ex.BUCKET}/data "
            f"(MinIO {ctx.env['AWS_ENDPOINT_URL']})")
    ex.apply_secret(args.namespace, ctx.env)
    out.say(f"Secret {args.namespace}/{ex.SECRET} with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (values not shown)")


# ------------------------------------------------------------------------------ the job

# MFU needs the peak FLOP/s of one process's device; a nominal figure for one CPU core.
CPU_PEAK_TFLOPS = 0.1


def job_manifest(args, crd: dict | None = None, s3_endpoint: str | None = None) -> tuple[dict, list[str]]:
    """examples/sftjob.yaml, with the demo's overrides (printed, so nothing is hidden)."""
    import yaml

    obj = yaml.safe_load(EXAMPLE.read_text())
    notes = []
    obj["metadata"]["name"] = args.job
    spec = obj["spec"]
    if s3_endpoint and spec["storage"].get("endpoint") and spec["storage"]["endpoint"] != s3_endpoint:
        spec["storage"]["endpoint"] = s3_endpoint  # a local cluster on another bridge address
        notes.append(f"storage.endpoint={s3_endpoint} (this cluster's MinIO)")
    if crd is not None and "peakTflops" not in spec["training"] and _training_fields(crd) >= {"peakTflops"}:
        spec["training"]["peakTflops"] = CPU_PEAK_TFLOPS
        notes.append(f"training.peakTflops={CPU_PEAK_TFLOPS} (nominal for one CPU core, so that MFU is reported)")
    if args.steps:
        spec["training"]["totalTrainingSteps"] = args.steps
        interval = min(spec["checkpoint"]["interval"], max(1, args.steps // 2))
        spec["checkpoint"]["interval"] = interval
        spec["training"]["testFreq"] = max(1, args.steps // 2)
        notes.append(f"DEMO_STEPS={args.steps}: totalTrainingSteps={args.steps}, checkpoint.interval={interval}, "
                     f"testFreq={spec['training']['testFreq']}")
    return obj, notes


def _training_fields(crd: dict) -> set[str]:
    try:
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        return set(schema["properties"]["spec"]["properties"]["training"]["properties"])
    except (KeyError, IndexError):
        return set()


def _status(job: dict | None) -> dict:
    return (job or {}).get("status", {}) or {}


def _delete_previous(ctx: Ctx) -> None:
    if ctx.get_job() is None:
        return
    a = ctx.args
    ctx.kubectl("-n", a.namespace, "delete", "sft", a.job, "--wait=true", "--timeout=180s",
                show=f"kubectl -n {a.namespace} delete sft {a.job}   # the previous demo's job", timeout=200)
    wait_for(lambda: not ctx.pods(a.namespace, f"sftjob.io/job-name={a.job}"), 180,
             "the previous job's pods to be gone")


def stage_job(ctx: Ctx) -> dict:
    out, a = ctx.out, ctx.args
    out.stage(3, f"Applying examples/sftjob.yaml ({a.job}: 2 nodes, LoRA, data and output in S3)")
    _delete_previous(ctx)
    crd = ctx.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    obj, notes = job_manifest(a, crd, ctx.cfg.s3_endpoint)
    for n in notes:
        out.say(n)
    ctx.t_apply = time.time()
    ctx.kubectl("-n", a.namespace, "apply", "-f", "-", input=json.dumps(obj),
                show=f"kubectl -n {a.namespace} apply -f examples/sftjob.yaml")
    out.cmd(f"kubectl -n {a.namespace} get sft {a.job}   # a new line whenever phase, step or restarts change")
    out.say(_row(ctx.kubectl("-n", a.namespace, "get", "sft", a.job).stdout, header=True))

    last_key = None
    last_change = time.time()
    warned = False
    preempted = None      # dict with the eviction facts once done
    resume = None
    deadline = time.time() + a.timeout
    while True:
        job = ctx.get_job()
        st = _status(job)
        prog = st.get("progress", {}) or {}
        key = (st.get("phase"), prog.get("step"), (st.get("restarts") or {}).get("total") or 0)
        if key != last_key:
            line = _row(ctx.kubectl("-n", a.namespace, "get", "sft", a.job, check=False).stdout)
            phase_changed = last_key is None or key[0] != last_key[0] or key[2] != last_key[2]
            out.progress(line, newline=phase_changed or not TTY)
            last_key = key
            last_change = time.time()
        elif not warned and time.time() - last_change > 180:
            warned = True
            out.say(f"no progress for 3 minutes; `kubectl -n {a.namespace} describe sft {a.job}` and "
                    f"`kubectl -n {a.namespace} logs {a.job}-node-0` say why (is another sftjob-operator, e.g. one started with "
                    f"--all-namespaces by a test, acting on this job too?)")
        if preempted is None and st.get("phase") == "Running" and \
                (prog.get("lastCheckpointStep") or 0) >= ctx.preempt_after:
            preempted = preempt(ctx, job)
            last_key = None
        if preempted is not None and resume is None:
            resume = _resumed_line(ctx, preempted)
            if resume:
                out.say(f"{a.job}-node-0 log (attempt {_status(ctx.get_job()).get('attempt')}): {resume}")
                m = re.search(r"step-(\d+)", resume)
                if m:
                    preempted["resume_step"] = int(m.group(1))
                    why = ("the checkpoint the trainer wrote on SIGTERM"
                           if int(m.group(1)) > (preempted["checkpoint_step"] or 0) else "the last periodic checkpoint")
                    out.say(f"resumed at step {m.group(1)}: {why}; no step is lost or repeated")
        if st.get("phase") in ("Succeeded", "Failed"):
            break
        if time.time() > deadline:
            raise SystemExit(f"{a.job} did not finish within {a.timeout} s (phase {st.get('phase')})")
        time.sleep(1.0)
    out.end_line()
    ctx.t_end = time.time()
    ctx.summary.update(phase=st.get("phase"), restarts=st.get("restarts"), progress=prog,
                       output_uri=(st.get("output") or {}).get("uri"), preemption=preempted, resume_line=resume,
                       run_seconds=round(ctx.t_end - ctx.t_apply, 1))
    if st.get("phase") != "Succeeded":
        out.say(f"{a.job} {st.get('phase')}: {st.get('message')}")
        _show_events(ctx)
        raise SystemExit(f"the SFTJob ended {st.get('phase')}; see `kubectl -n {a.namespace} describe sft {a.job}`")
    r = st.get("restarts") or {}
    out.say(f"Succeeded in {ctx.t_end - ctx.t_apply:.0f} s: step {prog.get('step')}/{prog.get('totalSteps')}, "
            f"restarts: {r.get('preemptions', 0)} preemption(s), {r.get('failures', 0)} failure(s)")
    if resume is None and preempted:
        resume = _resumed_line(ctx, preempted)
        ctx.summary["resume_line"] = resume
    return job


WIDTHS = (12, 11, 8, 8, 9, 6)


def _row(table: str, header: bool = False) -> str:
    """One row (or the header) of `kubectl get sft` with fixed column widths, so that rows
    printed by separate kubectl calls line up."""
    lines = table.splitlines()
    if len(lines) < 2:
        return table.strip()
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    line = lines[0] if header else lines[1]
    cells = [line[s:e].strip() for s, e in zip(starts, starts[1:] + [None])]
    return "".join(c.ljust(w) for c, w in zip(cells, WIDTHS + (0,) * len(cells))).rstrip()


def preempt(ctx: Ctx, job: dict) -> dict:
    out, a = ctx.out, ctx.args
    st = _status(job)
    victim = f"{a.job}-node-1"
    ckpt = st["progress"].get("lastCheckpointStep")
    ctx.summary.setdefault("pods", {})["trainer"] = _runs_as(ctx, a.namespace, f"{a.job}-node-0")
    out.stage(4, f"Preempting {victim} mid-run (eviction through the API, as a cluster would)")
    rank0 = f"{a.job}-node-0"
    uid0 = ctx.kube.get(f"/api/v1/namespaces/{a.namespace}/pods/{rank0}")["metadata"]["uid"]
    attempt = st.get("attempt", 0)
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim, "namespace": a.namespace}}
    ctx.kubectl("create", "--raw", f"/api/v1/namespaces/{a.namespace}/pods/{victim}/eviction", "-f", "-",
                input=json.dumps(body),
                show=f"kubectl create --raw /api/v1/namespaces/{a.namespace}/pods/{victim}/eviction -f eviction.json")
    out.say(f"evicted at step {st['progress'].get('step')} (last committed checkpoint: step {ckpt})")
    # The operator restarts the whole gang: wait for its verdict and show it.
    j = wait_for(lambda: (x := ctx.get_job()) and (_status(x).get("restarts") or {}).get("preemptions", 0) >= 1 and x,
                 180, "the operator to count the preemption")
    cond = next((c for c in _status(j).get("conditions", []) if c["type"] == "Restarting"), None)
    if cond:
        out.say(f"condition Restarting={cond['status']} reason={cond['reason']}: {cond.get('message', '')}")
    _show_events(ctx, last=4)
    return {"pod": victim, "at_step": st["progress"].get("step"), "checkpoint_step": ckpt,
            "attempt_before": attempt, "rank0": rank0, "rank0_uid": uid0, "time": time.time()}


def _resumed_line(ctx: Ctx, pre: dict) -> str | None:
    """The "resumed from" line of the re-created rank-0 pod's log (kubectl logs)."""
    ns = ctx.args.namespace
    try:
        uid = ctx.kube.get(f"/api/v1/namespaces/{ns}/pods/{pre['rank0']}")["metadata"]["uid"]
    except ApiError:
        return None
    if uid == pre["rank0_uid"]:
        return None
    for line in localcluster.pod_log(ns, pre["rank0"], "trainer", cfg=ctx.cfg).splitlines():
        if "resumed from" in line:
            return line[line.index("resumed from"):].strip()
    return None


def _show_events(ctx: Ctx, last: int = 6) -> None:
    a = ctx.args
    uid = ((ctx.get_job() or {}).get("metadata") or {}).get("uid", "")
    res = ctx.kubectl("-n", a.namespace, "get", "events", "--field-selector",
                      f"involvedObject.kind=SFTJob,involvedObject.name={a.job},involvedObject.uid={uid}",
                      "--sort-by=.lastTimestamp",
                      "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", check=False)
    lines = res.stdout.splitlines()
    if len(lines) > 1:
        ctx.out.cmd(f"kubectl -n {a.namespace} get events --field-selector involvedObject.name={a.job}")
        for line in [lines[0]] + lines[1:][-last:]:
            ctx.out.say(line[:160])


# ------------------------------------------------------------------------------ the model

def stage_model(ctx: Ctx, job: dict) -> None:
    out, a = ctx.out, ctx.args
    uri = _status(job)["output"]["uri"]
    out.stage(5, "Downloading the fine-tuned model from S3, loading it with transformers, generating")
    import boto3

    bucket, key = uri[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=ctx.env["AWS_ENDPOINT_URL"], aws_access_key_id=ctx.env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=ctx.env["AWS_SECRET_ACCESS_KEY"], region_name=ctx.env["AWS_REGION"])
    dest = a.workdir / "model"
    if dest.exists():
        shutil.rmtree(dest)
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
        for o in page.get("Contents", []):
            rel = o["Key"][len(key.rstrip("/")) + 1:]
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, o["Key"], str(dest / rel))
            n += 1
    out.say(f"status.output.uri = {uri}")
    out.say(f"downloaded {n} files to {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}: "
            + ", ".join(sorted(p.name for p in dest.iterdir())))

    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    rows = pq.read_table(ctx.assets / "data" / "val.parquet").to_pylist()

    def load(path: Path):
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        return tok, model.eval()

    def generate(tok, model, prompt: str) -> str:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=16, do_sample=False)
        return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()

    def response_loss(tok, model) -> float:
        """Mean loss on the validation responses (the tokens the job trained on)."""
        total = count = 0.0
        for row in rows:
            user = [{"role": "user", "content": row["prompt"]}]
            prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(user + [{"role": "assistant", "content": row["response"]}], tokenize=False)
            ids = tok(full, add_special_tokens=False, return_tensors="pt")["input_ids"]
            n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
            labels = ids.clone()
            labels[:, :n_prompt] = -100
            with torch.no_grad():
                loss = model(input_ids=ids, labels=labels).loss.item()
            n = int((labels[:, 1:] != -100).sum())
            total, count = total + loss * n, count + n
        return total / max(count, 1)

    tuned_tok, tuned = load(dest)
    base_tok, base = load(ctx.assets / "model")
    loss_base, loss_tuned = response_loss(base_tok, base), response_loss(tuned_tok, tuned)
    out.say(f"loaded with AutoModelForCausalLM.from_pretrained; loss on the {len(rows)} validation responses: "
            f"base {loss_base:.3f} -> fine-tuned {loss_tuned:.3f}")
    samples = []
    for row in rows[:3]:
        b, t = generate(base_tok, base, row["prompt"]), generate(tuned_tok, tuned, row["prompt"])
        samples.append({"prompt": row["prompt"], "expected": row["response"], "base": b, "fine_tuned": t})
        out.say(f"prompt:      {row['prompt']}")
        out.say(f"  expected:    {row['response']}")
        out.say(f"  base model:  {b or '(nothing)'}")
        out.say(f"  fine-tuned:  {t or '(nothing)'}")
    ctx.summary.update(model_loads=True, model_dir=str(dest), val_response_loss={"base": loss_base,
                                                                                 "fine_tuned": loss_tuned},
                       generation=samples[0], generations=samples)


# ------------------------------------------------------------------------------ metrics

def _by_attempt(series: list[dict]) -> dict[tuple[str | None, float], float]:
    """{(attempt label, timestamp): value}: each gang attempt's rank-0 pod is its own series."""
    return {(s["metric"].get("attempt"), float(t)): float(v) for s in series for t, v in s["values"]}


def _values(series: list[dict]) -> list[tuple[float, float]]:
    return [(float(t), float(v)) for s in series for t, v in s["values"]]


def stage_metrics(ctx: Ctx) -> None:
    out, a = ctx.out, ctx.args
    out.stage(6, f"Metrics from Prometheus ({ctx.prom.url}) and the loss curve")
    prom = ctx.prom
    start, end = ctx.t_apply, max(ctx.t_end, time.time())
    sel = f'sftjob="{a.job}",namespace="{a.namespace}"'
    loss = prom.query_range(f"sftjob_trainer_loss{{{sel}}}", start, end, step=1)
    steps = prom.query_range(f"sftjob_trainer_step{{{sel}}}", start, end, step=1)
    val = prom.query_range(f"sftjob_trainer_val_loss{{{sel}}}", start, end, step=1)
    tps = prom.query_range(f"sftjob_trainer_tokens_per_second{{{sel}}}", start, end, step=1)
    restart_q = f'sum by (cause) (sftjob_operator_gang_restarts_total{{namespace="{a.system_namespace}"}})'
    before = {r["metric"].get("cause", ""): float(r["value"][1]) for r in prom.query(restart_q, at=start)}
    after_series = prom.query(restart_q, at=end)
    after = {r["metric"].get("cause", ""): float(r["value"][1]) for r in after_series}
    by_cause = {c: int(after[c] - before.get(c, 0)) for c in after}
    phases = prom.query('sftjob_operator_jobs > 0', at=end)

    sv = _by_attempt(steps)
    # A fresh trainer serves NaN until its first step: only samples after a step count.
    lv = sorted((t, v, sv.get((s["metric"].get("attempt"), float(t)), 0)) for s in loss for t, v in s["values"])
    lv = [(t, float(v), st) for t, v, st in lv if st > 0 and float(v) > 0]
    tv = [v for _, v in _values(tps) if math.isfinite(v)]  # NaN until a rank's first step
    out.cmd(f"curl -s '{prom.url}/api/v1/query_range?query=sftjob_trainer_loss{{{sel}}}&...'")
    if lv:
        out.say(f"loss:      {lv[0][1]:.3f} at the start (step {int(lv[0][2])}) -> "
                f"{lv[-1][1]:.3f} at the end (step {int(lv[-1][2])})   [{len(loss)} series, "
                f"{len(lv)} samples]")
    else:
        out.say("loss:      no samples (the trainer was never scraped)")
    vv = sorted((t, v) for t, v in _values(val) if v > 0)
    if vv:
        # The gauge keeps its value until the next validation: its step is where it first appeared.
        first_seen = {}
        for s in val:
            for t, v in s["values"]:
                st = sv.get((s["metric"].get("attempt"), float(t)), 0)
                if st > 0 and float(v) > 0:
                    first_seen.setdefault(float(v), (float(t), st))
        last = max(first_seen.items(), key=lambda kv: kv[1][0], default=None)
        at = f" (scraped at step {int(last[1][1])})" if last else ""
        out.say(f"val loss:  {last[0] if last else vv[-1][1]:.3f} at the last validation Prometheus saw{at}")
    if tv:
        out.say(f"tokens/s:  {sum(tv) / len(tv):.0f} on average while running (max {max(tv):.0f}), all ranks")
    out.say("restarts by cause (sftjob_operator_gang_restarts_total): "
            + (", ".join(f"{c}={n}" for c, n in sorted(by_cause.items())) or "none"))
    if phases:
        out.say("jobs by phase (sftjob_operator_jobs): "
                + ", ".join(f"{r['metric'].get('phase')}={float(r['value'][1]):.0f}" for r in phases))

    png = a.workdir / "loss.png"
    _plot(png, loss, sv, val, ctx.summary.get("preemption"), a.job)
    out.say(f"loss curve: {png.relative_to(REPO) if png.is_relative_to(REPO) else png}")

    checks = promlib.check_dashboard(prom, DASHBOARD, start, end)
    ok = sum(1 for *_, n in checks if n > 0)
    out.say(f"Grafana dashboard {DASHBOARD.relative_to(REPO)}: {ok}/{len(checks)} queries return data"
            + ("" if ok == len(checks) else "; empty: " + ", ".join(t for t, _, n in checks if n <= 0)))
    ctx.summary["prometheus"] = {
        "url": prom.url, "start": start, "end": end,
        "loss_series": len(loss), "loss_samples": len(lv),
        "loss_first": lv[0][1] if lv else None, "loss_last": lv[-1][1] if lv else None,
        "tokens_per_second_mean": (sum(tv) / len(tv)) if tv else None,
        "restart_series": len(after_series), "restarts_by_cause": by_cause,
        "dashboard": [{"panel": t, "expr": q, "series": n} for t, q, n in checks],
    }


def _plot(png: Path, loss: list[dict], steps: dict, val: list[dict], pre: dict | None, job: str) -> None:
    """Loss against the optimizer step, one line per gang attempt (each rank-0 pod is a series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for series in sorted(loss, key=lambda s: s["metric"].get("attempt", "")):
        att = series["metric"].get("attempt")
        pts = [(steps.get((att, float(t)), 0), float(v)) for t, v in series["values"]]
        pts = sorted({s: v for s, v in pts if s > 0 and v > 0}.items())
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-",
                    label=f"train loss, attempt {series['metric'].get('attempt', '?')}")
    vpts = sorted({steps.get((s["metric"].get("attempt"), float(t)), 0): float(v)
                   for s in val for t, v in s["values"] if float(v) > 0}.items())
    if vpts:
        ax.plot([p[0] for p in vpts], [p[1] for p in vpts], "s", label="validation loss")
    if pre:
        at = pre.get("resume_step") or pre.get("checkpoint_step")
        if at is not None:
            ax.axvline(at, color="red", ls="--", label=f"evicted; resumed from step {at}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"SFTJob {job}: loss scraped by Prometheus every {promlib.SCRAPE_INTERVAL}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ main

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    env = os.environ.get
    p.add_argument("--steps", type=int, default=int(env("DEMO_STEPS") or 0),
                   help="totalTrainingSteps override (env DEMO_STEPS; default: the example's 40)")
    p.add_argument("--namespace", default=env("DEMO_NAMESPACE", "sftjob-demo"), help="where the SFTJob runs")
    p.add_argument("--system-namespace", default=env("DEMO_SYSTEM_NAMESPACE", "sftjob-system"),
                   help="the Helm release's namespace (the operator)")
    p.add_argument("--release", default=env("DEMO_RELEASE", "sftjob"))
    p.add_argument("--job", default="tiny-lora")
    p.add_argument("--workdir", type=Path, default=Path(env("DEMO_DIR", str(REPO / ".demo"))))
    p.add_argument("--prometheus-port", type=int, default=int(env("DEMO_PROMETHEUS_PORT") or promlib.DEFAULT_PORT))
    p.add_argument("--keep-prometheus", action="store_true", default=bool(env("DEMO_KEEP_PROMETHEUS")),
                   help="leave Prometheus running after the demo (pid in WORKDIR/prometheus/prometheus.pid)")
    p.add_argument("--timeout", type=float, default=float(env("DEMO_TIMEOUT") or 1800),
                   help="seconds the SFTJob may take")
    p.add_argument("--summary", type=Path, default=None, help="JSON summary (default WORKDIR/summary.json)")
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.summary = args.summary or args.workdir / "summary.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Out()
    ctx = Ctx(args, out)
    ctx.prom = None
    ctx.scraper = None
    # Evict after the first committed checkpoint: resuming then skips nothing and repeats nothing.
    obj, _ = job_manifest(args)
    ctx.preempt_after = obj["spec"]["checkpoint"]["interval"]
    rc = 1
    try:
        stage_cluster(ctx)
        stage_assets(ctx)
        job = stage_job(ctx)
        stage_model(ctx, job)
        # Let Prometheus take its last scrapes of the operator before summarising.
        stage_metrics(ctx)
        out.stage(7, "Done: the cluster keeps running")
        out.say(f"kubectl:    source .cluster/env && kubectl -n {args.namespace} get sft,pods")
        out.say(f"model:      {ctx.summary.get('model_dir')}   loss curve: {args.workdir / 'loss.png'}")
        if args.keep_prometheus:
            out.say(f"Prometheus: {ctx.prom.url} (pid {ctx.prom.pid()})")
        else:
            out.say(f"Prometheus stopped; its data stays in {ctx.prom.workdir}/data")
        out.say("stop everything with: make cluster-down")
        rc = 0
    except SystemExit as e:
        out.end_line()
        print(f"\ndemo failed: {e}", file=sys.stderr)
        ctx.summary["error"] = str(e)
    finally:
        if ctx.scraper:
            ctx.scraper.stop()
        if ctx.prom and not args.keep_prometheus:
            ctx.prom.stop()
        out.done()
        ctx.summary["timings"] = out.timings
        ctx.summary["ok"] = rc == 0
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(ctx.summary, indent=1, default=str) + "\n")
        print(f"\n(total {out.timings['total']:.0f} s; summary {args.summary})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
