"""No privilege through an SFTJob: the chart's ValidatingAdmissionPolicy, on the real API
server, with impersonated users. Without it, anyone allowed to create an SFTJob could run
pods as any ServiceAccount of the namespace and read any Secret or PVC there, since the
operator creates the pods with its own rights."""
from __future__ import annotations

import json
import uuid

import pytest
import yaml

from tests.chart.chart_kit import render_text
from tests.fixtures.cluster import wait_for

from .cluster_kit import example, get_job

pytestmark = pytest.mark.cluster


def _role(ns: str, user: str, rules: list[dict]) -> list[dict]:
    name = f"{user}-rights"
    return [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name, "namespace": ns},
             "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": name, "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}]


SFTJOBS = {"apiGroups": ["sftjob.io"], "resources": ["sftjobs"], "verbs": ["get", "list", "create", "patch"]}
PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}
S3_SECRET = {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["sftjob-s3"], "verbs": ["get"]}


@pytest.fixture
def policy(cluster, example_ns):
    """The chart's policy and binding, bound to this test's namespace only."""
    release = f"adm-{uuid.uuid4().hex[:6]}"
    docs = [d for d in yaml.safe_load_all(render_text(
        {"watchNamespaces[0]": example_ns}, release=release,
        extra=["--show-only", "templates/admissionpolicy.yaml"])) if d]
    assert {d["kind"] for d in docs} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))
    yield docs
    for d in docs:
        cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found", check=False)


def _as(cluster, user: str, ns: str, obj: dict, dry_run: bool = False):
    """`kubectl create` as `user`; with dry_run the API server admits (or refuses) it and
    stores nothing, so a try before the policy is in force leaves no job behind."""
    extra = ["--dry-run=server"] if dry_run else []
    return cluster.kubectl("--as", user, "-n", ns, "create", *extra, "-f", "-", input=json.dumps(obj), check=False)


def test_a_requester_may_create_only_the_sftjobs_whose_pods_they_could_make(cluster, scoped_operator, example_ns,
                                                                            policy):
    ns = example_ns
    users = {
        "alice": [SFTJOBS, PODS, S3_SECRET],              # may do all the example does
        "bob": [SFTJOBS],                                 # may not create pods
        "carol": [SFTJOBS, PODS],                         # may not read the storage Secret
    }
    manifests = [m for user, rules in users.items() for m in _role(ns, user, rules)]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(m) for m in manifests))
    cluster.kubectl("-n", ns, "create", "secret", "generic", "hf-token", "--from-literal=token=x")

    def refused(user: str, name: str, field: str, **overrides) -> None:
        # The policy takes a moment to reach the API server's admission chain.
        res = wait_for(lambda: (r := _as(cluster, user, ns, example(name, **overrides), dry_run=True)).returncode != 0
                       and r, 30, interval=1, what=f"{user}'s {name} to be refused")
        assert field in res.stderr and user in res.stderr, res.stderr

    refused("bob", "no-pods", "spec.resources:")
    refused("carol", "no-secret", "spec.storage.credentialsSecretRef.name:")
    refused("alice", "env-secret", "spec.resources.env[].valueFrom.secretKeyRef.name:",
            **{"resources.env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                                        "key": "token"}}}]})
    refused("alice", "other-sa", "spec.resources.serviceAccountName:",
            **{"resources.serviceAccountName": "workload-identity"})
    refused("alice", "claim", "spec.storage.persistentVolumeClaim.claimName:",
            **{"storage.uri": "/runs", "storage.endpoint": None,
               "storage.persistentVolumeClaim": {"claimName": "team-data"}})
    # The allowed user's job is admitted and runs.
    ok = _as(cluster, "alice", ns, example("allowed", **{"training.totalTrainingSteps": 4}))
    assert ok.returncode == 0, ok.stderr
    job = wait_for(lambda: (j := get_job(cluster, ns, "allowed")).get("status", {}).get("phase") in
                   ("Running", "Succeeded") and j, 300, interval=1, what="alice's job to run")
    assert job["status"]["phase"] in ("Running", "Succeeded")
    # Without the policy the same refused request is accepted: it is the policy that refuses.
    for d in policy:
        cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"])
    wait_for(lambda: _as(cluster, "bob", ns, example("no-pods"), dry_run=True).returncode == 0, 30,
             interval=1, what="bob's job to be accepted once the policy is gone")
