"""The edit policy (edits.py): the README table matches the CRD's immutability rules, and
observedGeneration says whether the running gang runs the current spec."""
from __future__ import annotations

import pytest
import yaml

from sftjob_operator import edits, reconcile
from tools.reference import CRD

from .op_testkit import apply, at, cond, pods_for, running_job, terminated

pytestmark = pytest.mark.unit


def _spec_fields(schema: dict, path: str = "") -> list[tuple[str, list[str]]]:
    """(dotted field path, the CEL rules on it and on its ancestors) for every spec field."""
    out = []
    for name, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{name}" if path else name
        rules = [r["rule"] for r in sub.get("x-kubernetes-validations", [])]
        out.append((here, rules))
        nested = sub.get("items", {}) if sub.get("type") == "array" else sub
        out += [(p, rules + r) for p, r in _spec_fields(nested, here)]
    return out


def test_every_spec_field_has_an_edit_rule_and_the_crd_enforces_never():
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    top_rules = [r["rule"] for r in spec.get("x-kubernetes-validations", [])]
    for path, rules in _spec_fields(spec):
        immutable = "self == oldSelf" in rules or f"self.{path} == oldSelf.{path}" in top_rules
        assert (edits.when(path) == edits.NEVER) == immutable, (path, edits.when(path), rules)


def _edit(body: dict, **changes) -> dict:
    body = {**body, "spec": yaml.safe_load(yaml.safe_dump(body["spec"]))}
    for path, value in changes.items():
        node = body["spec"]
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    body["metadata"] = {**body["metadata"], "generation": body["metadata"]["generation"] + 1}
    return body


def test_an_edit_the_running_gang_does_not_have_is_not_reported_as_observed():
    body, pods = running_job()
    assert body["status"]["observedGeneration"] == 1
    # A run-policy edit takes effect at once: observed.
    body = _edit(body, **{"runPolicy.backoffLimit": 4})
    body = apply(body, reconcile.plan(body, pods, at(10)))
    st = body["status"]
    assert st["observedGeneration"] == 2 and not any(c["type"] == "EditPending" for c in st["conditions"])
    # An image edit waits for the next gang: the pods run generation 1's.
    body = _edit(body, **{"resources.image": "trainer:2"})
    body = apply(body, reconcile.plan(body, pods, at(20)))
    st = body["status"]
    pending = cond(st, "EditPending")
    assert st["observedGeneration"] == 1 and pending["status"] == "True" and "spec.resources" in pending["message"]
    # A restart starts the next gang from the current spec: the edit has taken effect.
    body = apply(body, reconcile.plan(body, [terminated(pods[0], 143, "Preempted: x"), pods[1]], at(30)))
    body = apply(body, reconcile.plan(body, [], at(45)))
    new = pods_for(body, attempt=1)
    assert new[0]["spec"]["containers"][0]["image"] == "trainer:2"
    body = apply(body, reconcile.plan(body, new, at(50)))
    st = body["status"]
    assert st["observedGeneration"] == 3 and cond(st, "EditPending")["status"] == "False"


def test_the_output_uri_names_what_the_running_gang_writes():
    """A mergeLora edit mid-run pointed status.output.uri at a model the run never wrote."""
    body, pods = running_job(**{"output.mergeLora": False})
    assert body["status"]["output"]["uri"].endswith("/hf/adapter")
    body = _edit(body, **{"output.mergeLora": True})
    body = apply(body, reconcile.plan(body, pods, at(10)))
    assert "spec.output" in cond(body["status"], "EditPending")["message"]
    plan = reconcile.plan(body, [terminated(p, 0) for p in pods], at(20))
    assert plan.status["phase"] == "Succeeded" and plan.status["output"]["uri"].endswith("/hf/adapter")
