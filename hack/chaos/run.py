"""`make chaos`: one real training job, run once untouched and once under seeded faults.

Flow:
  1. the local cluster (started if needed), the CRD, the chart installed by helm
     (`--set crds.enabled=false`: the CRD is applied from crds/ as the tests do), namespace-
     scoped to the chaos namespace; the tiny assets in MinIO (examples/assets.py);
  2. the reference job (same spec) to Succeeded, without faults;
  3. the faulty job: before each fault, wait for a new COMMITTED checkpoint in S3 (the job
     made progress), then for a seeded random trainer step in the next interval; inject; wait
     for the fault's effect (the restart counted, the operator back, MinIO back);
  4. checks: both Succeeded; final weights bitwise identical; no committed checkpoint lost
     (every restart resumed from the newest checkpoint committed before it, none vanished
     while among the newest `keep`); status.restarts equal to the faults injected, by cause,
     and per fault; at least --min-faults faults of --min-kinds kinds.

Exit status 0 only when every check passes. A JSON summary goes to WORKDIR/summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hack import localcluster  # noqa: E402
from hack.localcluster.kube import ApiError, Kube  # noqa: E402
from hack.localcluster.logtap import LogTap  # noqa: E402

from .faults import KINDS, OPT_IN, PREEMPTION, RESTARTING, Fault, Injector, minio_live, minio_start, wait_for  # noqa: E402
from .monitor import Monitor  # noqa: E402
from .weights import compare_dirs, download  # noqa: E402

EXAMPLE = REPO / "examples" / "sftjob.yaml"
CHART = REPO / "charts" / "sftjob-operator"
CRD = REPO / "crds" / "sftjob.io_sftjobs.yaml"
JOBS = "/apis/sftjob.io/v1alpha1/namespaces/{ns}/sftjobs"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
METRICS_PORT = 9400
_RESUMED = re.compile(r"resumed from \S*/checkpoints/step-(\d+)")
_SCRATCH = "no committed checkpoint under"


def say(msg: str = "") -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}" if msg else "", flush=True)


# ------------------------------------------------------------------------------ set-up

class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg = localcluster.up()
        self.kube = Kube.from_state(self.cfg)
        self.env = {**os.environ, **localcluster.env(self.cfg)}
        self.kubectl_bin = str(localcluster.bin_dir("k8s") / "kubectl")
        self.helm_bin = str(localcluster.bin_dir("helm") / "helm")
        self.tap: LogTap | None = None
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


def ensure_namespace(ctx: Ctx, name: str) -> None:
    try:
        ctx.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": name, "labels": RESTRICTED}})
    except ApiError as e:
        if e.status != 409:
            raise
    wait_for(lambda: ctx.kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 60,
             f"the default ServiceAccount in {name}")


def values_keys() -> set[str]:
    return set((yaml.safe_load((CHART / "values.yaml").read_text()) or {}).keys())


def install_operator(ctx: Ctx) -> None:
    a = ctx.args
    for ns in (a.system_namespace, a.namespace):
        ensure_namespace(ctx, ns)
    ctx.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    ctx.kubectl("wait", "--for=condition=Established", "crd/sftjobs.sftjob.io", "--timeout=60s")
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
    obj["metadata"]["labels"]["sftjob.io/chaos-spec"] = spec_hash(obj)
    return obj


def spec_hash(obj: dict) -> str:
    import hashlib

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


# ------------------------------------------------------------------------------ running a job

def rank0_step(ctx: Ctx, injector: Injector, attempt: int) -> int | None:
    """The trainer's own step, read from the rank-0 pod's metrics endpoint (the host reaches pod IPs)."""
    for p in injector.job_pods(attempt):
        if p["metadata"]["labels"].get("sftjob.io/rank") == "0" and p["status"].get("podIP"):
            try:
                with urllib.request.urlopen(f"http://{p['status']['podIP']}:{METRICS_PORT}/metrics", timeout=1) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith("sftjob_trainer_step "):
                            v = float(line.split()[1])
                            return int(v) if v == v else None
            except OSError:
                return None
    return None


def wait_finished(ctx: Ctx, name: str, timeout: float) -> dict:
    return wait_for(lambda: (j := ctx.get_job(name)) and (j.get("status") or {}).get("phase") in
                    ("Succeeded", "Failed") and j, timeout, f"{name} to finish", interval=1)


def plan_kinds(rng: random.Random, kinds: list[str], n: int) -> list[str]:
    """Every kind at least once (when n allows), the rest drawn at random; MinIO outages never
    last (they need a checkpoint after them) and never twice in a row."""
    first = rng.sample(kinds, len(kinds))[:n]
    rest = [rng.choice(kinds) for _ in range(n - len(first))]
    seq = first + rest
    rng.shuffle(seq)
    for i in range(len(seq)):
        if seq[i] == "minio-outage" and (i == len(seq) - 1 or (i and seq[i - 1] == "minio-outage")):
            j = next((k for k in range(len(seq) - 1) if seq[k] != "minio-outage" and
                      (k == 0 or seq[k - 1] != "minio-outage") and seq[k + 1] != "minio-outage"), None)
            if j is not None:
                seq[i], seq[j] = seq[j], seq[i]
    return seq


def restarts(st: dict) -> dict[str, int]:
    r = st.get("restarts") or {}
    return {"preemptions": r.get("preemptions", 0), "failures": r.get("failures", 0)}


def run_faulty(ctx: Ctx, name: str, mon: Monitor, rng: random.Random) -> list[Fault]:
    a = ctx.args
    inj = Injector(ctx.cfg, ctx.kube, a.namespace, name, a.system_namespace, a.release, rng,
                   minio_outage_s=a.minio_outage, log=say)
    kinds = plan_kinds(rng, a.kinds, a.faults)
    say(f"fault plan (seed {a.seed}): {', '.join(kinds)}")
    faults: list[Fault] = []
    last_ckpt = None
    try:
        for i, kind in enumerate(kinds):
            # 1. progress since the last fault: a checkpoint committed after it
            def progressed():
                st = mon.snapshot()
                if st.get("phase") in ("Succeeded", "Failed"):
                    return "finished"
                newest = mon.newest_committed()
                if st.get("phase") == "Running" and newest is not None and (last_ckpt is None or newest > last_ckpt):
                    return "ok"
                return None

            if wait_for(progressed, a.progress_timeout, f"a new committed checkpoint before fault {i + 1}",
                        interval=0.3) == "finished":
                say(f"the job finished before fault {i + 1}: {len(faults)} injected")
                break
            st = mon.snapshot()
            attempt, newest = st.get("attempt", 0), mon.newest_committed()
            # 2. a seeded random step within the next interval (MinIO: the step before the
            #    next checkpoint, so that its upload runs into the outage)
            if kind == "minio-outage":
                target = (newest // a.interval + 1) * a.interval - 1
                if target + a.interval >= a.steps:  # the final checkpoint must not meet the outage
                    kind = rng.choice([k for k in a.kinds if k != "minio-outage"] or ["operator-kill"])
                    say(f"fault {i + 1}: too close to the end for a MinIO outage; {kind} instead")
                    target = newest + rng.randint(0, a.interval - 1)
            else:
                target = newest + rng.randint(0, a.interval - 1)
            target = min(target, a.steps - 1)
            step = None
            deadline = time.time() + a.progress_timeout
            while time.time() < deadline:
                step = rank0_step(ctx, inj, attempt)
                if step is not None and step >= target:
                    break
                if mon.snapshot().get("phase") in ("Succeeded", "Failed") or mon.snapshot().get("attempt", 0) != attempt:
                    break
                time.sleep(0.2)
            if mon.snapshot().get("phase") in ("Succeeded", "Failed"):
                say(f"the job finished before fault {i + 1}: {len(faults)} injected")
                break
            if kind != "minio-outage":
                time.sleep(rng.uniform(0.0, 1.0))
            f = Fault(index=i + 1, kind=kind, at_step=step)
            f.extra["restarts_before"] = restarts(mon.snapshot())
            f.extra["newest_committed"] = mon.newest_committed()
            inj.inject(f, attempt)
            faults.append(f)
            say(f"fault {f.index}/{len(kinds)} {kind} at step {step} (newest committed step-{newest}): "
                f"{f.target}: {f.detail}")
            # 3. the fault's effect
            if kind in RESTARTING:
                before = sum(f.extra["restarts_before"].values())
                wait_for(lambda: sum(restarts(mon.snapshot()).values()) > before, a.effect_timeout,
                         f"the restart after {kind}")
                if kind == "node-lost":
                    time.sleep(1.0)
                    inj.restore_nodes()
            elif kind.startswith("operator-kill"):
                wait_for(lambda: inj.operators_recovered(f.extra["operators_before"], f.extra["victims"]), a.effect_timeout,
                         "the operator pods to come back")
                f.extra["operators_after"] = [p["metadata"]["name"] for p in inj.operators_running()]
            elif kind == "minio-outage":
                wait_for(lambda: minio_live(ctx.cfg), a.effect_timeout, "MinIO to come back")
            last_ckpt = max(newest, mon.newest_committed() or newest)
            f.extra["settled"] = time.time()
    finally:
        inj.restore_nodes()
        if not minio_live(ctx.cfg):
            say("MinIO is down after an error: starting it again")
            minio_start(ctx.cfg)
    return faults


def attribute(faults: list[Fault], mon: Monitor, end: dict) -> None:
    """Each fault's observed effect: the restart counters from its injection to the next one's."""
    for k, f in enumerate(faults):
        after = faults[k + 1].extra["restarts_before"] if k + 1 < len(faults) else restarts(end)
        before = f.extra["restarts_before"]
        d = {c: after[c] - before[c] for c in before}
        exp = {"preemptions": 1 if f.expected_cause == PREEMPTION else 0, "failures": 0}
        f.ok = d == exp
        parts = [f"preemptions +{d['preemptions']}", f"failures +{d['failures']}"]
        if f.kind.startswith("operator-kill"):
            parts.append(f"operator back ({len(f.extra.get('operators_after', []))} pods, new ones)")
        f.observed = ", ".join(parts)
        # why the operator restarted the gang (the Restarting condition's message at the time)
        reasons = []
        for t, st in mon.samples:
            if f.t <= t < (faults[k + 1].t if k + 1 < len(faults) else float("inf")):
                for c in st.get("conditions") or []:
                    if c.get("type") == "Restarting" and c.get("status") == "True":
                        r = (c.get("reason") or "") + ": " + (c.get("message") or "")[:90]
                        if r not in reasons:
                            reasons.append(r)
        f.extra["restart_reasons"] = reasons


def rank0_log(ctx: Ctx, name: str) -> Path:
    """The rank-0 pod's log as the run's LogTap keeps it: re-created pods of the same name
    append to it."""
    return ctx.tap.path(f"{name}-node-0", "trainer")


def check_resumes(ctx: Ctx, name: str, mon: Monitor, offset: int) -> tuple[list[str], list[str]]:
    """Every gang attempt after the first resumed from the newest checkpoint committed before
    it (or a newer one): (report lines, problems)."""
    lines, problems = [], []
    path = rank0_log(ctx, name)
    pod_dir = path.parent
    text = ""
    if path.exists():
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    resumes = []
    for line in text.splitlines():
        m = _RESUMED.search(line)
        if m:
            resumes.append(int(m.group(1)))
        elif _SCRATCH in line:
            resumes.append(0)
    lines.append(f"rank-0 starts: {len(resumes)} (resumed at steps {resumes}); gang attempts seen "
                 f"{[x.attempt for x in mon.attempts]}")
    if not resumes:
        problems.append(f"no start line in {pod_dir}")
        return lines, problems
    if resumes[0] != 0:
        problems.append(f"the first attempt did not start from scratch ({resumes[0]})")
    # The n-th start belongs to an attempt at or after the n-th attempt seen; the newest
    # committed checkpoint before that attempt is a lower bound for where it resumed.
    committed = set(mon.committed)
    floor = None
    prev = 0
    for n, step in enumerate(resumes[1:], start=1):
        if n < len(mon.attempts):
            floor = mon.attempts[n].newest_committed
        if step and step not in committed:
            problems.append(f"start {n} resumed from step-{step}, never seen COMMITTED in S3")
        if floor is not None and step < floor:
            problems.append(f"start {n} resumed from step-{step} although step-{floor} was committed before "
                            f"the restart: a committed checkpoint was lost")
        if step < prev:
            problems.append(f"start {n} resumed from step-{step}, older than the previous start's step-{prev}")
        prev = step
    problems += mon.lost_checkpoints
    lines.append(f"COMMITTED checkpoints seen in S3: {sorted(mon.committed)}; pruned by keep={mon.keep}: "
                 f"{sorted(mon.gone)}; vanished early: {len(mon.lost_checkpoints)}")
    return lines, problems


# ------------------------------------------------------------------------------ main

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hack.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", "1")))
    p.add_argument("--faults", type=int, default=12, help="faults to inject (default 12)")
    p.add_argument("--kinds", default=",".join(k for k in KINDS if k not in OPT_IN),
                   help=f"comma-separated, from {', '.join(KINDS)} (default: all but {', '.join(sorted(OPT_IN))})")
    p.add_argument("--min-faults", type=int, default=None, help="fail below this many faults (default --faults)")
    p.add_argument("--min-kinds", type=int, default=4, help="fail below this many kinds injected (default 4)")
    p.add_argument("--interval", type=int, default=2, help="checkpoint.interval of the job (steps)")
    p.add_argument("--keep", type=int, default=2, help="checkpoint.keep of the job")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: interval x (2 x faults + 4))")
    p.add_argument("--minio-outage", type=float, default=6.0, help="seconds MinIO stays stopped")
    p.add_argument("--namespace", default="sftjob-chaos")
    p.add_argument("--system-namespace", default="sftjob-chaos-system")
    p.add_argument("--release", default="sftjob-chaos")
    p.add_argument("--operator-replicas", type=int, default=0, help="set the chart's replicaCount (default: the chart's)")
    p.add_argument("--progress-timeout", type=float, default=600)
    p.add_argument("--effect-timeout", type=float, default=240)
    p.add_argument("--job-timeout", type=float, default=1800)
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "chaos")
    p.add_argument("--skip-install", action="store_true", help="the release is installed already")
    p.add_argument("--reuse-reference", action="store_true",
                   help="keep a Succeeded reference job of the same spec from an earlier run instead of rerunning it")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        p.error(f"unknown fault kinds {bad}; known: {', '.join(KINDS)}")
    args.min_faults = args.faults if args.min_faults is None else args.min_faults
    # Faults that do not stop training (operator kills, MinIO) let it run on while their
    # effect is awaited: about 3 steps per fault on this machine, so twice the faults in intervals.
    args.steps = args.steps or args.interval * (2 * args.faults + 4)
    args.workdir = args.workdir.resolve()
    return args


def short(target: str) -> str:
    """Operator pod names without the release prefix (the table stays readable)."""
    return ",".join(t.rsplit("-", 2)[-2] + "-" + t.rsplit("-", 1)[-1] if t.count("-") > 3 and "operator" in t else t
                    for t in target.split(","))


def table(rows: list[list[str]], header: list[str]) -> list[str]:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * x for x in w])] + [fmt(r) for r in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rng = random.Random(args.seed)
    summary: dict[str, Any] = {"seed": args.seed, "args": {k: str(v) for k, v in vars(args).items()}}
    ctx = Ctx(args)
    if not args.skip_install:
        install_operator(ctx)
    make_assets(ctx)
    ref_name, run_name = f"chaos-ref-{args.seed}", f"chaos-run-{args.seed}"
    ref_obj = manifest(args, ref_name)
    old = ctx.get_job(ref_name) if args.reuse_reference else None
    reuse = bool(old and (old.get("status") or {}).get("phase") == "Succeeded" and
                 old["metadata"].get("labels", {}).get("sftjob.io/chaos-spec") == spec_hash(ref_obj))
    delete_jobs(ctx, keep=ref_name if reuse else None)

    # -- the reference run ----------------------------------------------------------------
    t = time.time()
    if reuse:
        ref = old
        say(f"reference job {args.namespace}/{ref_name}: reusing the earlier run of the same spec (--reuse-reference)")
    else:
        say(f"reference job {args.namespace}/{ref_name}: {args.steps} steps, checkpoint every {args.interval}, "
            f"keep {args.keep}, S3 output; no faults")
        ctx.kube.create(JOBS.format(ns=args.namespace), ref_obj)
        ref = wait_finished(ctx, ref_name, args.job_timeout)
    say(f"reference: {ref['status']['phase']} in {time.time() - t:.0f}s, restarts {ref['status'].get('restarts')}")
    summary["reference"] = {"phase": ref["status"]["phase"], "seconds": round(time.time() - t),
                            "restarts": ref["status"].get("restarts"), "uri": (ref["status"].get("output") or {}).get("uri")}

    # -- the faulty run -------------------------------------------------------------------
    say(f"faulty job {args.namespace}/{run_name}: same spec; {args.faults} faults from {', '.join(args.kinds)}")
    # the kubelets forget a pod's log when it is deleted: keep every incarnation's
    ctx.tap = LogTap(ctx.kube, args.namespace, f"sftjob.io/job-name={run_name}", args.workdir / "pod-logs").start()
    log_path = rank0_log(ctx, run_name)
    offset = log_path.stat().st_size if log_path.exists() else 0  # logs of earlier runs stay
    rank_logs = [ctx.tap.path(f"{run_name}-node-{r}", "trainer") for r in range(2)]
    offsets = [p.stat().st_size if p.exists() else 0 for p in rank_logs]
    ctx.kube.create(JOBS.format(ns=args.namespace), manifest(args, run_name))
    mon = Monitor(ctx.kube, ctx.s3, args.namespace, run_name, tuple(ctx.cfg.nodes))
    mon.start()
    t = time.time()
    faults: list[Fault] = []
    error = None
    try:
        faults = run_faulty(ctx, run_name, mon, rng)
        run = wait_finished(ctx, run_name, args.job_timeout)
    except (TimeoutError, ApiError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
        run = ctx.get_job(run_name) or {"status": {}}
    finally:
        time.sleep(1.0)
        mon.poll()
        mon.stop()
    st = run.get("status") or {}
    say(f"faulty run: {st.get('phase')} in {time.time() - t:.0f}s, restarts {st.get('restarts')}")

    # -- checks ---------------------------------------------------------------------------
    problems: list[str] = []
    if error:
        problems.append(error)
    if ref["status"]["phase"] != "Succeeded":
        problems.append(f"the reference job ended {ref['status']['phase']}: {ref['status'].get('message')}")
    if st.get("phase") != "Succeeded":
        problems.append(f"the faulty job ended {st.get('phase')}: {st.get('message')}")
    attribute(faults, mon, st)
    print()
    print("Faults (seed %d):" % args.seed)
    rows = [[f.index, f.kind, f.at_step if f.at_step is not None else "?", short(f.target), f.expected, f.observed,
             "ok" if f.ok else "MISMATCH"] for f in faults]
    for line in table(rows, ["#", "fault", "step", "target", "expected effect", "observed", ""]):
        print("  " + line)
    for f in faults:
        if f.extra.get("restart_reasons"):
            print(f"  #{f.index} {f.kind}: operator said " + " | ".join(f.extra["restart_reasons"][:2]))
        if not f.ok:
            problems.append(f"fault #{f.index} {f.kind}: expected {f.expected}, observed {f.observed}")
    kinds_used = sorted({f.kind for f in faults})
    if len(faults) < args.min_faults:
        problems.append(f"only {len(faults)} faults injected (< {args.min_faults})")
    if len(kinds_used) < args.min_kinds:
        problems.append(f"only {len(kinds_used)} kinds injected {kinds_used} (< {args.min_kinds})")

    # counters by cause
    external = {n: ts for n, ts in mon.node_lost_seen.items()
                if len(ts) > sum(1 for f in faults if f.kind == "node-lost" and f.target == n)}
    exp_pre = sum(1 for f in faults if f.expected_cause == PREEMPTION)
    got = restarts(st)
    print()
    print("Restart counters in status vs faults injected, by cause:")
    crow = [["preemption", exp_pre, got["preemptions"], "ok" if got["preemptions"] == exp_pre else "MISMATCH"],
            ["failure", 0, got["failures"], "ok" if got["failures"] == 0 else "MISMATCH"],
            ["total", exp_pre, (st.get("restarts") or {}).get("total", 0),
             "ok" if (st.get("restarts") or {}).get("total", 0) == exp_pre else "MISMATCH"]]
    for line in table(crow, ["cause", "injected", "status.restarts", ""]):
        print("  " + line)
    if any(r[-1] != "ok" for r in crow):
        problems.append(f"status.restarts {st.get('restarts')} != {exp_pre} preemptions and 0 failures injected")
    if external:
        problems.append(f"nodes lost by someone else during the run (shared cluster): {sorted(external)}; "
                        "rerun when the cluster is quiet")

    # checkpoints
    print()
    print("Checkpoints:")
    lines, ck_problems = check_resumes(ctx, run_name, mon, offset)
    for line in lines:
        print("  " + line)
    problems += ck_problems
    retries = 0
    for p, off in zip(rank_logs, offsets):
        if p.exists():
            with open(p, "rb") as fh:
                fh.seek(off)
                retries += len(re.findall(rb"attempt \d+ failed \(", fh.read()))
    n_outages = sum(1 for f in faults if f.kind == "minio-outage")
    print(f"  S3 requests the trainers retried (log warnings): {retries}"
          + (f" (across {n_outages} MinIO outage(s))" if n_outages else ""))
    summary["s3_retries_logged"] = retries

    # weights
    print()
    print("Final weights (hf/final, safetensors), reference vs faulty run:")
    cmp_ok = False
    ru, fu = (ref["status"].get("output") or {}).get("uri"), (st.get("output") or {}).get("uri")
    if ru and fu and st.get("phase") == "Succeeded":
        da, db = args.workdir / "reference", args.workdir / "faulty"
        for d in (da, db):
            shutil.rmtree(d, ignore_errors=True)
        download(ctx.s3, ru, da)
        download(ctx.s3, fu, db)
        cmp = compare_dirs(da, db)
        for line in cmp.lines():
            print("  " + line)
        cmp_ok = cmp.ok
        summary["weights"] = {"tensors": cmp.tensors, "identical": cmp.identical, "files": cmp.files,
                              "differing": cmp.differing}
        print(f"  {ru}\n  {fu}")
    else:
        print("  not compared: a job did not succeed")
    if not cmp_ok:
        problems.append("final weights are not bitwise identical to the reference run's")

    summary.update(
        faults=[{"index": f.index, "kind": f.kind, "step": f.at_step, "target": f.target, "detail": f.detail,
                 "expected": f.expected, "observed": f.observed, "ok": f.ok,
                 "restart_reasons": f.extra.get("restart_reasons")} for f in faults],
        kinds=kinds_used, restarts=st.get("restarts"), expected_preemptions=exp_pre,
        committed=sorted(mon.committed), attempts=[vars(x) for x in mon.attempts], phase=st.get("phase"),
        problems=problems, ok=not problems, seconds=round(time.time() - t0), weights_identical=cmp_ok)
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print()
    if problems:
        print(f"CHAOS FAILED ({len(faults)} faults of {len(kinds_used)} kinds, {time.time() - t0:.0f}s):")
        for p in problems:
            print("  - " + p)
        return 1
    print(f"CHAOS PASSED: {len(faults)} faults of {len(kinds_used)} kinds ({', '.join(kinds_used)}); job Succeeded; "
          f"final weights bitwise identical; no committed checkpoint lost; restart counters match "
          f"({time.time() - t0:.0f}s; summary {args.workdir / 'summary.json'})")
    return 0
