"""Run the trainer the way a pod does: a real process, single or under torchrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    code: int
    output: str
    out_dir: Path

    def steps(self) -> list[dict]:
        return [r for r in read_metrics(self.out_dir) if "loss" in r]

    def vals(self) -> list[dict]:
        return [r for r in read_metrics(self.out_dir) if "val_loss" in r]

    def why(self, tail: int = 2000) -> str:
        """For an assertion message: every rank's error lines (a traceback's last line, an
        ERROR log, the launcher's verdict), which torchrun's long summary pushes out of any
        tail, then the tail itself."""
        marks = (" ERROR ", "Error:", "Exception:", "sftjob launch:")
        errors = [line for line in self.output.splitlines()
                  if any(m in line for m in marks) and "torch/distributed/elastic" not in line]
        return "\n".join(errors[-40:]) + "\n[...]\n" + self.output[-tail:]


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def base_args(assets: Path, out: Path, **over) -> list[str]:
    args = {
        "model.path": assets / "model",
        "data.train_files": assets / "data" / "train.parquet",
        "data.max_length": 64,
        "data.train_batch_size": 8,
        "data.micro_batch_size_per_gpu": 4,
        "optim.lr": 3e-3,
        "optim.lr_scheduler": "constant",
        "trainer.output_dir": out,
        "trainer.total_training_steps": 10,
        "trainer.log_freq": 10,
    }
    args.update(over)
    return [f"{k}={v}" for k, v in args.items()]


def command(args: list[str], nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "sftjob_trainer", *args]
    return [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", f"--nproc-per-node={nproc}", "--", *args]


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ) | (extra or {})
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def run(args: list[str], out: Path, nproc: int = 1, timeout: float = 600, extra_env: dict | None = None) -> Result:
    proc = subprocess.run(command(args, nproc), capture_output=True, text=True, timeout=timeout, env=env(extra_env))
    return Result(proc.returncode, proc.stdout + proc.stderr, Path(out))


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def kill_tree(pid: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_and_kill(args: list[str], out: Path, after_steps: int, nproc: int = 1, timeout: float = 600) -> Result:
    """Start a run and SIGKILL its whole process tree (launcher and ranks: a lost node) once
    ``after_steps`` steps are in metrics.jsonl; nothing gets to checkpoint on the way out."""
    proc = subprocess.Popen(command(args, nproc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env())
    deadline = time.time() + timeout
    while len([r for r in read_metrics(out) if "loss" in r]) < after_steps:
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc.pid)
            raise AssertionError(f"run ended or stalled before it was killed:\n{proc.communicate()[0]}")
        time.sleep(0.02)
    kill_tree(proc.pid)
    output, _ = proc.communicate(timeout=timeout)
    return Result(proc.returncode, output, Path(out))


def run_and_sigterm(args: list[str], out: Path, after_steps: int, nproc: int = 1, timeout: float = 600,
                    extra_env: dict | None = None) -> Result:
    """Start a run and SIGTERM it once ``after_steps`` steps are in metrics.jsonl (under ``out``)."""
    proc = subprocess.Popen(command(args, nproc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(extra_env))
    deadline = time.time() + timeout
    while len([r for r in read_metrics(out) if "loss" in r]) < after_steps:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before it was signalled:\n{proc.stdout.read()}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("run did not reach the step to signal it at")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=timeout)
    return Result(proc.returncode, output, Path(out))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(args: list[str], out: Path, node_env: list[dict], nproc_per_node: int = 1,
              timeout: float = 600) -> list[Result]:
    """One job over ``len(node_env)`` simulated nodes: a launcher per node (as a pod runs it),
    each with its own environment (its own SFTJOB_LOCAL_DIR and SFTJOB_MODEL_CACHE: another
    node's disk), meeting at a rendezvous on this machine. One Result per node, in node order."""
    import tempfile

    port = free_port()
    logs = [tempfile.TemporaryFile("w+") for _ in node_env]  # pipes read one by one could fill and stall a node
    procs = [subprocess.Popen(
        [sys.executable, "-m", "sftjob_trainer.launch", f"--nnodes={len(node_env)}", f"--node-rank={i}",
         f"--nproc-per-node={nproc_per_node}", "--master-addr=127.0.0.1", f"--master-port={port}", "--", *args],
        stdout=logs[i], stderr=subprocess.STDOUT, text=True, env=env(extra))
        for i, extra in enumerate(node_env)]
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    results = []
    for p, log in zip(procs, logs):
        log.seek(0)
        results.append(Result(p.returncode, log.read(), Path(out)))
        log.close()
    return results
