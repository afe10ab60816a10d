"""`make bench-operator`: the operator at scale on kwok fake nodes, measured against targets.

    python -m bench.operator.run                 # 1,000 SFTJobs x 2 pods on 22 kwok nodes
    python -m bench.operator.run --jobs 50       # a quick run

The operator runs as a host process (`python -m sftjob_operator.cli --namespace NS`, as in
hack/localcluster/operator_proc.py), namespace-scoped to a fresh namespace so that it never
touches anyone else's jobs on a shared cluster. Jobs are created through the API from a
thread pool; their pods land on kwok nodes, which report them Running with fake IPs, so
every rank-0 progress scrape of the operator goes to an address nothing answers (the scrape
load). Measured:

- apply -> all pods created, per job (the job's POST returned -> both of its pods seen on a
  pod watch), p50/p99/max, and all pods created relative to the last apply;
- the operator's peak RSS (VmHWM of its process);
- time to steady state: first apply -> every job's status.phase Running, and the
  operator's CPU, reconcile rate and reconcile duration after that (its /metrics);
- the progress-scrape load: scrapes/s and their outcome when the operator exports such a
  counter (any metric with "scrape" in its name), else reconciles of Running jobs/s;
- head-of-line blocking: at steady state, one pod of a few jobs is deleted and the time until
  the operator has created the replacement gang is measured: a reconcile stuck behind other
  jobs' unreachable endpoints shows up here;
- reconcile errors: sftjob_operator_reconcile_errors_total and ERROR/Traceback lines in its log.

Prints a table with the targets and PASS/FAIL; exits 1 on a miss. JSON: --out (default
.bench/operator/results.json).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hack import localcluster
from hack.localcluster.kube import ApiError, Kube, wait_crds_established

from bench.operator.harness import (JOBS, KWOK_POD_CIDR, METRICS_PORT, REPO, BlackHole, Operator, PodWatch,
                                    job_manifest, probe, syn_sent, wait_running)
from bench.operator.stats import hist_quantile, msum, pct
from sftjob_contract.metrics import COUNTER_SUFFIX
from sftjob_operator import metrics as om

CRD = REPO / "crds" / "sftjob.io_sftjobs.yaml"
RECONCILES_TOTAL = om.RECONCILES_NAME + COUNTER_SUFFIX
RECONCILE_ERRORS_TOTAL = om.RECONCILE_ERRORS_NAME + COUNTER_SUFFIX
NODE_PREFIX = "bench-kwok-"


def say(msg: str) -> None:
    print(f"[bench-operator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--kwok-nodes", type=int, default=22)
    p.add_argument("--apply-workers", type=int, default=1,
                   help="parallel creates (1: one after the other, as `kubectl apply -f` of a multi-document file)")
    p.add_argument("--probes", type=int, default=5, help="pod deletions at steady state (head-of-line probe)")
    p.add_argument("--settle-timeout", type=float, default=900, help="seconds to reach steady state")
    p.add_argument("--observe", type=float, default=20, help="seconds of steady state to measure load over")
    p.add_argument("--target-rss-mb", type=float, default=300)
    p.add_argument("--target-p99-s", type=float, default=5.0)
    p.add_argument("--target-hol-s", type=float, default=2.0,
                   help="max extra seconds (over the idle operator's) from a pod deletion to the replacement "
                        "gang's pods, at steady state: the head-of-line delay")
    p.add_argument("--no-blackhole", action="store_true",
                   help="leave routing to kwok's fake pod IPs as it is (see BlackHole)")
    p.add_argument("--keep", action="store_true", help="leave the namespace, jobs and kwok nodes")
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "operator" / "results.json")
    return p.parse_args(argv)


def _terminate(signum, frame):  # clean up (operator, namespace, nodes) on SIGTERM too
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg = localcluster.up()
    kube = Kube.from_state(cfg)
    env = {**os.environ, **localcluster.env(cfg)}
    kubectl = str(localcluster.bin_dir("k8s") / "kubectl")
    subprocess.run([kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(CRD)], env=env, check=True,
                   capture_output=True)
    wait_crds_established(kube, "sftjobs.sftjob.io")
    t = time.time()
    nodes = localcluster.kwok_up(nodes=args.kwok_nodes, cfg=cfg, prefix=NODE_PREFIX)
    say(f"{len(nodes)} kwok nodes ready ({time.time() - t:.0f}s)")
    ns = f"bench-operator-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    op = Operator(env, ns, args.out.parent / "operator.log")
    hole = BlackHole()
    results: dict[str, Any] = {"blackhole": not args.no_blackhole, "jobs": args.jobs, "pods_per_job": 2,
                               "kwok_nodes": len(nodes), "namespace": ns}
    rows: list[tuple[str, str, str, str]] = []
    ok = True
    try:
        if not args.no_blackhole:
            hole.__enter__()
            say(f"{KWOK_POD_CIDR} (kwok's pod IPs) routed into a black hole: scrapes of them time out")
        op.start()
        say(f"operator pid {op.proc.pid} (namespace {ns}), metrics :{op.metrics_port}, "
            f"RSS at start {op.status_kb('VmRSS') / 1024:.0f} MB")
        watch = PodWatch(kube, ns)
        watch.start()
        # The same probe on the idle operator first (one job): the reference for head-of-line delay.
        idle_errors: list[str] = []
        kube.create(JOBS.format(ns=ns), job_manifest("probe-idle"))
        t_idle = time.time()
        while time.time() < t_idle + 120 and len(watch.by_job.get("probe-idle", [])) < 2:
            time.sleep(0.02)
        idle_create = max(s for s, _, _ in watch.by_job["probe-idle"]) - t_idle
        say(f"one job on the idle operator: apply -> both pods created in {idle_create:.2f}s")
        wait_running(kube, ns, "probe-idle", 120)
        idle_lat = [probe(kube, ns, watch, "probe-idle", idle_errors) for _ in range(3)]
        kube.delete(f"{JOBS.format(ns=ns)}/probe-idle")
        say("probe on the idle operator: " + ", ".join(f"{x:.2f}s" for x in idle_lat))
        # Let the operator see the probe job go before the scale run's error count starts.
        while kube.get(f"/api/v1/namespaces/{ns}/pods", labelSelector="sftjob.io/job-name=probe-idle")["items"]:
            time.sleep(0.3)
        time.sleep(3)
        m0 = op.samples()
        cpu0 = op.cpu_seconds()
        log_offset = op.log_path.stat().st_size  # errors are counted from here: the scale run

        # -- apply -----------------------------------------------------------------------
        applied: dict[str, float] = {}
        errors: list[str] = []

        def create(i: int) -> None:
            name = f"bench-{i:05d}"
            try:
                kube.create(JOBS.format(ns=ns), job_manifest(name))
                applied[name] = time.time()
            except (ApiError, OSError) as e:
                errors.append(f"{name}: {e}")

        t_first = time.time()
        with ThreadPoolExecutor(args.apply_workers) as pool:
            list(pool.map(create, range(args.jobs)))
        t_last = max(applied.values()) if applied else time.time()
        say(f"applied {len(applied)} SFTJobs in {t_last - t_first:.1f}s ({len(errors)} errors)")
        want = 2 * len(applied)
        deadline = time.time() + args.settle_timeout

        def n_created() -> int:
            with watch.lock:
                return sum(min(2, len(watch.by_job.get(n, []))) for n in applied)

        while n_created() < want and time.time() < deadline:
            time.sleep(0.2)
        with watch.lock:
            pods_seen = [max(s for s, _, _ in watch.by_job[n]) for n in applied if len(watch.by_job.get(n, [])) >= 2]
            lat = [max(s for s, _, _ in watch.by_job[n]) - applied[n] for n in applied
                   if len(watch.by_job.get(n, [])) >= 2]
        all_after_last = (max(pods_seen) - t_last) if len(lat) == len(applied) else float("nan")
        created = n_created()
        say(f"pods: {created}/{want} seen; all created {all_after_last:.1f}s after the last apply; "
            f"per job p50 {pct(lat, 50):.2f}s p99 {pct(lat, 99):.2f}s max {max(lat or [0]):.2f}s")

        # -- steady state ----------------------------------------------------------------
        def phases() -> dict[str, int]:
            out: dict[str, int] = {}
            cont = None
            while True:
                page = kube.get(JOBS.format(ns=ns), limit="500", **({"continue": cont} if cont else {}))
                for j in page["items"]:
                    ph = (j.get("status") or {}).get("phase") or "None"
                    out[ph] = out.get(ph, 0) + 1
                cont = page["metadata"].get("continue")
                if not cont:
                    return out

        steady_at = None
        last_ph: dict[str, int] = {}
        while time.time() < deadline:
            last_ph = phases()
            if last_ph.get("Running", 0) == len(applied):
                steady_at = time.time()
                break
            time.sleep(2)
        t_steady = (steady_at - t_first) if steady_at else float("nan")
        say(f"steady state (every job Running) {t_steady:.1f}s after the first apply" if steady_at else
            f"no steady state within {args.settle_timeout:.0f}s: phases {last_ph}")

        # -- load at steady state ----------------------------------------------------------
        ma, ca, ta = op.samples(), op.cpu_seconds(), time.time()
        inflight = []
        while time.time() < ta + args.observe:
            inflight.append(syn_sent(METRICS_PORT))
            time.sleep(0.5)
        mb, cb, tb = op.samples(), op.cpu_seconds(), time.time()
        dt = tb - ta
        rec_rate = (msum(mb, RECONCILES_TOTAL) - msum(ma, RECONCILES_TOTAL)) / dt
        cpu_pct = 100 * (cb - ca) / dt
        scrape_keys = sorted({k.partition("{")[0] for k in mb if "scrape" in k and not k.startswith("python_")})
        scrape_rates = {k: (msum(mb, k) - msum(ma, k)) / dt for k in scrape_keys
                        if k.endswith(("_total", "_count"))}
        dur_p50 = hist_quantile(mb, om.RECONCILE_SECONDS_NAME, 0.5, ma)
        dur_p99 = hist_quantile(mb, om.RECONCILE_SECONDS_NAME, 0.99, ma)
        say(f"steady state over {dt:.0f}s: {rec_rate:.1f} reconciles/s, operator CPU {cpu_pct:.0f}%, "
            f"reconcile duration p50 {dur_p50:.3f}s p99 {dur_p99:.3f}s; scrape metrics {scrape_rates or 'none'}; "
            f"unanswered scrape connections in flight: mean {statistics.fmean(inflight or [0]):.1f}, "
            f"max {max(inflight or [0])}")

        # -- head-of-line probe: a preempted job must be restarted as fast as on an idle operator
        names = sorted(applied)
        stride = max(1, len(names) // max(1, args.probes))
        probe_lat = [probe(kube, ns, watch, name, errors) for name in names[::stride][: args.probes]]
        say("head-of-line probe under load (pod deleted -> replacement gang created): "
            + ", ".join(f"{x:.2f}s" for x in probe_lat))

        # -- the end -------------------------------------------------------------------------
        m_end = op.samples()
        hwm_mb = op.status_kb("VmHWM") / 1024
        rec_errors = (msum(m_end, RECONCILE_ERRORS_TOTAL)
                      - msum(m0, RECONCILE_ERRORS_TOTAL))
        with open(op.log_path, "rb") as fh:
            fh.seek(log_offset)
            log_text = fh.read().decode(errors="replace")
        log_errors = [line for line in log_text.splitlines()
                      if re.search(r"\bERROR\b|Traceback|reconcile .* failed", line)]
        results.update(
            apply_seconds=t_last - t_first, apply_errors=errors[:20], pods_seen=created, pods_expected=want,
            all_pods_after_last_apply_s=all_after_last, latency_p50_s=pct(lat, 50), latency_p99_s=pct(lat, 99),
            latency_max_s=max(lat or [float("nan")]), steady_state_s=t_steady, phases=last_ph,
            reconciles_per_s=rec_rate, operator_cpu_pct=cpu_pct, reconcile_duration_p50_s=dur_p50,
            reconcile_duration_p99_s=dur_p99, scrape_syn_sent_mean=statistics.fmean(inflight or [0]),
            scrape_syn_sent_max=max(inflight or [0]), apply_workers=args.apply_workers, idle_create_s=idle_create,
            scrape_rates=scrape_rates, probe_latencies_s=probe_lat, idle_probe_latencies_s=idle_lat,
            peak_rss_mb=hwm_mb, reconcile_errors=rec_errors, log_error_lines=log_errors[:20],
            watch_errors=watch.errors, operator_cpu_total_s=op.cpu_seconds() - cpu0)

        def row(what: str, value: str, target: str = "", passed: bool | None = None) -> None:
            nonlocal ok
            rows.append((what, value, target, "" if passed is None else ("PASS" if passed else "FAIL")))
            if passed is False:
                ok = False

        row("jobs x pods (kwok nodes)", f"{len(applied)} x 2 ({len(nodes)})", f"{args.jobs} x 2",
            len(applied) == args.jobs and not errors)
        row("apply duration (first -> last create)",
            f"{t_last - t_first:.1f} s ({len(applied) / max(t_last - t_first, 1e-9):.0f} "
            f"jobs/s, {args.apply_workers} client(s))")
        row("all pods created after the last apply", f"{all_after_last:.1f} s ({created}/{want} pods)",
            f"all {want}", created >= want)
        row("apply -> all pods created, one job on the idle operator", f"{idle_create:.2f} s")
        row("apply -> all pods created, p50 per job", f"{pct(lat, 50):.2f} s")
        row("apply -> all pods created, p99 per job", f"{pct(lat, 99):.2f} s", f"< {args.target_p99_s:g} s",
            pct(lat, 99) < args.target_p99_s)
        row("apply -> all pods created, max", f"{max(lat or [float('nan')]):.2f} s")
        row("peak RSS of the operator (VmHWM)", f"{hwm_mb:.0f} MB", f"< {args.target_rss_mb:g} MB",
            hwm_mb < args.target_rss_mb)
        row("time to steady state (all jobs Running)", f"{t_steady:.1f} s", "reached", bool(steady_at))
        row("reconciles/s at steady state", f"{rec_rate:.1f}")
        row("reconcile duration p50 / p99 at steady state", f"{dur_p50:.3f} / {dur_p99:.3f} s")
        row("operator CPU at steady state", f"{cpu_pct:.0f} %")
        for k, v in scrape_rates.items():
            row(f"{k} /s", f"{v:.1f}")
        if not scrape_rates:
            row("progress scrapes/s (~ reconciles of Running jobs)", f"{rec_rate:.1f} (no scrape metric exported)")
        row("unanswered scrape connections in flight (mean / max)",
            f"{statistics.fmean(inflight or [0]):.1f} / {max(inflight or [0])}")
        idle = min(idle_lat or [float("nan")])  # the operator's own reaction time, without load
        hol = max(probe_lat or [float("inf")]) - idle
        row("pod deleted -> replacement gang created, idle operator", f"{idle:.2f} s (min of "
            f"{', '.join(f'{x:.2f}' for x in idle_lat)})")
        row("pod deleted -> replacement gang created, at scale", f"{max(probe_lat or [float('nan')]):.2f} s "
            f"(max of {len(probe_lat)})")
        row("head-of-line delay (at scale - idle)", f"{hol:.2f} s", f"< {args.target_hol_s:g} s",
            hol < args.target_hol_s)
        row("reconcile errors (metric, during the scale run)", f"{rec_errors:.0f}", "0", rec_errors == 0)
        row("ERROR/Traceback lines in the operator log (scale run)", f"{len(log_errors)}", "0", not log_errors)
    finally:
        op.stop()
        hole.__exit__()
        if not args.keep:
            try:
                kube.delete(f"/api/v1/namespaces/{ns}")
            except ApiError:
                pass
            for n in kube.get("/api/v1/nodes", labelSelector="type=kwok")["items"]:
                if n["metadata"]["name"].startswith(NODE_PREFIX):
                    try:
                        kube.delete(f"/api/v1/nodes/{n['metadata']['name']}")
                    except ApiError:
                        pass
    results["ok"] = ok
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    w = [max(len(r[i]) for r in rows + [("metric", "value", "target", "")]) for i in range(4)]
    print()
    print(f"Operator at scale: {args.jobs} SFTJobs x 2 pods on {args.kwok_nodes} kwok nodes "
          f"(operator log {op.log_path}, results {args.out})")
    for r in [("metric", "value", "target", "")] + rows:
        print("  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    if results.get("log_error_lines"):
        print("  first log errors:\n    " + "\n    ".join(results["log_error_lines"][:5]))
    print("\nBENCH-OPERATOR " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
