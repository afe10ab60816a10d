"""Stage 6, where a practitioner looks at the run: TensorBoard. The demo job logs to it
(`tracking.tensorboard: true`, set by job.py); the trainer publishes its event files beside
the run's outputs at every checkpoint commit and at the end, one file per attempt, so the
preempted run is still one run. They are downloaded, read back with TensorBoard's own reader
(every step once across the preemption), and the command that opens them is printed."""
from __future__ import annotations

from demo.context import Ctx, shown, status
from demo.model import download

TENSORBOARD_DIR = "tensorboard"   # under trainer.output_dir (docs/trainer.md, "Experiment tracking")


def stage_tensorboard(ctx: Ctx, job: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    out, a = ctx.out, ctx.args
    checkpoints = status(job)["output"]["checkpointsUri"]
    uri = checkpoints.rstrip("/").rsplit("/", 1)[0] + "/" + TENSORBOARD_DIR
    dest = a.workdir / TENSORBOARD_DIR / a.job
    files = download(uri, dest)
    acc = EventAccumulator(str(dest), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    loss = [e.step for e in acc.Scalars("train/loss")] if "train/loss" in tags else []
    val = [e.step for e in acc.Scalars("val/loss")] if "val/loss" in tags else []
    if not loss:
        raise SystemExit(f"TensorBoard: no train/loss in the event files under {uri} ({', '.join(files)})")
    others = ", ".join(t for t in sorted(tags) if t not in ("train/loss", "val/loss"))
    out.say(f"TensorBoard: {len(files)} event file(s) from {uri} (one per attempt); train/loss at steps "
            f"{loss[0]}..{loss[-1]}, {len(loss)} points, {len(loss) - len(set(loss))} twice; val/loss at steps "
            f"{', '.join(map(str, val)) or 'none'}; also {others}")
    out.say(f"open it:    tensorboard --logdir {shown(dest.parent)}")
    ctx.summary["tensorboard"] = {"uri": uri, "dir": str(dest.parent), "files": files, "train_loss_steps": loss,
                                  "val_loss_steps": val, "tags": sorted(tags)}
