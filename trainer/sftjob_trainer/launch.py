"""`python -m sftjob_trainer.launch [torchrun options] -- [trainer arguments]`

The pod's entry point: runs `torchrun ... -m sftjob_trainer ...` (through
`sftjob_trainer.torchrun`, which ends a stop without torchrun's traceback) and gives the pod the
exit code the operator's failure policy reads (docs/trainer-contract.md). torchrun
itself exits 1 for every failure, also when the platform stopped it with SIGTERM, so:
- SIGTERM is forwarded to torchrun (which forwards it to the trainer processes, which
  checkpoint at the next step boundary), and the launcher then exits 143;
- a failed run exits 2 when the trainer's termination message names a config or data
  error (permanent: retrying cannot help), else torchrun's own code; either way the
  first rank's one-line reason is the log's last line.
torchrun's SIGTERM→SIGKILL escalation (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) defaults to the
trainer's stop budget `SFTJOB_STOP_TIMEOUT_S` when that is set.
torchrun and the trainer processes run on tcmalloc when the image has it (the CPU image does)
and `LD_PRELOAD` is not already set (`sftjob_trainer.allocator`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from sftjob_contract import command, exits
from sftjob_contract import env as E

from .allocator import allocator_env


def master_addr(torchrun_args: list[str]) -> str | None:
    for i, arg in enumerate(torchrun_args):
        for flag in ("--master-addr", "--master_addr"):
            if arg == flag and i + 1 < len(torchrun_args):
                return torchrun_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def wait_resolvable(host: str, timeout_s: float, interval_s: float = 1.0) -> bool:
    """Wait until ``host`` resolves. A gang's pods start in any order, and a pod's DNS name
    exists only once that pod runs; torchrun gives up at once on a name that does not
    resolve yet, which would turn a normal start-up race into a failed rank."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, None)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval_s)


def build_command(torchrun_args: list[str], trainer_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sftjob_trainer.torchrun", *torchrun_args, "-m", command.TRAINER_MODULE,
            *trainer_args]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if command.SEPARATOR in argv:
        cut = argv.index(command.SEPARATOR)
        torchrun_args, trainer_args = argv[:cut], argv[cut + 1 :]
    else:
        torchrun_args, trainer_args = [], argv
    env = dict(os.environ)
    if E.STOP_TIMEOUT_S in env:
        env.setdefault(E.TORCH_ELASTIC_SHUTDOWN_TIMEOUT, str(int(float(env[E.STOP_TIMEOUT_S]))))
    # The trainer processes write their one-line reason here; the launcher copies it to
    # the pod's termination log after choosing the exit code.
    final_log = env.get(E.TERMINATION_LOG) or exits.TERMINATION_LOG
    fd, worker_log = tempfile.mkstemp(prefix="sftjob-termination-")
    os.close(fd)
    env[E.TERMINATION_LOG] = worker_log

    env, allocator = allocator_env(env)
    print(f"sftjob launch: {allocator}", file=sys.stderr, flush=True)
    master = master_addr(torchrun_args)
    if master and not wait_resolvable(master, float(env.get(E.RENDEZVOUS_TIMEOUT_S, "300"))):
        print(f"sftjob launch: {master} still does not resolve; starting torchrun anyway", file=sys.stderr)
    proc = subprocess.Popen(build_command(torchrun_args, trainer_args), env=env)
    stopped = []

    def forward(signum, frame):
        stopped.append(signum)
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = proc.wait()
    message = ""
    try:
        with open(worker_log) as fh:  # the first rank's line to arrive: the first failure
            message = next((line.strip() for line in fh if line.strip()), "")
        os.unlink(worker_log)
    except OSError:
        pass
    if message:
        try:
            if final_log != exits.TERMINATION_LOG or os.access(final_log, os.W_OK):
                with open(final_log, "w") as fh:
                    fh.write(message + "\n")
        except OSError:
            pass
    if code != 0 and not stopped and message:
        # torchrun's summary ends the log with "error_file: <N/A>" for every rank; the reason
        # the first rank gave is the line a reader needs, so it comes last.
        print(f"sftjob launch: the first failure: {message}", file=sys.stderr, flush=True)
    if stopped:
        return exits.PREEMPTED
    if code != 0 and message.partition(":")[0] in exits.PERMANENT_REASONS:
        return exits.PERMANENT
    return code


if __name__ == "__main__":
    raise SystemExit(main())
