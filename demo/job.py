"""Stage 3: apply examples/sftjob.yaml (with the demo's overrides, printed) and follow
`kubectl get sft` until the job ends, preempting it once on the way (demo.preempt)."""
from __future__ import annotations

import argparse
import json
import re
import time

from demo import preempt as preemption
from demo.context import REPO, Ctx, status, wait_for
from demo.ui import TTY, row

EXAMPLE = REPO / "examples" / "sftjob.yaml"
# MFU needs the peak FLOP/s of one process's device; a nominal figure for one CPU core.
CPU_PEAK_TFLOPS = 0.1
STALL_WARNING_S = 180


def job_manifest(args: argparse.Namespace, crd: dict | None = None,
                 s3_endpoint: str | None = None) -> tuple[dict, list[str]]:
    """examples/sftjob.yaml, with the demo's overrides and a note for each (printed, so nothing is hidden)."""
    import yaml

    obj = yaml.safe_load(EXAMPLE.read_text())
    notes = []
    obj["metadata"]["name"] = args.job
    spec = obj["spec"]
    if s3_endpoint and spec["storage"].get("endpoint") and spec["storage"]["endpoint"] != s3_endpoint:
        spec["storage"]["endpoint"] = s3_endpoint  # a local cluster on another bridge address
        notes.append(f"storage.endpoint={s3_endpoint} (this cluster's MinIO)")
    if crd is not None and "peakTflops" not in spec["training"] and training_fields(crd) >= {"peakTflops"}:
        spec["training"]["peakTflops"] = CPU_PEAK_TFLOPS
        notes.append(f"training.peakTflops={CPU_PEAK_TFLOPS} (nominal for one CPU core, so that MFU is reported)")
    if crd is not None and "tracking" not in spec and "tracking" in spec_fields(crd):
        spec["tracking"] = {"tensorboard": True}
        notes.append("tracking.tensorboard=true (event files beside the outputs: the run in TensorBoard, stage 6)")
    if args.steps:
        spec["training"]["totalTrainingSteps"] = args.steps
        interval = min(spec["checkpoint"]["interval"], max(1, args.steps // 2))
        spec["checkpoint"]["interval"] = interval
        spec["training"]["testFreq"] = max(1, args.steps // 2)
        notes.append(f"DEMO_STEPS={args.steps}: totalTrainingSteps={args.steps}, checkpoint.interval={interval}, "
                     f"testFreq={spec['training']['testFreq']}")
    return obj, notes


def spec_fields(crd: dict, *path: str) -> set[str]:
    """The keys of spec (or of spec.<path>) in the CRD the cluster serves (an older CRD may lack new ones)."""
    try:
        node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        for key in path:
            node = node["properties"][key]
        return set(node["properties"])
    except (KeyError, IndexError):
        return set()


def training_fields(crd: dict) -> set[str]:
    """spec.training's keys in the CRD the cluster serves."""
    return spec_fields(crd, "training")


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
    crd = ctx.kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/sftjobs.sftjob.io")
    obj, notes = job_manifest(a, crd, ctx.cfg.s3_endpoint)
    for n in notes:
        out.say(n)
    ctx.t_apply = time.time()
    ctx.kubectl("-n", a.namespace, "apply", "-f", "-", input=json.dumps(obj),
                show=f"kubectl -n {a.namespace} apply -f examples/sftjob.yaml")
    out.cmd(f"kubectl -n {a.namespace} get sft {a.job}   # a new line whenever phase, step or restarts change")
    out.say(row(ctx.kubectl("-n", a.namespace, "get", "sft", a.job).stdout, header=True))
    job, st, pre, resume = _watch(ctx)
    prog = st.get("progress", {}) or {}
    ctx.t_end = time.time()
    ctx.summary.update(phase=st.get("phase"), restarts=st.get("restarts"), progress=prog,
                       output_uri=(st.get("output") or {}).get("uri"), preemption=pre, resume_line=resume,
                       run_seconds=round(ctx.t_end - ctx.t_apply, 1))
    if st.get("phase") != "Succeeded":
        out.say(f"{a.job} {st.get('phase')}: {st.get('message')}")
        ctx.show_events()
        raise SystemExit(f"the SFTJob ended {st.get('phase')}; see `kubectl -n {a.namespace} describe sft {a.job}`")
    r = st.get("restarts") or {}
    out.say(f"Succeeded in {ctx.t_end - ctx.t_apply:.0f} s: step {prog.get('step')}/{prog.get('totalSteps')}, "
            f"restarts: {r.get('preemptions', 0)} preemption(s), {r.get('failures', 0)} failure(s)")
    if resume is None and pre:
        ctx.summary["resume_line"] = preemption.resumed_line(ctx, pre)
    if pre:  # which attention kernel the trainer image's rank 0 ran (trainer.cpu_attention)
        ctx.summary["attention_line"] = preemption.trainer_log_line(ctx, pre["rank0"], "CPU attention:")
    _say_eta(ctx)
    prog_final = status(ctx.get_job()).get("progress") or {}
    out.say(f"goodput {prog_final.get('goodput')} (training time over wall time since creation), "
            f"{prog_final.get('stepsLost') or 0} step(s) lost to restarts")
    return job


def _watch(ctx: Ctx) -> tuple[dict, dict, dict | None, str | None]:
    """Poll the job until it ends: print a row on every change, evict a pod once the first
    checkpoint is committed, then find the line where the new gang resumed."""
    out, a = ctx.out, ctx.args
    last_key = None
    last_change = time.time()
    warned = False
    pre: dict | None = None
    resume: str | None = None
    deadline = time.time() + a.timeout
    while True:
        job = ctx.get_job()
        st = status(job)
        prog = st.get("progress", {}) or {}
        key = (st.get("phase"), prog.get("step"), (st.get("restarts") or {}).get("total") or 0)
        if key != last_key:
            line = row(ctx.kubectl("-n", a.namespace, "get", "sft", a.job, check=False).stdout)
            phase_changed = last_key is None or key[0] != last_key[0] or key[2] != last_key[2]
            out.progress(line, newline=phase_changed or not TTY)
            last_key = key
            last_change = time.time()
        elif not warned and time.time() - last_change > STALL_WARNING_S:
            warned = True
            out.say(f"no progress for 3 minutes; `kubectl -n {a.namespace} describe sft {a.job}` and "
                    f"`kubectl -n {a.namespace} logs {a.job}-node-0` say why (is another sftjob-operator, e.g. one "
                    f"started with --all-namespaces by a test, acting on this job too?)")
        if pre is None and st.get("phase") == "Running":
            seen = preemption.rank0_log_progress(ctx)
            if max(prog.get("lastCheckpointStep") or 0, seen[0]) >= ctx.preempt_after:
                pre = preemption.preempt(ctx, job, seen)
                last_key = None
        if pre is not None and resume is None:
            resume = preemption.resumed_line(ctx, pre)
            if resume:
                _say_resumed(ctx, pre, resume)
        _note_eta(ctx, prog, resumed=resume is not None)
        if st.get("phase") in ("Succeeded", "Failed"):
            out.end_line()
            return job, st, pre, resume
        if time.time() > deadline:
            raise SystemExit(f"{a.job} did not finish within {a.timeout} s (phase {st.get('phase')})")
        time.sleep(1.0)


def _note_eta(ctx: Ctx, prog: dict, resumed: bool) -> None:
    """The operator's ETA when the job first showed 25 % done, and again right after the
    resume: compared with the real remaining time once the job ends (stage_job)."""
    key = "eta_after_resume" if resumed else "eta_at_25_percent"
    if key in ctx.summary or (prog.get("percent") or 0) < 25 or prog.get("estimatedRemainingSeconds") is None:
        return
    ctx.summary[key] = {"at": time.time(), "percent": prog["percent"], "predicted_s": prog["estimatedRemainingSeconds"]}


def _say_eta(ctx: Ctx) -> None:
    for key, what in (("eta_at_25_percent", "before the preemption"), ("eta_after_resume", "after the resume")):
        eta = ctx.summary.get(key)
        if eta:
            eta["actual_s"] = round(ctx.t_end - eta["at"], 1)
            ctx.out.say(f"ETA at {eta['percent']} % ({what}): {eta['predicted_s']} s predicted, "
                        f"{eta['actual_s']:.0f} s taken (status.progress.estimatedRemainingSeconds)")


def _say_resumed(ctx: Ctx, pre: dict, resume: str) -> None:
    ctx.out.say(f"{ctx.args.job}-node-0 log (attempt {status(ctx.get_job()).get('attempt')}): {resume}")
    m = re.search(r"step-(\d+)", resume)
    if m:
        pre["resume_step"] = int(m.group(1))
        why = ("the checkpoint the trainer wrote on SIGTERM"
               if int(m.group(1)) > (pre["checkpoint_step"] or 0) else "the last periodic checkpoint")
        ctx.out.say(f"resumed at step {m.group(1)}: {why}; no step is lost or repeated")
