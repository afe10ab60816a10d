"""Generate the SFTJob CustomResourceDefinition from the pydantic models (api.py, status.py).

Pydantic emits JSON Schema 2020-12; a CRD needs a *structural* OpenAPI v3.0 schema. The
translation here: inline every $ref, turn `X | None` into an optional X (never `nullable`:
an absent field is the Kubernetes way), `int | str` into x-kubernetes-int-or-string, tuples
into bounded arrays, numeric exclusive bounds into the v3.0 boolean form, drop titles and
`additionalProperties: false` (not allowed next to `properties`; unknown fields are
rejected by kubectl's strict field validation and otherwise pruned), and bound every list
and string so that CEL cost estimation accepts the rules.

    python -m sftjob_operator.crd > crds/sftjob.io_sftjobs.yaml      (what `make crds` runs)
"""
from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from . import api
from .status import SFTJobStatus

# CEL's cost estimator needs bounds on every list and string it may iterate or compare.
DEFAULT_MAX_ITEMS = 1000
DEFAULT_MAX_LENGTH = 4096
# The name becomes the Service name and, with "-node-<rank>", each pod's hostname (63 max).
NAME_RULE = {
    "rule": "self.metadata.name.size() <= 52 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "message": "metadata.name must be a DNS-1035 label (lower-case letters, digits, '-', starting with a "
    "letter) of at most 52 characters: it names the job's Service and its pods' hostnames",
}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
     "description": "Why the job is in its phase: QueuedByKueue, Unschedulable, AllPodsRunning, ..."},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.summary", "description": "step/totalSteps."},
    {"name": "Done%", "type": "number", "jsonPath": ".status.progress.percent",
     "description": "Percent of the steps done."},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "description": "Latest training loss."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.total", "description": "Gang restarts."},
    {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes", "description": "Pods in the current gang."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "ETA(s)", "type": "integer", "jsonPath": ".status.progress.estimatedRemainingSeconds", "priority": 1,
     "description": "Estimated seconds to the last step."},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.progress.goodput", "priority": 1,
     "description": "Training time over wall time since creation."},
    {"name": "Failures", "type": "integer", "jsonPath": ".status.restarts.failures", "priority": 1,
     "description": "Restarts after a failure."},
    {"name": "Preemptions", "type": "integer", "jsonPath": ".status.restarts.preemptions", "priority": 1,
     "description": "Restarts after a preemption."},
    {"name": "Resizes", "type": "integer", "jsonPath": ".status.resizes.count", "priority": 1,
     "description": "Times an elastic gang changed size."},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.progress.tokensPerSecond", "priority": 1,
     "description": "Training throughput."},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.progress.lastCheckpointStep", "priority": 1,
     "description": "Step of the newest committed checkpoint."},
]


def _is_null(s: dict[str, Any]) -> bool:
    return s.get("type") == "null"


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Translate one pydantic JSON-schema node into a structural OpenAPI v3.0 node."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        rules = node.pop("x-kubernetes-validations", []) + target.get("x-kubernetes-validations", [])
        node = {**target, **node}  # the referring field's description/default win
        if rules:
            node["x-kubernetes-validations"] = rules
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if not _is_null(b)]
        types = sorted(b.get("type", "") for b in branches)
        if types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
        elif len(branches) == 1:
            node = {**branches[0], **node}
            return _structural(node, defs)
        else:
            raise ValueError(f"cannot express anyOf {branches} in a structural schema")
    if node.get("default", 0) is None:
        del node["default"]
    node.pop("title", None)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "prefixItems" in node:
        items = node.pop("prefixItems")
        node["items"] = items[0]
        node.setdefault("minItems", len(items))
        node.setdefault("maxItems", len(items))
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out and isinstance(out.get("default"), dict):
        out["default"] = {}  # nested defaults are filled in by the API server, level by level
    if out.get("type") == "array":
        out.setdefault("maxItems", DEFAULT_MAX_ITEMS)
    if out.get("type") == "string" and "enum" not in out:
        out.setdefault("maxLength", DEFAULT_MAX_LENGTH)
    return out


def openapi_schema(model: type[BaseModel], *, by_alias: bool = True) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=by_alias)
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _structural(raw, defs)
    return schema


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition as a dict."""
    spec = openapi_schema(api.SFTJobSpec)
    # Unknown status fields are pruned, not kept: the operator is the status's only writer
    # (kopf's bookkeeping lives in annotations, see handlers.startup), so an unknown field
    # can only be a misspelling, which must not be stored silently.
    status = openapi_schema(SFTJobStatus)
    status.pop("required", None)
    root = {
        "type": "object",
        "description": "SFTJob runs supervised fine-tuning of a language model as a gang of pods that "
        "restarts together after preemption and resumes from its newest checkpoint.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version: sftjob.io/v1alpha1."},
            "kind": {"type": "string", "description": "SFTJob."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [NAME_RULE],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": ["all"],
            },
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


HEADER = "# Generated by operator/sftjob_operator/crd.py (`make crds`) from the API models; do not edit by hand.\n"


class _NoAliases(yaml.SafeDumper):
    """Repeated sub-schemas are written out in full: anchors would only puzzle readers."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render() -> str:
    """The CRD as the YAML text committed in crds/."""
    return HEADER + yaml.dump(crd(), Dumper=_NoAliases, sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
