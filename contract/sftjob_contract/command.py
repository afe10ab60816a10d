"""How a pod starts the trainer (docs/trainer-contract.md, "Command").

One process: `python -m TRAINER_MODULE --config FILE [section.key=value ...]`.
A gang: `python -m LAUNCHER_MODULE [torchrun options] -- --config FILE ...`; the launcher
runs torchrun on TRAINER_MODULE and maps its exit status (exits).
"""
from __future__ import annotations

TRAINER_MODULE = "sftjob_trainer"
LAUNCHER_MODULE = "sftjob_trainer.launch"
SEPARATOR = "--"        # torchrun's options before it, the trainer's arguments after
CONFIG_FLAG = "--config"
CONFIG_DIR = "/etc/sftjob"   # where a pod mounts the job's ConfigMap, read-only (no output may go there)
CONFIG_FILE = "config.yaml"  # the trainer's config in it: --config CONFIG_DIR/CONFIG_FILE
