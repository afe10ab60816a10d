"""The chaos run's plumbing: the cluster and its clients (Ctx), the operator installed by
helm, the assets, the job manifest (the example, shortened, with a frequent checkpoint) and
waiting for a job to finish."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hack import localcluster
from hack.localcluster.kube import ApiError, Kube, ensure_namespace, wait_crds_established, wait_for
from hack.localcluster.logtap import LogTap

from .faults import Injector
from .s3proxy import ThrottlingProxy

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sftjob.yaml"
CHART = REPO / "charts" / "sftjob-operator"
CRD = REPO / "crds" / "sftjob.io_sftjobs.yaml"
JOBS = "/apis/sftjob.io/v1alpha1/namespaces/{ns}/sftjobs"
METRICS_PORT = 9400


def say(msg: str = "") -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}" if msg else "", flush=True)


class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg = localcluster.up()
        self.kube = Kube.from_state(self.cfg)
        self.env = {**os.environ, **localcluster.env(self.cfg)}
        self.kubectl_bin = str(localcluster.bin_dir("k8s") / "kubectl")
        self.helm_bin = str(localcluster.bin_dir("helm") / "helm")
        self.tap: LogTap | None = None
        self.proxy: ThrottlingProxy | None = None   # the S3 proxy, when throttling faults may run
        import boto3

        e = self.env
        self.s3 = boto3.client("s3", endpoint_url=e["AWS_ENDPOINT_URL"], aws_access_key_id=e["AWS_ACCESS_KEY_ID"],
                               aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"], region_name=e["AWS_REGION"])

    def run(self, argv: list[str], input: str | None = None, check: bool = True, timeout: float = 600):
        res = subprocess.run(argv, input=input, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and res.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl(self, *a: str, **kw):
        return self.run([self.kubectl_bin, *a], **kw)

    def helm(self, *a: str, **kw):
        return self.run([self.helm_bin, *a], **kw)

    def get_job(self, name: str) -> dict | None:
        try:
            return self.kube.get(f"{JOBS.format(ns=self.args.namespace)}/{name}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise




def values_keys() -> set[str]:
    return set((yaml.safe_load((CHART / "values.yaml").read_text()) or {}).keys())


def install_operator(ctx: Ctx) -> None:
    a = ctx.args
    for ns in (a.system_namespace, a.namespace):
        ensure_namespace(ctx.kube, ns)
    ctx.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    wait_crds_established(ctx.kube, "sftjobs.sftjob.io")
    existed = ctx.helm("status", a.release, "-n", a.system_namespace, check=False).returncode == 0
    sets = [f"watchNamespaces={{{a.namespace}}}", "crds.enabled=false", "operator.logFormat=plain"]
    if a.operator_replicas:
        if "replicaCount" not in values_keys():
            raise SystemExit("--operator-replicas: this chart has no replicaCount value")
        sets.append(f"replicaCount={a.operator_replicas}")
        if a.operator_replicas > 1 and "leaderElection" in values_keys():
            sets.append("leaderElection.enabled=true")
    argv = ["upgrade", "--install", a.release, str(CHART), "-n", a.system_namespace, "--wait", "--timeout", "300s"]
    for s in sets:
        argv += ["--set", s]
    say("$ helm " + " ".join(x if not x.startswith("/") else os.path.relpath(x, REPO) for x in argv))
    ctx.helm(*argv, timeout=400)
    dep = ctx.kube.get(f"/apis/apps/v1/namespaces/{a.system_namespace}/deployments",
                       labelSelector=f"app.kubernetes.io/instance={a.release}")["items"][0]
    if existed:
        # The operator image was rebuilt from this checkout under the same tag: restart its pods on it.
        ctx.kubectl("-n", a.system_namespace, "rollout", "restart", f"deployment/{dep['metadata']['name']}")
        ctx.kubectl("-n", a.system_namespace, "rollout", "status", f"deployment/{dep['metadata']['name']}",
                    "--timeout=300s", timeout=320)
    inj = Injector(ctx.cfg, ctx.kube, a.namespace, "", a.system_namespace, a.release, random.Random(0))
    replicas = dep["spec"].get("replicas", 1)
    pods = wait_for(lambda: (p := inj.operators_running()) and len(p) >= replicas and p, 180,
                    "the operator pods to run")
    say(f"operator: release {a.release} in {a.system_namespace}, {len(pods)} pod(s) "
        f"{', '.join(p['metadata']['name'] for p in pods)}, watching {a.namespace}")


def make_assets(ctx: Ctx) -> None:
    res = ctx.run([sys.executable, str(REPO / "examples" / "assets.py"), "--namespace", ctx.args.namespace],
                  timeout=900)
    say(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "assets ready")


def manifest(args: argparse.Namespace, name: str) -> dict[str, Any]:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"] = {"name": name, "labels": {"sftjob.io/chaos-seed": str(args.seed)}}
    spec = obj["spec"]
    spec["data"]["valFiles"] = []
    spec["training"]["testFreq"] = 0
    spec["training"]["totalTrainingSteps"] = args.steps
    spec["checkpoint"] = {"interval": args.interval, "keep": args.keep}
    spec["runPolicy"].update(restartBackoffSeconds=0, preemptionLimit=1000, backoffLimit=5,
                             ttlSecondsAfterFinished=3600)
    if getattr(args, "s3_endpoint", None):   # the throttling proxy (s3proxy.py)
        spec["storage"]["endpoint"] = args.s3_endpoint
    if "operator-down-long" in args.kinds:   # the watchdog an operator outage must not trip
        spec["runPolicy"]["progressDeadlineSeconds"] = args.progress_deadline
    obj["metadata"]["labels"]["sftjob.io/chaos-spec"] = spec_hash(obj)
    return obj


def spec_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj["spec"], sort_keys=True).encode()).hexdigest()[:16]


def delete_jobs(ctx: Ctx, keep: str | None = None) -> None:
    """Remove earlier chaos jobs (this namespace is ours) and wait for their pods to go."""
    ns = ctx.args.namespace
    for j in ctx.kube.get(JOBS.format(ns=ns))["items"]:
        if j["metadata"]["name"] == keep:
            continue
        try:
            ctx.kube.delete(f"{JOBS.format(ns=ns)}/{j['metadata']['name']}")
        except ApiError as e:
            if e.status != 404:
                raise
    wait_for(lambda: all(j["metadata"]["name"] == keep for j in ctx.kube.get(JOBS.format(ns=ns))["items"]), 120,
             "old chaos jobs to go")
    wait_for(lambda: all(p["metadata"]["labels"].get("sftjob.io/job-name") == keep
                         for p in ctx.kube.get(f"/api/v1/namespaces/{ns}/pods",
                                               labelSelector="app.kubernetes.io/managed-by=sftjob-operator")["items"]),
             180, "old chaos pods to go")


def wait_finished(ctx: Ctx, name: str, timeout: float) -> dict:
    return wait_for(lambda: (j := ctx.get_job(name)) and (j.get("status") or {}).get("phase") in
                    ("Succeeded", "Failed") and j, timeout, f"{name} to finish", interval=1)


def restarts(st: dict) -> dict[str, int]:
    r = st.get("restarts") or {}
    return {"preemptions": r.get("preemptions", 0), "failures": r.get("failures", 0)}
