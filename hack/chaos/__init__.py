"""Seeded fault injection against one real SFTJob on the local cluster (`make chaos`).

    python -m hack.chaos                      # 12 faults of 6 kinds, seed 1
    python -m hack.chaos --faults 4 --kinds pod-delete,trainer-sigkill,operator-kill --steps 16

The same small job (tiny model, S3 output, a checkpoint every few steps) runs twice through
the operator the chart installs: once untouched, once while faults are injected at seeded
random moments. Both must succeed with bitwise identical final weights; no committed
checkpoint may be lost; the job's restart counters must equal the faults injected, by cause.
See hack/chaos/run.py for the flow (harness.py, runner.py and report.py hold its steps) and
hack/chaos/faults.py for each fault.
"""
from .faults import KINDS  # noqa: F401 - re-exported: the package's fault kinds
