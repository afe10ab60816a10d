"""`python -m sftjob_trainer.torchrun ARGS` is `torchrun ARGS`, quiet when it is stopped.

torchrun answers a SIGTERM (a preemption, a drain, the pod's deletion) by stopping its
workers, which checkpoint and exit, and then raising: its traceback ended the log of every
preempted pod and read like a crash. Here the same stop ends with one line and exit code
128 + the signal; everything else is torchrun's own behaviour.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as err:
        print(f"torchrun: stopped by signal {int(err.sigval)} after its workers exited", file=sys.stderr)
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
