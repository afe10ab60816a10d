"""Stage 1: install what is missing, start the local cluster, install the chart with Helm
(the operator namespace-scoped to the demo namespace), start Prometheus scraping it."""
from __future__ import annotations

import os
import sys
import time

from hack import localcluster
from hack.localcluster.kube import ApiError, Kube

from demo import prom as promlib
from demo.context import REPO, Ctx, wait_for
from demo.targets import TargetWriter

CHART = REPO / "charts" / "sftjob-operator"
CRD_NAME = "sftjobs.sftjob.io"
BINARIES = ("k8s", "etcd", "helm", "minio", "kwok")


def stage_cluster(ctx: Ctx) -> None:
    out, args = ctx.out, ctx.args
    out.stage(1, "Installing what is missing, starting the local cluster, installing the chart with Helm")
    out.say(f"venv: {sys.prefix} (python {sys.version.split()[0]})")
    cache = localcluster.bin_dir("k8s").parent.parent
    missing = [c for c in BINARIES if not (localcluster.bin_dir(c).parent / ".built").exists()]
    cold = " (cold on 2 cores: about 23 min, beside the images; docs/development.md#cold-start)"
    out.say("Go-built binaries: " + (f"building {' '.join(missing)} into {cache}{cold}" if missing else
                                     f"cached in {cache}"))
    t = time.time()
    ctx.cfg = localcluster.up(say=out.say)  # a cold build is half an hour: a line every 30 s meanwhile
    out.say(f"local cluster up ({time.time() - t:.0f} s): API server {ctx.cfg.apiserver_url}, "
            f"MinIO {ctx.cfg.s3_endpoint}, nodes {', '.join(ctx.cfg.nodes)}")
    ctx.env = localcluster.env(ctx.cfg)
    # The S3 clients in this process (examples.assets, sftjob_trainer.storage) read the
    # standard AWS_* variables, as the trainer's pods do.
    os.environ.update({k: v for k, v in ctx.env.items() if k.startswith("AWS_")})
    ctx.kube = Kube.from_state(ctx.cfg)
    ctx.kubectl_bin = str(localcluster.bin_dir("k8s") / "kubectl")
    ctx.helm_bin = str(localcluster.bin_dir("helm") / "helm")
    prom_exe = promlib.ensure_installed(out.say)
    out.say(f"prometheus: {prom_exe}")

    # The operator's namespace and the namespace it watches, both enforcing the `restricted`
    # Pod Security Standard (the chart's operator pod and the training pods meet it).
    for ns in (args.system_namespace, args.namespace):
        ctx.ensure_namespace(ns)
    _adopt_crd(ctx)
    _install_chart(ctx)
    _start_prometheus(ctx, prom_exe)


def _adopt_crd(ctx: Ctx) -> None:
    """A CRD applied earlier with kubectl (or by another release) is adopted, as the chart
    README says, so that the release manages it."""
    args = ctx.args
    try:
        crd = ctx.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    except ApiError as e:
        if e.status != 404:
            raise
        return
    ann = crd["metadata"].get("annotations", {})
    if (ann.get("meta.helm.sh/release-name"), ann.get("meta.helm.sh/release-namespace")) != \
            (args.release, args.system_namespace):
        ctx.out.say(f"adopting the existing CRD {CRD_NAME} into release {args.release}")
        ctx.kubectl("label", "--overwrite", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm")
        ctx.kubectl("annotate", "--overwrite", "crd", CRD_NAME, f"meta.helm.sh/release-name={args.release}",
                    f"meta.helm.sh/release-namespace={args.system_namespace}")


def _install_chart(ctx: Ctx) -> None:
    out, args = ctx.out, ctx.args
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
    op = wait_for(lambda: _leader_pod(ctx), 120, "the operator pod to run")
    ctx.summary["operator_pod"] = op["metadata"]["name"]
    ctx.summary.setdefault("pods", {})["operator"] = ctx.runs_as(args.system_namespace, op["metadata"]["name"])
    out.say(f"operator pod {args.system_namespace}/{op['metadata']['name']} (the leader of 2 replicas) running "
            f"as ServiceAccount {op['spec'].get('serviceAccountName')} (helm: {time.time() - t:.0f} s)")


def _leader_pod(ctx: Ctx) -> dict | None:
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


def _start_prometheus(ctx: Ctx, exe: str) -> None:
    """Prometheus, scraping the operator and (once it exists) the rank-0 trainer."""
    args = ctx.args
    ctx.prom = promlib.Prometheus(args.workdir / "prometheus", args.prometheus_port)
    ctx.prom.start(exe)
    ctx.scraper = TargetWriter(ctx)
    ctx.scraper.start()
    wait_for(lambda: ctx.prom.scraped_ok("sftjob-operator"), 60, "Prometheus to scrape the operator")
    ctx.out.say(f"Prometheus {ctx.prom.url} scraping the operator and the rank-0 trainer every "
                f"{promlib.SCRAPE_INTERVAL} (config {ctx.prom.workdir / 'prometheus.yml'})")
