"""The training run: build the components, resume, loop, validate, export."""
from __future__ import annotations

import logging
import math
import resource
import signal
import time

import torch

from sftjob_contract import exits, layout
from sftjob_contract.config import SFTConfig

from . import checkpoint as ckpt
from . import dist as dist_utils
from . import early_stop, gather, mixing, tracking
from .data import SampleBuilder, SFTDataset
from .batching import GlobalBatches, eval_batches, logged_ids, min_micro_batch_tokens
from .dist import World
from .errors import CheckpointFailed, InvalidConfig, NonFiniteLoss, TrainerError
from .export import export
from .loss import ce_sum
from .metrics import Metrics, step_flops
from . import ulysses
from .model import attention_dims, build_model, check_device_options, matmul_params
from .optim import build_optimizer, init_state, set_lr
from .outputs import Outputs
from .precision import use_widened_bf16
from .storage import local_model_path
from .unwrap import model_config

log = logging.getLogger(__name__)


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_NON_FINITE_HINT = ("Check the base model spec.model.path for NaN/inf weights, or lower spec.training.optim.lr, "
                    "or use spec.training.precision fp32")

HOLD_TICK_S = 0.2   # how often the ranks agree, while holding, whether to stop or go on


class Preempted(Exception):
    """Raised after the stop checkpoint committed; the CLI turns it into exit 143."""


class StopFlag:
    """Set by SIGTERM; acted on at the next step boundary, by all ranks together."""

    def __init__(self) -> None:
        self.requested = False
        self.at = 0.0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.at = time.monotonic()
            log.warning("SIGTERM: will checkpoint at the next step boundary and exit")
        self.requested = True


class Trainer:
    def __init__(self, cfg: SFTConfig, world: World, stop: StopFlag):
        from transformers import AutoTokenizer

        check_device_options(cfg.model.liger_kernel, cfg.trainer.cpu_offload, world.device, cfg.trainer.compile)
        world = ulysses.setup(world, cfg.trainer.sequence_parallel_size)  # the dp x sp grid (ulysses.py)
        self.cfg, self.world, self.stop = cfg, world, stop
        self.outputs = Outputs.open(cfg.trainer.output_dir, world.rank, world.size, cfg.trainer.keep_checkpoints,
                                    cfg.trainer.upload_timeout_s, cfg.trainer.max_failed_commits)
        # A resume's shards download while the model is built; a full fine-tune's takes every parameter
        # from them, so no rank reads the base weights. Storage failures arrive classified (s3errors).
        if (resume_step := self.outputs.checkpoints.resumable()) is not None:
            self.outputs.checkpoints.prefetch(resume_step)
        self.resume_step = resume_step
        self.from_checkpoint = self.resume_step is not None and cfg.lora.rank == 0
        self.model_path = model_path = local_model_path(cfg.model.path, world.rank == 0 and not self.from_checkpoint)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError) as err:
            raise InvalidConfig(f"spec.model.path {cfg.model.path}: cannot load a tokenizer ({err})") from None
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        builder = SampleBuilder(self.tokenizer, cfg.data)
        self.train_ds = mixing.train_dataset(self.tokenizer, cfg.data, builder, world.rank, world.size, self.outputs)
        self.val_ds = (SFTDataset(cfg.data.val_files, builder, "val", world.rank, world.size, self.outputs)
                       if cfg.data.val_files else None)
        self.shard = ulysses.sharder(world, pad_id)
        self.batches = GlobalBatches(self.train_ds, cfg.data, cfg.trainer.seed, world.dp_rank, world.dp_size, pad_id,
                                     self.shard, min_tokens=min_micro_batch_tokens(model_path, world.device))
        self.pad_id = pad_id
        self.total_steps = cfg.trainer.total_training_steps or self.batches.steps_per_epoch * cfg.trainer.total_epochs
        torch.manual_seed(cfg.trainer.seed)
        widen = use_widened_bf16(world.device, cfg.trainer.precision, cfg.trainer.cpu_bf16_gemm)
        self.model = build_model(cfg.model, cfg.lora, model_path, world, widen_bf16=widen,
                                 precision=cfg.trainer.precision, compiled=cfg.trainer.compile,
                                 offload=cfg.trainer.cpu_offload, from_checkpoint=self.from_checkpoint)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim,
                                         fused=world.size == 1 and not cfg.trainer.cpu_offload)
        self.gather = gather.plan(self.model, cfg.trainer, world)  # FSDP's gathers: per layer or per step
        self.n_matmul, (self.n_layers, self.d_attn) = matmul_params(self.model), attention_dims(self.model)

        self.checkpoints = self.outputs.checkpoints
        self.outputs.restore_metrics()
        self.state = ckpt.TrainerState(
            step=0, epoch=0, cursor=0, total_steps=self.total_steps, global_batch=cfg.data.train_batch_size,
            data_fingerprint=self.train_ds.fingerprint(), world_size=world.size, tokens_seen=0,
            lr_scheduler=cfg.optim.lr_scheduler,
        )
        # last_saved: the newest step a save started for (every rank); last_committed: the newest
        # whose marker is written (rank 0 only learns it, from the commit thread).
        self.last_saved = self.last_committed = -1
        self._resume()
        # Clock of trainer.save_interval_s: the last committed checkpoint, or now (rank 0's counts).
        self.last_save_time = time.monotonic()
        # Started after the resume so a scrape never sees step 0 of a resumed run.
        self.metrics = Metrics(self.outputs.metrics_path if world.is_main else None,
                               cfg.trainer.metrics_port if world.is_main else 0)
        self.metrics.gauge(total_steps=self.total_steps, step=self.state.step, epoch=self.state.epoch,
                           last_checkpoint_step=max(self.last_committed, 0))
        mixing.publish_report(self.metrics, self.train_ds, fresh=self.state.step == 0)
        self.tracking = tracking.open_tracker(cfg, world.is_main, self.outputs.store, self.metrics)
        # Reported when the checkpoint commits (for s3://, after its upload), not when written.
        self.checkpoints.on_commit = self._committed
        self.checkpoints.on_failed_commit = lambda step: self.metrics.count(failed_commits=1)

    def _committed(self, step: int) -> None:
        self.last_committed = step
        self.metrics.gauge(last_checkpoint_step=step, last_checkpoint_time=time.time())
        self.tracking.commit()  # TensorBoard's files beside the checkpoint

    # ------------------------------------------------------------------ resume / save

    def _resume(self) -> None:
        if (step := self.resume_step) is None:
            log.info("no committed checkpoint under %s: starting from step 0", self.checkpoints.where)
            return
        init_state(self.optimizer)  # the slots the checkpoint's optimizer state loads into
        saved = self.checkpoints.load(step, self.model, self.optimizer)
        if saved.global_batch != self.state.global_batch:
            raise InvalidConfig(
                f"checkpoint step-{step} was trained with data.train_batch_size={saved.global_batch}; resuming with "
                f"{self.state.global_batch} would change the sample order. Keep the batch size or use a new output_dir"
            )
        if saved.data_fingerprint != self.state.data_fingerprint:
            raise InvalidConfig(
                f"checkpoint step-{step} was trained on different data (fingerprint {saved.data_fingerprint}, now "
                f"{self.state.data_fingerprint}); use a new output_dir to train on new data"
            )
        self.state = ckpt.TrainerState(**{**saved.__dict__, "total_steps": self.total_steps,
                                          "world_size": self.world.size})
        self.last_saved = self.last_committed = step
        log.info("resumed from %s (epoch %d, cursor %d; saved by %d processes, now %d)",
                 self.checkpoints.location(step), saved.epoch, saved.cursor, saved.world_size, self.world.size)

    def save(self, final: bool = False, until: float | None = None) -> None:
        """Checkpoint the current step; ``final`` also waits until it is committed.

        ``until`` (monotonic seconds) is the stop deadline after SIGTERM."""
        if self.state.step == self.last_saved and self.checkpoints.failed_step != self.state.step:
            self.checkpoints.wait(raise_errors=final, until=until)
            return  # never rewrite (and so briefly lose) a committed checkpoint
        blocked = self.checkpoints.save(self.model, self.optimizer, self.state, final=final, until=until,
                                        stopping=lambda: self.stop.requested)
        self.last_saved = self.state.step
        self.last_save_time = time.monotonic()
        log.info("checkpoint step-%d written in %.2fs%s", self.state.step, blocked,
                 "" if final else " (committing in the background)")
        self.metrics.gauge(checkpoint_save_seconds=blocked)
        self.outputs.publish_metrics()

    # ------------------------------------------------------------------ loop

    def train(self) -> str:
        cfg = self.cfg.trainer
        self.checkpoints.keep_best = cfg.export == "best"
        self.metrics.gauge(**early_stop.gauges(self.state))  # a resumed run shows what it knew
        first_step = self.state.step
        while self.state.step < self.total_steps and not early_stop.should_stop(cfg, self.state):
            micro_batches = self.batches.step_batches(self.state.epoch, self.state.cursor)
            # One all-reduce per step carries the token counts, the SIGTERM flag, rank 0's
            # save_interval_s decision and any rank's failed checkpoint commit, so every rank
            # checkpoints after the same step, and stops after the same one, at no extra cost.
            # It also carries the operator's "checkpoint now" (control.py), which rank 0 alone hears.
            self.metrics.requests.step = self.state.step
            hold = self.metrics.requests.take()
            local = torch.tensor([sum(mb.n_targets for mb in micro_batches), sum(mb.n_tokens for mb in micro_batches),
                                  float(self.stop.requested), float(self._interval_due()),
                                  float(self.checkpoints.poll()), float(hold is not None)], dtype=torch.float64)
            n_targets, n_tokens, stops, interval_due, commit_failed, asked = dist_utils.all_reduce_sum(local).tolist()
            self.checkpoints.end_if_failed(bool(commit_failed))
            if stops:
                raise Preempted(self._stop_checkpoint())
            if asked:
                self._checkpoint_and_hold(hold or 0.0)
            self._train_step(micro_batches, n_targets, n_tokens)
            # Validate first: the checkpoint of this step then carries the early-stopping count.
            if self.val_ds is not None and cfg.test_freq and self.state.step % cfg.test_freq == 0:
                self.validate()
            if ((cfg.save_freq and self.state.step % cfg.save_freq == 0) or interval_due
                    or (cfg.export == "best" and early_stop.is_new_best(self.state))):
                self.save()
        if reason := early_stop.stopped_early(cfg, self.state, self.total_steps):
            log.info("early stopping: %s", reason)
            self.metrics.gauge(early_stopped=1)
            if self.state.step > first_step:  # once in metrics.jsonl, not again by a restart after the stop
                self.metrics.record(step=self.state.step, early_stopped=1, reason=reason)
        if self.state.non_finite_in_a_row >= self.state.step > 0:
            raise NonFiniteLoss(f"no optimizer step of this run had a finite loss and gradient norm (all "
                                f"{self.state.step} were skipped); nothing is exported. {_NON_FINITE_HINT}")
        try:
            self.save(final=True)  # a preemption during validation/export resumes straight into them
        except TrainerError:
            raise
        except Exception as err:  # a transient cause: name what to check
            raise CheckpointFailed(f"the final checkpoint step-{self.state.step} was not committed to "
                                   f"spec.storage.uri ({self.checkpoints.store.uri}): {err}") from err
        if self.val_ds is not None and self.state.val_step != self.state.step:
            self.validate()
        return self.tracking.finish(self.export())

    def _interval_due(self) -> bool:
        """Rank 0 only: has trainer.save_interval_s passed since the last committed checkpoint?"""
        every = self.cfg.trainer.save_interval_s
        return bool(self.world.is_main and every and time.monotonic() - self.last_save_time >= every)

    def _checkpoint_and_hold(self, hold_s: float) -> None:
        """The operator's request before a planned stop (control.py): commit the current step,
        then train no further for up to `hold_s` (rank 0's clock) so the SIGTERM that follows
        finds nothing left to save. Every rank ticks through one small all-reduce, so all
        leave the hold together: stopping on any rank's SIGTERM, or training on."""
        if self.state.step > 0:   # before the first step there is nothing to lose
            self.save(final=True)
        log.info("checkpoint step-%d committed on request; holding up to %.0fs for the stop", self.state.step, hold_s)
        self.metrics.gauge(holding=1)
        until = time.monotonic() + hold_s
        while True:
            time.sleep(HOLD_TICK_S)
            local = torch.tensor([float(self.stop.requested), float(self.world.is_main and time.monotonic() >= until)],
                                 dtype=torch.float64)
            stops, release = dist_utils.all_reduce_sum(local).tolist()
            if stops:
                raise Preempted(self._stop_checkpoint())
            if release:
                if self.world.is_main:  # only rank 0 holds the clock (the others were told hold 0)
                    log.warning("no stop came within %.0fs of the requested checkpoint step-%d: training on",
                                hold_s, self.state.step)
                self.metrics.gauge(holding=0)
                return

    def _stop_checkpoint(self) -> str:
        """Checkpoint after SIGTERM within trainer.stop_timeout_s; says what was kept.

        A checkpoint that cannot commit in time is abandoned, never half-used: the next
        start resumes from the newest committed one.
        """
        budget = self.cfg.trainer.stop_timeout_s
        start = self.stop.at if self.stop.requested else time.monotonic()  # another rank was signalled
        until = start + budget - min(10.0, 0.1 * budget)  # leave time to exit
        try:
            self.save(final=True, until=until)
        except Exception as err:  # still a preemption: what was committed before stays
            if isinstance(err, TrainerError) and err.exit_code == exits.PERMANENT:
                raise  # the store refuses writes: a restart would only meet that again
            log.error("stop checkpoint step-%d NOT committed: %s", self.state.step, err)
            return (f"checkpoint step-{self.state.step} not committed within trainer.stop_timeout_s={budget:g}s "
                    f"({err}); resuming from the newest committed checkpoint")
        return f"checkpoint step-{self.state.step} committed"

    def _train_step(self, micro_batches, n_targets: float, n_tokens: float) -> None:
        step = self.state.step
        torch.manual_seed(self.cfg.trainer.seed * 1_000_003 + step * 7919 + self.world.rank)
        lr = set_lr(self.optimizer, self.cfg.optim, step, self.total_steps)
        self.model.train()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        # FSDP averages gradients over ranks; scaling by the world size turns that average
        # into the sum, so the gradient is exactly d(sum of CE)/d(w) / (global target tokens).
        scale = self.world.size / n_targets
        for mb in self.gather.micro_batches(micro_batches):
            ce = ce_sum(self.model, mb, self.world.device, self.cfg.trainer.precision)
            (ce * scale).backward()
            loss_sum += ce.detach().double().cpu()
        grad_norm = self._clip()
        loss = dist_utils.all_reduce_sum(loss_sum.reshape(1)).item() / n_targets
        # Both are reduced over all ranks, so every rank skips (and stops) at the same step.
        skipped = not (math.isfinite(grad_norm) and math.isfinite(loss))
        if skipped:
            log.warning("step %d: non-finite loss (%s) or gradient norm (%s), skipping the update", step + 1, loss,
                        grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        planned = self.batches.step_ids(self.state.epoch, self.state.cursor) if self.cfg.trainer.log_sample_ids else []

        self.state = ckpt.TrainerState(**{**self.state.__dict__, **self._advance(),
                                          "tokens_seen": self.state.tokens_seen + int(n_tokens),
                                          "non_finite_in_a_row": self.state.non_finite_in_a_row + 1 if skipped else 0})
        rss = dist_utils.all_reduce_max(torch.tensor([peak_rss_mb()])).item()
        row: dict[str, float | list[int]] = dict(step=self.state.step, epoch=self.state.epoch, loss=loss, lr=lr,
                                                 grad_norm=grad_norm, tokens=int(n_tokens),
                                                 tokens_per_s=n_tokens / seconds, max_rss_mb=rss)
        if self.cfg.trainer.log_sample_ids:
            parts = dist_utils.all_gather_objects([i for mb in micro_batches for i in mb.sample_ids])
            row["sample_ids"] = logged_ids(planned, parts)
        if self.cfg.trainer.peak_tflops:
            lengths = dist_utils.all_gather_objects([n for mb in micro_batches for n in mb.seq_lengths])
            flops = step_flops(self.n_matmul, self.n_layers, self.d_attn, [n for part in lengths for n in part])
            row["mfu"] = flops / seconds / (self.cfg.trainer.peak_tflops * 1e12 * self.world.size)
        self.metrics.record(**row)
        self.tracking.log(self.state.step, row)
        self.metrics.count(tokens=int(n_tokens), skipped=int(skipped))
        if self.world.is_main and (self.state.step % self.cfg.trainer.log_freq == 0
                                   or self.state.step == self.total_steps):
            log.info("step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f", self.state.step, self.total_steps,
                     loss, lr, grad_norm, row["tokens_per_s"])
        limit = self.cfg.trainer.max_non_finite_steps
        if limit and self.state.non_finite_in_a_row >= limit:
            raise NonFiniteLoss(f"{self.state.non_finite_in_a_row} optimizer steps in a row, up to step "
                                f"{self.state.step}, had a non-finite loss ({loss}) or gradient norm ({grad_norm}) and "
                                f"were skipped (limit: spec.training.maxNonFiniteSteps={limit}). {_NON_FINITE_HINT}")

    def _advance(self) -> dict:
        cursor = self.state.cursor + self.batches.global_batch
        epoch = self.state.epoch
        if cursor + self.batches.global_batch > self.train_ds.epoch_size:
            epoch, cursor = epoch + 1, 0  # the remainder that does not fill a global batch is skipped
        return {"step": self.state.step + 1, "epoch": epoch, "cursor": cursor}

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.optim.clip_grad or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ validation / export

    @torch.no_grad()
    def validate(self) -> float:
        assert self.val_ds is not None  # callers validate only with validation data
        self.model.eval()
        micro = self.cfg.data.micro_batch_size_per_gpu
        batches = list(eval_batches(self.val_ds, micro, self.world.dp_rank, self.world.dp_size, self.cfg.data.packing,
                                    self.pad_id, self.shard))
        # FSDP ranks must run the same number of forwards: pad with weight-0 repeats. A rank
        # with no rows of its own (fewer validation rows than ranks) repeats the first row.
        most = int(dist_utils.all_reduce_max(torch.tensor([len(batches)])).item())
        filler = batches[-1] if batches else next(eval_batches(self.val_ds, 1, 0, 1, self.cfg.data.packing, self.pad_id,
                                                               self.shard))
        totals = torch.zeros(2, dtype=torch.float64)
        for i in range(most):
            mb = batches[i] if i < len(batches) else filler
            ce = ce_sum(self.model, mb, self.world.device, self.cfg.trainer.precision)
            if i < len(batches):
                totals += torch.tensor([ce.double().item(), mb.n_targets], dtype=torch.float64)
        ce_total, count = dist_utils.all_reduce_sum(totals).tolist()
        val_loss = ce_total / count
        self.state = early_stop.after_validation(self.state, val_loss, self.cfg.trainer.early_stopping_min_delta)
        self.metrics.record(**early_stop.row(self.state))
        self.tracking.log(self.state.step, early_stop.row(self.state))
        if self.world.is_main:
            log.info("step %d val_loss %.4f", self.state.step, val_loss)
        return val_loss

    def export(self) -> str:
        early_stop.restore_best(self.cfg.trainer, self.state, self.checkpoints, self.model, self.optimizer)
        self._check_weights_finite()
        model_config(self.model).use_cache = True  # training turned the KV cache off; serving wants it
        lora = self.cfg.lora.rank > 0
        self.outputs.write_dir(layout.HF, lambda d: export(self.model, self.tokenizer, d, self.model_path, lora,
                                                    self.cfg.lora.merge_on_export, self.world.rank,
                                                    base_model_ref=str(self.cfg.model.path)))
        self.outputs.publish_metrics()
        return self.outputs.location(layout.exported_model(lora, self.cfg.lora.merge_on_export))

    def _check_weights_finite(self) -> None:
        """Collective: refuse to export NaN or inf weights. Skipped steps never write them, but
        a base model can hold them where training never looked (a token the data lacks)."""
        bad = [n for n, p in self.model.named_parameters()
               if not bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())]
        bad = sorted({n for part in dist_utils.all_gather_objects(bad) for n in part})
        if bad:
            raise NonFiniteLoss(f"the trained weights hold NaN or inf values ({', '.join(bad[:3])}"
                                f"{', ...' if len(bad) > 3 else ''}); nothing is exported. {_NON_FINITE_HINT}")

    def close(self, linger_s: float = 0.0) -> None:
        self.checkpoints.close()
        self.tracking.close()
        for ds in (self.train_ds, self.val_ds):
            if ds is not None:
                ds.close()
        self.metrics.close(linger_s)
