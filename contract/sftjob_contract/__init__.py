"""The contract between the SFTJob operator and the trainer it runs, as one leaf package.

Both sides import it and neither imports the other: the operator builds pods from it and
reads what the trainer reports through it, the trainer reads its inputs and writes its
outputs through it. It imports only the standard library, pydantic and PyYAML, so the
operator (and its image) never loads torch. docs/trainer-contract.md is its prose.

- `command`: the modules a pod runs (the trainer, or the launcher that wraps torchrun);
- `config`: the trainer's typed config tree (the YAML the operator writes, the CRD's
  `spec.training` schema);
- `env`: the environment variables the operator sets and the trainer or launcher reads;
- `exits`: exit codes and termination-message reasons, and what each means for a retry;
- `layout`: the files under `trainer.output_dir` (checkpoints, exports, metrics, cache);
- `metrics`: the Prometheus metric names rank 0 serves and the operator scrapes.
"""
