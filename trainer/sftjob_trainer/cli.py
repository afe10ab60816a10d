"""`sftjob-train` / `python -m sftjob_trainer`: parse, build, train, close.

Exit codes and the termination message follow docs/trainer-contract.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from sftjob_contract import env as E
from sftjob_contract import exits
from sftjob_contract.metrics import LINGER_S

from .allocator import in_use, reexec_with_allocator
from .errors import InvalidConfig, TrainerError

log = logging.getLogger("sftjob_trainer")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        row = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        rank = os.environ.get(E.RANK)
        if rank is not None:
            row["rank"] = int(rank)
        if record.exc_info:
            row["exc"] = self.formatException(record.exc_info)
        return json.dumps(row)


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get(E.LOG_FORMAT) == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        rank = os.environ.get(E.RANK)
        prefix = f"[rank{rank}] " if rank is not None and os.environ.get(E.WORLD_SIZE, "1") != "1" else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # Non-zero ranks only say what matters; rank 0 speaks for the job.
    if os.environ.get(E.RANK, "0") != "0":
        logging.getLogger("sftjob_trainer").setLevel(logging.WARNING)
    for noisy in ("transformers", "peft", "torch.distributed", "urllib3", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def write_termination_message(message: str) -> None:
    """One line for `kubectl describe` and the operator; never raises. Appended, in one
    write: the ranks of a pod share the file, and the launcher keeps the first line, the
    first failure (the others' are often only its echo, a peer's closed connection)."""
    path = os.environ.get(E.TERMINATION_LOG) or exits.TERMINATION_LOG
    line = message.replace("\n", " ")[:4000]
    try:
        if path == exits.TERMINATION_LOG and not os.access(path, os.W_OK):
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="sftjob-train",
        description="Supervised fine-tuning of a Hugging Face causal LM (FSDP2, full or LoRA).",
        epilog="Overrides use dotted keys, e.g. optim.lr=1e-5 data.train_batch_size=64 lora.rank=8",
    )
    ap.add_argument("--config", help="YAML config file (see examples/trainer.yaml)")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    if os.environ.get(E.RANK, "0") == "0":
        log.info(in_use())
    # Imported late so `--help` and config errors answer without loading torch.
    from sftjob_contract.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return _fail(InvalidConfig(str(err)))
    return run(cfg)


def run(cfg) -> int:
    from . import dist as dist_utils
    from . import cpu_attention
    from .cpu_blas import dispatch_by_instruction_set
    from .early_stop import stopped_early
    from .train import Preempted, StopFlag, Trainer

    stop = StopFlag()
    stop.install()
    t0 = time.time()
    # Before any matrix product: oneMKL chooses its kernels at the first one (cpu_blas.py).
    mkl = dispatch_by_instruction_set(cfg.trainer.cpu_mkl_dispatch)
    world = dist_utils.init_world()
    attention = cpu_attention.choose(cfg.trainer.cpu_attention) if world.device.type == "cpu" else None
    if world.rank == 0:
        log.info(mkl)
        if attention:
            log.info(attention)
    trainer = None
    succeeded = False
    try:
        trainer = Trainer(cfg, world, stop)
        final = trainer.train()
        if world.is_main:
            early = stopped_early(cfg.trainer, trainer.state, trainer.total_steps)
            msg = (f"{exits.REASON_EARLY_STOPPED}: {early}; model exported to {final}" if early
                   else f"{exits.REASON_SUCCEEDED}: model exported to {final}")
            log.info("%s (%.0fs)", msg, time.time() - t0)
            print(f"model: {final}", flush=True)
            write_termination_message(msg)
        succeeded = True
        return exits.SUCCEEDED
    except Preempted as err:
        if world.is_main:
            write_termination_message(f"{exits.REASON_PREEMPTED}: {err}")
        log.warning("stopped after SIGTERM: %s", err)
        return exits.PREEMPTED
    except TrainerError as err:
        return _fail(err)
    except Exception as err:  # every other failure still gets a one-line reason
        log.exception("training failed")
        return _fail(TrainerError(f"{type(err).__name__}: {err}"))
    finally:
        if trainer is not None:
            # After success, long enough for one more scrape of the final step and validation
            # (the operator scrapes every few seconds); never after SIGTERM, whose budget is tight.
            linger = LINGER_S if succeeded and cfg.trainer.metrics_port and world.is_main else 0.0
            trainer.close(linger_s=linger)
        dist_utils.close_world()


def _fail(err: TrainerError) -> int:
    line = f"{err.reason}: {err}"
    print(line, file=sys.stderr, flush=True)
    write_termination_message(line)
    return err.exit_code


def entrypoint() -> None:
    """Console entry point: run, flush, and leave without interpreter teardown.

    Everything a run produces (checkpoints, exports, metrics, the termination message) is
    written and closed before ``main`` returns. What teardown would add is only risk: native
    thread pools (Arrow, gloo) destroyed during finalization can abort a process whose work
    succeeded, turning a finished job into a failed rank. ``os._exit`` skips that.
    A trainer the launcher did not start first re-executes itself on tcmalloc
    (``allocator.reexec_with_allocator``).
    """
    reexec_with_allocator()
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    entrypoint()
