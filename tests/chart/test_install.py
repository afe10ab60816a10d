"""The chart on the local cluster: server-side validation, install -> example Succeeded ->
upgrade with a changed CRD -> uninstall, and every RBAC verb taken away in turn.

The operator installed by the chart runs as a pod of the chart's Deployment, from the image
`make images` built, with the projected ServiceAccount token and no kubeconfig, reaching the
API server through the `kubernetes` Service, so everything it does goes through the chart's
RBAC. Its namespace and the
job's namespace enforce the `restricted` Pod Security Standard, so the API server itself
refuses an operator or training pod that could run as root or escalate privileges.

The cluster may be shared with other test runs: the operator is installed namespace-scoped
(it never touches other tests' jobs), and the CRD, which is cluster-wide, is only adopted,
extended by one optional field and then restored; `crds.keep=false` (uninstall deletes the
CRD and with it every SFTJob in the cluster) is therefore checked by rendering only.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from hack.localcluster.kube import RESTRICTED, wait_crds_established
from sftjob_operator.kube import NODE_LEASE_NAMESPACE
from tests.fixtures.cluster import wait_for

from .chart_kit import CHART, CRD_SOURCE, REPO, render_text
from .rbac_needs import NEEDS, ProbeContext, refused, sa_kube
from .upgrade_kit import UPGRADE_JOB_STEPS, Readings, gang, upgrade_mid_run, upgraded_chart

pytestmark = pytest.mark.cluster
EXAMPLE = REPO / "examples" / "sftjob.yaml"
CRD_NAME = "sftjobs.sftjob.io"
# The chart's trainer.image must reach the pods: the locally built trainer image, given this
# name on every node (nothing is pulled here).
TRAINER_IMAGE = "registry.example/sftjob/trainer:e2e"


# ---------------------------------------------------------------------------------- helpers

def restrict(cluster, ns: str) -> None:
    cluster.kube.merge_patch(f"/api/v1/namespaces/{ns}", {"metadata": {"labels": RESTRICTED}})


@pytest.fixture
def system_ns(cluster):
    """The operator's own namespace (the chart's release namespace), restricted."""
    name = f"sftjob-system-{uuid.uuid4().hex[:6]}"
    cluster.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": name, "labels": RESTRICTED}})
    yield name
    cluster.kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def shared_crd(cluster):
    """The CRD as crds/ has it during the test, and afterwards as it was (it is shared by
    every test run, and the demo's release may own it)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_SOURCE))
    before = cluster.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    yield
    # replace, not apply: fields another manager (helm) added must go too.
    meta = {k: v for k, v in before["metadata"].items() if k in ("name", "labels", "annotations")}
    cluster.kubectl("replace", "-f", "-", input=json.dumps({**before, "metadata": meta, "status": None}))
    wait_crds_established(cluster.kube, CRD_NAME)


def adopt_crd(cluster, release: str, namespace: str) -> None:
    """A CRD applied with kubectl first must be adopted before Helm manages it (README)."""
    cluster.kubectl("label", "--overwrite", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm")
    cluster.kubectl("annotate", "--overwrite", "crd", CRD_NAME, f"meta.helm.sh/release-name={release}",
                    f"meta.helm.sh/release-namespace={namespace}")


def example(name: str, **spec: object) -> dict:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["name"] = name
    obj["spec"].update(spec)
    return obj


def other_operators() -> list[str]:
    """Operators of other test runs on this machine (cluster-wide ones act on our jobs too)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--all-namespaces" in argv and any("sftjob_operator" in a or "sftjob-operator" in a for a in argv):
            found.append(" ".join(argv))
    return found


def operator_pod(cluster, ns: str, release: str) -> dict:
    """The replica that acts: the one named in the leader-election Lease (holder identity =
    pod name + "_" + a random suffix)."""
    pods = cluster.kube.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=app.kubernetes.io/instance%3D{release}")
    live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") == "Running"]
    lease = cluster.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{release}-sftjob-operator")
    holder = lease["spec"].get("holderIdentity") or ""
    leaders = [p for p in live if holder.startswith(p["metadata"]["name"] + "_")]
    return leaders[0] if len(leaders) == 1 else None


# ---------------------------------------------------------------------------------- tests

def test_rendered_chart_passes_server_side_validation(cluster, namespace, shared_crd):
    """Acceptance 1: every rendered object is valid for the 1.36 API server's OpenAPI
    (strict: unknown fields fail). Monitoring objects are left out: their CRDs
    (prometheus-operator) are not installed here."""
    for values in ({}, {"watchNamespaces": f"{{{namespace}}}", "dashboard.enabled": "true",
                        "rbac.ownerReferencesPermissionEnforcement": "true", "trainer.serviceAccountName": "t",
                        "image.digest": "sha256:" + "b" * 64}):
        docs = [d for d in yaml.safe_load_all(render_text(values, namespace=namespace)) if d]
        docs = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
        res = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-",
                              input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        out = json.loads(res.stdout)
        kinds = sorted(i["kind"] for i in out["items"])
        assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ServiceAccount", "Service",
                "NetworkPolicy"} <= set(kinds), kinds
        crd = next(i for i in out["items"] if i["kind"] == "CustomResourceDefinition")
        optim = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
            "training"]["properties"]["optim"]["properties"]
        assert isinstance(optim["eps"]["default"], float), "toYaml's 1e-08 must reach the API as a number"


def test_misspelled_value_fails_helm_install(cluster, namespace):
    """Acceptance 1: a typo in a value fails the install before anything is created."""
    res = cluster.helm("install", "typo", str(CHART), "-n", namespace, "--set", "operator.replicaz=2", check=False)
    assert res.returncode != 0 and "additional properties 'replicaz' not allowed" in res.stderr, res.stderr
    assert cluster.helm("list", "-n", namespace, "-q").stdout.strip() == ""


@pytest.mark.timeout(1500)
def test_install_runs_example_upgrade_and_uninstall(cluster, namespace, system_ns, shared_crd, tmp_path):
    """Acceptance 2 and 3: helm install; the operator (as the chart's ServiceAccount) drives
    examples/sftjob.yaml to Succeeded; while it trains, helm upgrade to a new operator image
    tag, a changed value and a chart whose CRD has a new field, and the job is neither
    restarted nor loses a step (issue 28 item 7); helm uninstall leaves no operator resource
    and keeps the CRD."""
    release, jobs_ns = f"e2e-{uuid.uuid4().hex[:4]}", namespace
    restrict(cluster, jobs_ns)
    try:
        _install_run_upgrade_uninstall(cluster, release, jobs_ns, system_ns, tmp_path)
    finally:  # a failed run must not leave cluster-scoped objects behind
        if cluster.helm("status", release, "-n", system_ns, check=False).returncode == 0:
            cluster.helm("uninstall", release, "-n", system_ns, "--wait", "--timeout", "120s", check=False)


def _install_run_upgrade_uninstall(cluster, release, jobs_ns, system_ns, tmp_path):
    from hack.localcluster import images, realnodes

    realnodes.tag_image(cluster.cfg, images.image_refs()["trainer"], TRAINER_IMAGE)
    adopt_crd(cluster, release, system_ns)
    res = cluster.helm("install", release, str(CHART), "-n", system_ns, "--set", f"watchNamespaces={{{jobs_ns}}}",
                       "--set", f"trainer.image={TRAINER_IMAGE}", "--set", "operator.logFormat=plain",
                       "--wait", "--timeout", "180s")
    assert "kubectl -n NS apply -f examples/sftjob.yaml" in res.stdout  # NOTES: what to do next
    op = wait_for(lambda: operator_pod(cluster, system_ns, release), 60, what="a leading operator pod")
    op_name = op["metadata"]["name"]
    replicas = cluster.kube.get(f"/apis/apps/v1/namespaces/{system_ns}/deployments/{release}-sftjob-operator")
    assert replicas["status"].get("readyReplicas") == 2, "the standby must be Ready too (PodDisruptionBudget)"
    assert op["spec"]["serviceAccountName"] == f"{release}-sftjob-operator"
    assert any(v.get("projected") for v in op["spec"]["volumes"]), "no projected ServiceAccount token"

    def op_log() -> str:
        """The log of the replica that leads now (the first one until the upgrade replaced it)."""
        now = operator_pod(cluster, system_ns, release)
        return cluster.pod_log(system_ns, now["metadata"]["name"] if now else op_name, "operator")

    path = f"/apis/sftjob.io/v1alpha1/namespaces/{jobs_ns}/sftjobs/tiny-lora"
    run = subprocess.run([sys.executable, str(REPO / "examples" / "assets.py"), "--namespace", jobs_ns],
                         capture_output=True, text=True, env={**os.environ, **cluster.env}, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    # The example, trained long enough for an operator upgrade to land in the middle of it.
    cluster.kubectl("-n", jobs_ns, "apply", "-f", "-",
                    input=json.dumps(example("tiny-lora", training={**yaml.safe_load(EXAMPLE.read_text())["spec"][
                        "training"], "totalTrainingSteps": UPGRADE_JOB_STEPS})))
    readings = Readings(lambda: cluster.kube.get(path))
    readings.start()
    try:
        try:
            wait_for(lambda: (readings.last.get("progress") or {}).get("step", 0) >= 2, 600, interval=1,
                     what="the example to train its first steps")
            before = gang(cluster, jobs_ns)
            new_chart = upgraded_chart(tmp_path)
            # The new field is refused before the upgrade, accepted after it (below).
            probe = example("upgrade-probe", suspend=True)
            probe["spec"]["resources"]["upgradeProbe"] = "x"
            res = cluster.kubectl("-n", jobs_ns, "apply", "-f", "-", input=json.dumps(probe), check=False)
            assert res.returncode != 0 and 'unknown field "spec.resources.upgradeProbe"' in res.stderr, res.stderr
            takeover = upgrade_mid_run(cluster, release, system_ns, new_chart, op_name,
                                       lambda: operator_pod(cluster, system_ns, release))
            during = readings.last
            assert during.get("phase") == "Running" and during["progress"]["step"] < UPGRADE_JOB_STEPS, (
                f"the upgrade must land while the job trains: {json.dumps(during)}")
            job = wait_for(lambda: (j := cluster.kube.get(path)).get("status", {}).get("phase")
                           in ("Succeeded", "Failed") and j, 900, interval=1, what="the example to finish")
            assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"])[-2000:] + op_log()[-3000:]
            # Not restarted, no step lost: the gang that finished is the one that trained before
            # the upgrade, and the new operator carried its progress on.
            assert gang(cluster, jobs_ns) == before, "the upgrade replaced the job's pods"
            status = job["status"]
            assert status.get("restarts", {}).get("total", 0) == 0, status.get("restarts")
            assert status.get("attempt") == during.get("attempt"), (status.get("attempt"), during.get("attempt"))
            assert status["progress"]["step"] == UPGRADE_JOB_STEPS
            assert not status["progress"].get("stepsLost"), status["progress"]
            after = [r for r in readings.all if r["at"] > takeover and r["status"].get("progress")]
            assert any(r["status"]["progress"]["step"] > during["progress"]["step"] for r in after), (
                "no step was reported by the upgraded operator")
            print(readings.eta_report(UPGRADE_JOB_STEPS))
        finally:
            readings.stop()
        # jobNetworkPolicy (on by default): the job's ranks accept only each other, and the
        # metrics port only this operator's pods.
        policy = cluster.kube.get(f"/apis/networking.k8s.io/v1/namespaces/{jobs_ns}/networkpolicies/tiny-lora-ranks")
        assert policy["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        own, metrics_peers = policy["spec"]["ingress"]
        assert own == {"from": [{"podSelector": {"matchLabels": {"sftjob.io/job-name": "tiny-lora"}}}]}
        assert (metrics_peers["from"][0]["namespaceSelector"]["matchLabels"]
                == {"kubernetes.io/metadata.name": system_ns})
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{op_log()[-4000:]}") from None
    # The chart's operator did the work with its in-cluster credentials: its metrics (scraped
    # from its pod IP) count the job Succeeded, which it learns only by listing the job and
    # its pods and writing the status: the upgraded replica, since the job finished after the
    # upgrade. (Which replica created the pods is not asserted: on a loaded machine a leader
    # that misses its renew deadline restarts and hands over, and its counters restart with it.)
    def leader_metrics() -> str:
        """The metrics of the replica that leads now."""
        op = operator_pod(cluster, system_ns, release)
        with urllib.request.urlopen(f"http://{op['status']['podIP']}:8080/metrics", timeout=5) as resp:
            return resp.read().decode()

    wait_for(lambda: 'sftjob_operator_jobs{phase="Succeeded"} 1.0' in leader_metrics(), 90,
             what="the chart's operator to count the job Succeeded")
    log = op_log()
    assert log.lstrip().startswith("{"), "the upgrade's operator.logFormat=json did not reach the operator"
    # The only refusal is the one the namespace-scoped role means: kopf may not list
    # namespaces, retries, then uses the given names (see the chart README).
    refusals = [line for line in log.splitlines() if "Forbidden" in line or "permissions" in line]
    assert all('"namespaces"' in line or "namespaces" in line.split("permissions", 1)[-1] for line in refusals), \
        refusals[:5]
    # The chart's trainer default became the CRD's default, so the job's pods got it; and
    # they were admitted under `restricted` (non-root, no escalation, no capabilities).
    assert job["spec"]["resources"]["image"] == TRAINER_IMAGE
    pods = cluster.kube.get(f"/api/v1/namespaces/{jobs_ns}/pods?labelSelector=sftjob.io/job-name%3Dtiny-lora")
    assert pods["items"]
    for pod in pods["items"] + [op]:
        sc = pod["spec"]["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["spec"]["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {p["spec"]["containers"][0]["image"] for p in pods["items"]} == {TRAINER_IMAGE}

    # --- the upgraded CRD: its new optional field is accepted -------------------------
    wait_for(lambda: cluster.kubectl("-n", jobs_ns, "apply", "-f", "-", input=json.dumps(probe), check=False)
             .returncode == 0, 30, what="the upgraded CRD to accept the new field")
    assert cluster.kube.get(f"/apis/sftjob.io/v1alpha1/namespaces/{jobs_ns}/sftjobs/upgrade-probe")["spec"][
        "resources"]["upgradeProbe"] == "x"

    # --- uninstall: no operator resource left; CRD and jobs kept (crds.keep) ----------
    cluster.helm("uninstall", release, "-n", system_ns, "--wait", "--timeout", "120s")
    sel = f"labelSelector=app.kubernetes.io/instance%3D{release}"
    for path in (f"/apis/apps/v1/namespaces/{system_ns}/deployments",
                 f"/api/v1/namespaces/{system_ns}/serviceaccounts", f"/api/v1/namespaces/{system_ns}/services",
                 f"/api/v1/namespaces/{system_ns}/configmaps",
                 f"/apis/networking.k8s.io/v1/namespaces/{system_ns}/networkpolicies",
                 f"/apis/rbac.authorization.k8s.io/v1/namespaces/{jobs_ns}/roles",
                 f"/apis/rbac.authorization.k8s.io/v1/namespaces/{jobs_ns}/rolebindings",
                 f"/apis/rbac.authorization.k8s.io/v1/namespaces/{system_ns}/roles",
                 f"/apis/rbac.authorization.k8s.io/v1/namespaces/{system_ns}/rolebindings",
                 f"/apis/policy/v1/namespaces/{system_ns}/poddisruptionbudgets",
                 "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                 "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"):
        assert cluster.kube.get(f"{path}?{sel}")["items"] == [], path
    # The Deployment's ReplicaSets and pods are not in the release: helm deletes the Deployment
    # (background propagation) and waits for it alone, and the garbage collector removes its
    # dependents after, a while later on a loaded machine.
    for kind, path in (("ReplicaSets", f"/apis/apps/v1/namespaces/{system_ns}/replicasets?{sel}"),
                       ("pods", f"/api/v1/namespaces/{system_ns}/pods?{sel}")):
        wait_for(lambda path=path: not cluster.kube.get(path)["items"], 120,
                 what=f"the garbage collector to remove the operator's {kind}")
    secrets = cluster.kube.get(f"/api/v1/namespaces/{system_ns}/secrets?labelSelector=owner%3Dhelm")["items"]
    assert secrets == [], "helm's release record is left"
    crd_now = cluster.kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    assert crd_now["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert cluster.kube.get(f"/apis/sftjob.io/v1alpha1/namespaces/{jobs_ns}/sftjobs/tiny-lora")


@pytest.mark.timeout(300)
def test_every_rbac_verb_is_needed(cluster, namespace, shared_crd):
    """Acceptance 2: with the chart's cluster-wide ClusterRole and its leader-election Role
    (the release namespace is the test's) every probe in tests/chart/rbac_needs.py succeeds;
    taking away any single verb (and any single rule) makes exactly the probes of what was
    taken away fail with 403."""
    name = f"rbac-{uuid.uuid4().hex[:6]}"
    rendered = render_text({"fullnameOverride": name}, namespace=namespace,
                           extra=["--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml"])
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    roles = {f"{rbac}/clusterroles/{name}": next(d for d in docs if d["kind"] == "ClusterRole"),
             f"{rbac}/namespaces/{namespace}/roles/{name}-leader-election":
             next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == f"{name}-leader-election")}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    # The Lease the probes read and renew (rbac_needs: a PUT of a missing one would create it).
    cluster.kube.create(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": name}, "spec": {"holderIdentity": ""}})
    try:
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(example("probe", suspend=True)))
        job = cluster.kube.get(f"/apis/sftjob.io/v1alpha1/namespaces/{namespace}/sftjobs/probe")
        token = cluster.kubectl("-n", namespace, "create", "token", name, "--duration=10m").stdout.strip()
        server = cluster.cfg.apiserver_url
        ctx = ProbeContext(sa_kube(server, str(cluster.cfg.pki / "ca.crt"), token), namespace, job,
                           node=cluster.kube.get("/api/v1/nodes")["items"][0]["metadata"]["name"], lease=name)

        def refusals() -> set:
            return {key for key in NEEDS if asyncio.run(refused(ctx, key))}

        wait_for(lambda: not refusals(), 30, what="every probe to pass with the full roles")

        def without(rules, drop) -> list[dict]:
            out = []
            for i, rule in enumerate(rules):
                verbs = [v for v in rule["verbs"] if (i, v) not in drop and i not in drop]
                if verbs:
                    out.append({**rule, "verbs": verbs})
            return out

        def keys(rules, i: int, verbs: list[str]) -> set:
            r = rules[i]
            return {(r["apiGroups"][0], r["resources"][0], v) for v in verbs}

        report = []
        for path, role in roles.items():
            rules = role["rules"]
            variants = [({(i, v)}, keys(rules, i, [v])) for i, r in enumerate(rules) for v in r["verbs"]]
            variants += [({i}, keys(rules, i, r["verbs"])) for i, r in enumerate(rules)]
            for drop, expected in variants:
                current = cluster.kube.get(path)
                cluster.kube.put(path, {**current, "rules": without(rules, drop)})
                # RBAC changes reach the authorizer through an informer, the one before this
                # (a restored rule) too: wait until exactly the expected probes are refused.
                seen: list[set] = []
                try:
                    wait_for(lambda: seen.append(refusals()) or seen[-1] == expected, 20)  # noqa: B023 - polled in this iteration
                except AssertionError:
                    pass
                got = seen[-1] if seen else set()
                assert got == expected, f"without {drop}: refused {sorted(got)}, expected {sorted(expected)}"
                report.append(f"without {sorted(expected)}: refused -> {NEEDS[sorted(expected)[0]][0]}")
            current = cluster.kube.get(path)
            cluster.kube.put(path, {**current, "rules": rules})
            wait_for(lambda: not refusals(), 30, what="every probe to pass again")
        # The Lease rights are for the one Lease: another name is refused even to read.
        other = ProbeContext(ctx.kube, namespace, job, ctx.node, lease=f"{name}-other")
        assert asyncio.run(refused(other, ("coordination.k8s.io", "leases", "get")))
        assert asyncio.run(refused(other, ("coordination.k8s.io", "leases", "update")))
        # kube.node_leases: the nodes' heartbeats, through the Role in kube-node-lease only.
        def lease_refused() -> bool:
            try:
                ctx.kube.coordination.read_namespaced_lease(ctx.node, NODE_LEASE_NAMESPACE)
            except ApiException as err:
                if err.status == 403:
                    return True
                raise
            return False

        wait_for(lambda: not lease_refused(), 20, what="the node's Lease readable with the chart's roles")
        assert ctx.node in asyncio.run(ctx.kube.node_leases({ctx.node}))
        cluster.kube.delete(f"{rbac}/namespaces/{NODE_LEASE_NAMESPACE}/roles/{name}-node-heartbeats")
        wait_for(lease_refused, 20, what="the node's Lease refused without the node-heartbeats Role")
        print("\n".join(report))
    finally:
        for d in docs:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found")
            elif d["metadata"].get("namespace") == NODE_LEASE_NAMESPACE:
                cluster.kubectl("-n", NODE_LEASE_NAMESPACE, "delete", d["kind"].lower(), d["metadata"]["name"],
                                "--ignore-not-found")
