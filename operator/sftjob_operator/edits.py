"""The edit policy: what a user may change in a running SFTJob, and when the change takes
effect. Pure; stated here once, rendered into the SFTJob reference's table (reference.py,
docs/reference/sftjob.md) and checked against the CRD's immutability rules by a test.

Three kinds of field:
- **never**: the API server refuses the edit (a CEL rule): what the run is (model, data,
  training, storage) and the gang's shape.
- **now**: read by the operator on every pass (run policy, suspend).
- **resize**: `resources.nodes`, the size an elastic job wants (elastic.py): the running gang
  checkpoints and stops, and the next one starts at the new size.
- **restart**: built into the pods or the trainer's configuration (image, resources,
  scheduling, environment, checkpointing, the export): the running gang keeps what it was
  started with; the next gang (a restart, or a suspend and resume) gets the edit.

`status.observedGeneration` means "this spec has taken effect": while the running gang was
built from an older spec, it stays at the generation that gang was launched from, and the
`EditPending` condition says which fields wait for what. kstatus (Argo CD, Flux) then shows
the job as still reconciling, which is the truth.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from . import api
from . import conditions as c
from .phases import TERMINAL, Phase
from .status import SFTJobStatus

NEVER, NOW, RESTART = "never", "now", "at the gang's next start"
RESIZE = "at a checkpoint: the gang checkpoints, stops and resumes at the new size"

# Dotted spec paths (camelCase, as in the CRD) -> when an edit of it takes effect. The most
# specific path wins; every field of the CRD is covered by one entry (a test checks).
WHEN: dict[str, str] = {
    "model": NEVER, "data": NEVER, "training": NEVER, "storage": NEVER, "tracking": NEVER,
    "resources": RESTART, "resources.nodes": RESIZE, "resources.minNodes": NOW, "resources.processesPerNode": NEVER,
    "checkpoint": RESTART,
    "output": RESTART,
    "runPolicy": NOW, "runPolicy.terminationGracePeriodSeconds": RESTART,
    "suspend": NOW,
}


def when(path: str) -> str:
    """When an edit of the spec field at `path` (dotted, camelCase) takes effect."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in WHEN:
            return WHEN[".".join(parts[:i])]
    raise KeyError(path)


def _value(wire: dict[str, Any], path: str) -> Any:
    node: Any = wire
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _restart_paths() -> list[str]:
    return [p for p, w in WHEN.items() if w == RESTART]


def fingerprint(spec: api.SFTJobSpec) -> dict[str, str]:
    """A digest per restart-applied field group, as the gang is launched with it. Fields a
    more specific entry claims are left in (an edit of resources.nodes shows as spec.resources waiting
    until the resize)."""
    out = {}
    # Once per pass, not once per group; fields at their defaults left out, so that a field a
    # newer CRD adds (the API server fills in its default) does not look like an edit.
    wire = spec.model_dump(by_alias=True, mode="json", exclude_defaults=True)
    for path in _restart_paths():
        text = json.dumps(_value(wire, path), sort_keys=True)
        out[path] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


def waiting(st: SFTJobStatus, spec: api.SFTJobSpec) -> list[str]:
    """The field groups edited since the running gang was launched (it runs without them)."""
    launched = st.launched_spec
    if not launched or st.phase in (*TERMINAL, Phase.SUSPENDED) or st.launched_attempt != st.attempt:
        return []
    now = fingerprint(spec)
    return [f"spec.{p}" for p in sorted(now) if p in launched and launched[p] != now[p]]


def observe(st: SFTJobStatus, spec: api.SFTJobSpec, generation: int | None, now: str) -> None:
    """Set observedGeneration and the EditPending condition from what the gang runs with."""
    pending = waiting(st, spec)
    if pending and st.launched_generation is not None:
        st.observed_generation = st.launched_generation
        message = (f"{', '.join(pending)} changed since the running gang was started from generation "
                   f"{st.launched_generation}; the edit takes effect {RESTART} (a restart, or suspend: true "
                   "then false, applies it now)")
        st.conditions = c.set_condition(st.conditions, c.EDIT_PENDING, True, c.REASON_WAITS_FOR_RESTART, message,
                                        now, generation)
    else:
        st.observed_generation = generation
        if c.get_condition(st.conditions, c.EDIT_PENDING) is not None:
            st.conditions = c.set_condition(st.conditions, c.EDIT_PENDING, False, c.REASON_EDIT_APPLIED,
                                            "the running gang runs the current spec", now, generation)
