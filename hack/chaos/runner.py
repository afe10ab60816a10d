"""The faulty run: a seeded plan of fault kinds, and for each fault the wait for progress (a
new committed checkpoint), the wait for a seeded step, the injection and the wait for its
effect."""
from __future__ import annotations

import random
import time
import urllib.request

from hack.localcluster.kube import wait_for
from sftjob_contract.metrics import STEP

from .faults import AT_COMMIT, BEYOND_DEADLINE_S, RESTARTING, Fault, Injector, minio_live, minio_start
from .harness import METRICS_PORT, Ctx, restarts, say
from .monitor import Monitor


def rank0_step(ctx: Ctx, injector: Injector, attempt: int | None) -> int | None:
    """The trainer's own step, read from the rank-0 pod's metrics endpoint (the host reaches pod IPs)."""
    for p in injector.job_pods(attempt):
        if p["metadata"]["labels"].get("sftjob.io/rank") == "0" and p["status"].get("podIP"):
            try:
                with urllib.request.urlopen(f"http://{p['status']['podIP']}:{METRICS_PORT}/metrics", timeout=1) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith(STEP + " "):
                            v = float(line.split()[1])
                            return int(v) if v == v else None
            except OSError:
                return None
    return None


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


def run_faulty(ctx: Ctx, name: str, mon: Monitor, rng: random.Random, kinds: list[str]) -> list[Fault]:
    """Inject the planned KINDS (plan_kinds) into job NAME, one after the other."""
    a = ctx.args
    inj = Injector(ctx.cfg, ctx.kube, a.namespace, name, a.system_namespace, a.release, rng,
                   minio_outage_s=a.minio_outage, log=say, proxy=ctx.proxy, throttle_fraction=a.throttle_fraction,
                   throttle_s=a.throttle_seconds, operator_down_s=a.progress_deadline + BEYOND_DEADLINE_S,
                   effect_timeout=a.effect_timeout)
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
                if st.get("phase") == "Running" and newest is not None and (last_ckpt is None or newest > last_ckpt):  # noqa: B023 - polled in this iteration
                    return "ok"
                return None

            if wait_for(progressed, a.progress_timeout, f"a new committed checkpoint before fault {i + 1}",
                        interval=0.3) == "finished":
                say(f"the job finished before fault {i + 1}: {len(faults)} injected")
                break
            st = mon.snapshot()
            attempt, newest = st.get("attempt", 0), mon.newest_committed()
            # 2. a seeded random step within the next interval (MinIO outage, upload throttling:
            #    the step before the next checkpoint, so that its upload runs into the fault)
            if kind in AT_COMMIT:
                target = (newest // a.interval + 1) * a.interval - 1
                if target + a.interval >= a.steps:  # the final checkpoint must not meet the fault
                    kind = rng.choice([k for k in a.kinds if k not in AT_COMMIT] or ["operator-kill"])
                    say(f"fault {i + 1}: too close to the end for a fault at a commit; {kind} instead")
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
                if (mon.snapshot().get("phase") in ("Succeeded", "Failed")
                        or mon.snapshot().get("attempt", 0) != attempt):
                    break
                time.sleep(0.2)
            if mon.snapshot().get("phase") in ("Succeeded", "Failed"):
                say(f"the job finished before fault {i + 1}: {len(faults)} injected")
                break
            if kind not in AT_COMMIT:
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
                wait_for(lambda: sum(restarts(mon.snapshot()).values()) > before, a.effect_timeout,  # noqa: B023 - polled now
                         f"the restart after {kind}")
                if kind == "node-lost":
                    time.sleep(1.0)
                    inj.restore_nodes()
            elif kind.startswith("operator-kill") or kind == "operator-down-long":
                wait_for(lambda: inj.operators_recovered(f.extra["operators_before"], f.extra["victims"]),  # noqa: B023 - polled now
                         a.effect_timeout,
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
