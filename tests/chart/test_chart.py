"""The Helm chart and the images without a cluster: lint, render, schema, RBAC table, scanners."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from .chart_kit import CHART, CRD_COPY, CRD_SOURCE, DOCKERFILES, REPO, find, helm, one, render, render_text
from .rbac_needs import LEASE_KEYS, NEEDS, granted

pytestmark = [pytest.mark.unit, pytest.mark.built]  # helm, from hack/build-binaries.sh

# Every optional part switched on, namespace-scoped: with the defaults, the two shapes.
ALL_ON = {"dashboard.enabled": "true", "metrics.serviceMonitor.enabled": "true",
          "metrics.podMonitor.enabled": "true", "rbac.ownerReferencesPermissionEnforcement": "true",
          "trainer.serviceAccountName": "trainer", "image.digest": "sha256:" + "a" * 64}
NAMESPACED = {"watchNamespaces": "{team-a,team-b}"}


def test_lint_clean():
    for values in ({}, NAMESPACED, ALL_ON, {**ALL_ON, **NAMESPACED}, {"crds.enabled": "false"}):
        args = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
        out = helm("lint", "--strict", "CHART", *args).stdout
        assert "0 chart(s) failed" in out and "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("typo", ["operator.resourcez.limits.cpu=1", "watchNamespace={a}", "rbac.readNode=false",
                                  "image.pullPolicy=Sometimes", "metrics.service.prot=9090",
                                  "trainer.serviceAccount=x"])
def test_misspelled_value_fails_with_schema_error(typo):
    res = helm("template", "x", "CHART", "--set", typo, check=False)
    assert res.returncode != 0
    assert "don't meet the specifications of the schema" in res.stderr, res.stderr


def test_schema_is_closed_and_every_value_documented():
    schema = json.loads((CHART / "values.schema.json").read_text())
    maps = {"annotations", "labels", "nodeSelector", "podAnnotations", "podLabels", "affinity", "global"}

    def walk(node, path):
        if node.get("type") != "object":
            return
        name = path.rsplit(".", 1)[-1]
        if name in maps or "properties" not in node:
            assert name in maps or path.endswith(("tolerations", "metricsFrom", "imagePullSecrets")), path
            return
        assert node.get("additionalProperties") is False, f"{path or 'root'} is not closed"
        for key, child in node["properties"].items():
            walk(child, f"{path}.{key}".lstrip("."))

    walk(schema, "")
    # values.yaml: a comment right above every value a user sets (leaves of the schema;
    # the keys inside free-form maps such as resources or labels are examples, not values).
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, stack = [], []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w-]*):", line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        stack[depth:] = [m.group(2)]
        node = schema
        for key in stack:
            node = (node.get("properties") or {}).get(key)
            if node is None:
                break
        is_leaf = node is not None and "properties" not in node
        if stack[:2] == ["operator", "resources"] and len(stack) > 2:
            continue  # documented as a whole on `operator.resources`
        if is_leaf and not lines[i - 1].strip().startswith("#"):
            undocumented.append(".".join(stack))
    assert not undocumented, f"values without a doc comment: {undocumented}"


def test_chart_crd_is_crds_dir():
    """One source of truth: the chart's file is a symlink to crds/ (helm follows it, and
    `helm package` stores the file's contents)."""
    assert CRD_COPY.is_symlink() and CRD_COPY.resolve() == CRD_SOURCE.resolve()


def test_rendered_crd_is_the_source_with_chart_defaults():
    source = yaml.safe_load(CRD_SOURCE.read_text())
    docs = render({"trainer.image": "registry.example/trainer:1", "trainer.serviceAccountName": "trainer"})
    crd = one(docs, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    for version in crd["spec"]["versions"]:
        res = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["resources"]["properties"]
        assert res["image"]["default"] == "registry.example/trainer:1"
        assert res["serviceAccountName"]["default"] == "trainer"
    # Apart from those, the CRD is the file's, metadata included.
    assert crd["metadata"]["name"] == source["metadata"]["name"] and set(source["metadata"]) == {"name"}
    for version, src in zip(crd["spec"]["versions"], source["spec"]["versions"]):
        res = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["resources"]["properties"]
        del res["serviceAccountName"]["default"]
        res["image"]["default"] = src["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
            "resources"]["properties"]["image"]["default"]
    assert crd["spec"] == source["spec"]
    assert "annotations" not in one(render({"crds.keep": "false"}), "CustomResourceDefinition")["metadata"]
    assert not find(render({"crds.enabled": "false"}), "CustomResourceDefinition")


def test_operator_pod_is_locked_down():
    for values in ({}, NAMESPACED):
        dep = one(render(values), "Deployment")
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert c["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        assert c["command"] == ["sftjob-operator"]
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert pod["serviceAccountName"] == one(render(values), "ServiceAccount")["metadata"]["name"]
        scope = [a for a in c["args"] if a.startswith(("--namespace", "--all-namespaces"))]
        assert scope == (["--all-namespaces"] if not values else ["--namespace=team-a", "--namespace=team-b"])
    # The flags exist in the operator's CLI (a renamed flag would crash-loop the pod).
    from sftjob_operator.cli import _parser

    _parser().parse_args(list(c["args"]))


def test_replicas_elect_a_leader_with_a_disruption_budget():
    """Two replicas by default, one acting (Lease named like the release, in its namespace);
    a PodDisruptionBudget and soft anti-affinity keep a standby; one replica without election
    is the only other safe shape."""
    from sftjob_operator.cli import _parser

    docs = render()
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = _parser().parse_args(c["args"])
    assert args.leader_elect is True and args.leader_election_name == "sftjob-sftjob-operator"
    assert (args.leader_election_lease_duration, args.leader_election_renew_deadline,
            args.leader_election_retry_period) == (15, 10, 2)
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": dep["spec"]["selector"]}
    assert pdb["metadata"]["namespace"] == "sftjob-system"
    # a user's own affinity replaces the default; no PDB when switched off
    own = {"operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
           ".nodeSelectorTerms[0].matchExpressions[0].key": "x",
           "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
           ".nodeSelectorTerms[0].matchExpressions[0].operator": "Exists"}
    assert list(one(render(own), "Deployment")["spec"]["template"]["spec"]["affinity"]) == ["nodeAffinity"]
    assert not find(render({"podDisruptionBudget.enabled": "false"}), "PodDisruptionBudget")
    # Without election: one replica, Recreate, no Lease rights; more replicas are refused.
    off = render({"leaderElection.enabled": "false", "replicaCount": "1"})
    dep = one(off, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "--no-leader-elect" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "affinity" not in dep["spec"]["template"]["spec"]
    assert not find(off, "Role", "sftjob-sftjob-operator-leader-election")
    assert not find(off, "RoleBinding", "sftjob-sftjob-operator-leader-election")
    res = helm("template", "x", "CHART", "--set", "leaderElection.enabled=false", check=False)
    assert res.returncode != 0 and "replicaCount > 1 needs leaderElection.enabled" in res.stderr, res.stderr
    res = helm("template", "x", "CHART", "--set", "leaderElection.renewDeadlineSeconds=15", check=False)
    assert res.returncode != 0 and "retryPeriodSeconds < renewDeadlineSeconds" in res.stderr, res.stderr


def test_rbac_grants_exactly_the_needed_verbs():
    cluster_docs = render()
    (role,) = find(cluster_docs, "ClusterRole")
    (lease_role,) = find(cluster_docs, "Role", "sftjob-sftjob-operator-leader-election")
    assert granted(role["rules"]) == set(NEEDS) - LEASE_KEYS, "chart rules and tests/chart/rbac_needs.py disagree"
    # One rule per resource, so that removing any one rule removes one capability.
    assert all(len(r["resources"]) == 1 and len(r["apiGroups"]) == 1 for r in role["rules"] + lease_role["rules"])
    binding = one(cluster_docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sftjob-sftjob-operator",
                                    "namespace": "sftjob-system"}]
    # Leader election: only in the release namespace; read and renew only the one Lease
    # (create cannot be limited by name, so it is the only unnamed verb).
    assert lease_role["metadata"] == {**lease_role["metadata"], "name": "sftjob-sftjob-operator-leader-election",
                                      "namespace": "sftjob-system"}
    assert granted(lease_role["rules"]) == LEASE_KEYS
    assert sorted((r["verbs"], r.get("resourceNames")) for r in lease_role["rules"]) == [
        (["create"], None), (["get", "update"], ["sftjob-sftjob-operator"])]
    (lease_binding,) = find(cluster_docs, "RoleBinding", "sftjob-sftjob-operator-leader-election")
    assert lease_binding["roleRef"]["name"] == lease_role["metadata"]["name"]
    assert lease_binding["subjects"] == binding["subjects"]
    # Node heartbeats: read-only, only in kube-node-lease, only with rbac.readNodes.
    (beats,) = find(cluster_docs, "Role", "sftjob-sftjob-operator-node-heartbeats")
    assert beats["metadata"]["namespace"] == "kube-node-lease"
    assert beats["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}]
    (beats_binding,) = find(cluster_docs, "RoleBinding", "sftjob-sftjob-operator-node-heartbeats")
    assert beats_binding["metadata"]["namespace"] == "kube-node-lease"
    assert beats_binding["roleRef"]["name"] == beats["metadata"]["name"]
    assert beats_binding["subjects"] == binding["subjects"]
    assert not find(render({"rbac.readNodes": "false"}), "Role", "sftjob-sftjob-operator-node-heartbeats")
    # Namespace-scoped: the same verbs, but namespaced resources only through Roles.
    docs = render(NAMESPACED)
    (crole,) = find(docs, "ClusterRole")
    assert {r["resources"][0] for r in crole["rules"]} == {"customresourcedefinitions", "nodes"}
    roles = [r for r in find(docs, "Role")
             if not r["metadata"]["name"].endswith(("-leader-election", "-node-heartbeats"))]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for r in roles:
        assert granted(r["rules"]) | granted(crole["rules"]) | LEASE_KEYS == set(NEEDS)
    assert len(find(docs, "RoleBinding")) == 4
    assert not LEASE_KEYS & granted(one(render({"leaderElection.enabled": "false", "replicaCount": "1"}),
                                        "ClusterRole")["rules"])
    # Options: nodes off; finalizers on (OwnerReferencesPermissionEnforcement clusters).
    assert ("", "nodes", "get") not in granted(one(render({"rbac.readNodes": "false"}), "ClusterRole")["rules"])
    assert ("", "nodes", "list") not in granted(one(render({"rbac.readNodes": "false"}), "ClusterRole")["rules"])
    extra = granted(one(render(ALL_ON), "ClusterRole")["rules"]) - set(NEEDS)
    assert extra == {("sftjob.io", "sftjobs/finalizers", "update")}
    assert not find(render({"rbac.create": "false"}), "ClusterRole")


def test_no_secrets_no_wildcards_anywhere():
    for values in ({}, NAMESPACED, ALL_ON):
        for doc in render(values):
            for rule in doc.get("rules", []):
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
                assert not any(r.startswith("secrets") for r in rule["resources"]), rule
                assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate"}, rule


def test_optional_resources():
    docs = render(ALL_ON)
    dash = find(docs, "ConfigMap")[0]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dash["data"]["sftjob.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    from sftjob_operator import metrics as op_metrics

    for metric in ("sftjob_operator_jobs", "sftjob_operator_gang_restarts_total", "sftjob_trainer_loss"):
        assert metric in exprs
    assert op_metrics.JOBS._name == "sftjob_operator_jobs"
    pm = one(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"]["sftjob.io/rank"] == "0"
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    dep = one(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith("@sha256:" + "a" * 64)
    assert one(docs, "NetworkPolicy")["spec"]["ingress"][0]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert not find(render(), "PodMonitor") and not find(render(), "ServiceMonitor")
    # The pod label the PodMonitor selects is the one the operator puts on rank 0.
    from sftjob_operator import builders

    assert builders.LABEL_RANK == "sftjob.io/rank" and builders.METRICS_PORT


def test_dockerfiles_install_the_project_extras_as_non_root():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, path in DOCKERFILES.items():
        text = path.read_text()
        assert name in extras
        # exactly the project's install step for that extra, non-editable
        assert re.search(rf"pip install --no-cache-dir '\.\[{name}\]'", text), name
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        assert users and users[-1].split(":")[0] not in ("0", "root"), users
        assert users[-1].split(":")[0].isdigit(), "numeric USER, so runAsNonRoot can verify it"
    installs = re.findall(r"pip install[^\n]*", DOCKERFILES["operator"].read_text())
    assert installs and not any("torch" in line for line in installs), installs
    assert "find_spec('torch') is None" in DOCKERFILES["operator"].read_text()
    assert "flash-attn" in DOCKERFILES["trainer"].read_text()
    # uid/gid of the trainer image = the operator's fixed pod security context
    from sftjob_operator import builders
    from tests.operator.op_testkit import job_body

    pod = builders.build_pods(builders.JobRef.from_body(job_body()), builders.parse_spec(job_body()["spec"]), 0)[0]
    assert f"USER {pod['spec']['securityContext']['runAsUser']}:{pod['spec']['securityContext']['runAsGroup']}" \
        in DOCKERFILES["trainer"].read_text()


def test_hadolint_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    res = subprocess.run([hadolint, *map(str, DOCKERFILES.values())], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def checkov_path() -> str:
    """checkov lives in its own tool venv (`make checkov-install`): installed into the project
    venv it would downgrade boto3 and packaging under the trainer."""
    cache = Path(os.environ.get("SFTJOB_CACHE", Path.home() / ".cache" / "sftjob"))
    for candidate in (os.environ.get("SFTJOB_CHECKOV"), shutil.which("checkov"),
                      *sorted(map(str, cache.glob("checkov-*/bin/checkov")), reverse=True)):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("checkov not found: run `make checkov-install` (or set SFTJOB_CHECKOV)")


@pytest.mark.timeout(600)
def test_checkov_passes_on_rendered_chart_and_dockerfiles(tmp_path):
    for name, values in (("default", {}), ("namespaced", NAMESPACED), ("all-on", ALL_ON)):
        (tmp_path / f"{name}.yaml").write_text(render_text(values))
    config = REPO / "charts" / "checkov.yaml"
    reports = []
    for framework, targets in (("kubernetes", ["-d", str(tmp_path)]),
                               ("dockerfile", [a for p in DOCKERFILES.values() for a in ("-f", str(p))])):
        res = subprocess.run([checkov_path(), "--config-file", str(config), "--framework", framework, *targets,
                              "-o", "json"], capture_output=True, text=True, timeout=300, cwd=REPO)
        out = json.loads(res.stdout)
        reports += out if isinstance(out, list) else [out]
    failed = [(c["check_id"], c["resource"], c.get("file_path")) for r in reports
              for c in r["results"]["failed_checks"]]
    passed = sum(len(r["results"]["passed_checks"]) for r in reports)
    frameworks = {r["check_type"] for r in reports}
    assert frameworks == {"kubernetes", "dockerfile"}, frameworks
    assert not failed, failed
    assert passed > 300
    # The Dockerfiles' inline skips are the documented ones, on the trainer: CKV_DOCKER_2 (no
    # HEALTHCHECK) and CKV_DOCKER_7 (its last FROM names a stage, RUNTIME_FLAVOR, not an image).
    skipped = {c["check_id"] for r in reports for c in r["results"]["skipped_checks"]}
    assert skipped <= {"CKV_DOCKER_2", "CKV_DOCKER_7"}, skipped
