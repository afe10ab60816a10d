"""The local cluster is a real API server: schema + CEL validation, garbage collection, RBAC with
ServiceAccount tokens, and the kubectl / helm clients all behave as in production."""
from __future__ import annotations

import json
import re
import ssl
import textwrap
import urllib.error
import urllib.request
import uuid

import pytest
import yaml

from hack import localcluster
from hack.localcluster.kube import wait_crds_established
from tests.fixtures.cluster import wait_for

pytestmark = pytest.mark.cluster

# imported into every node by `up` (make images); pods never pull
TRAINER_IMAGE = localcluster.images.image_refs()["trainer"]


def crd_yaml(group: str) -> str:
    return textwrap.dedent(f"""\
        apiVersion: apiextensions.k8s.io/v1
        kind: CustomResourceDefinition
        metadata:
          name: widgets.{group}
        spec:
          group: {group}
          scope: Namespaced
          names: {{plural: widgets, singular: widget, kind: Widget}}
          versions:
          - name: v1
            served: true
            storage: true
            schema:
              openAPIV3Schema:
                type: object
                properties:
                  spec:
                    type: object
                    required: [minReplicas, maxReplicas]
                    properties:
                      minReplicas: {{type: integer, minimum: 0}}
                      maxReplicas: {{type: integer}}
                    x-kubernetes-validations:
                    - rule: "self.minReplicas <= self.maxReplicas"
                      message: "minReplicas must not exceed maxReplicas"
        """)


def widget(name: str, lo: int, hi: int, group: str) -> str:
    return (f"apiVersion: {group}/v1\nkind: Widget\nmetadata: {{name: {name}}}\n"
            f"spec: {{minReplicas: {lo}, maxReplicas: {hi}}}\n")


@pytest.fixture
def crd_group(cluster):
    group = f"t{uuid.uuid4().hex[:8]}.sftjob.test"
    cluster.kubectl("apply", "-f", "-", input=crd_yaml(group))
    wait_crds_established(cluster.kube, f"widgets.{group}")
    yield group
    cluster.kubectl("delete", f"crd/widgets.{group}", "--wait=false", check=False)


def test_a_crd_is_waited_for_from_the_moment_it_is_created(cluster, namespace):
    """A CRD as the API server returns it on creation has no conditions yet (kubectl 1.36's
    `wait --for=condition=Established` errors on that instead of waiting: the chaos run's flake);
    the helper every install path uses waits through it, then the kind can be used at once, and
    a timeout names the first CRD that is not Established."""
    group = f"t{uuid.uuid4().hex[:8]}.sftjob.test"
    created = cluster.kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                  yaml.safe_load(crd_yaml(group)))
    try:
        assert not any(c.get("type") == "Established" for c in (created.get("status") or {}).get("conditions") or [])
        wait_crds_established(cluster.kube, f"widgets.{group}", timeout=60)
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("at-once", 1, 2, group))
        with pytest.raises(TimeoutError, match=re.escape(f"waiting for CRD widgets.{group}2 to be Established")):
            wait_crds_established(cluster.kube, f"widgets.{group}", f"widgets.{group}2", f"gadgets.{group}",
                                  timeout=1)
    finally:
        cluster.kubectl("delete", f"crd/widgets.{group}", "--wait=false", check=False)


def test_crd_schema_and_cel_rule_reject_bad_objects(cluster, namespace, crd_group):
    bad = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("bad", 5, 2, crd_group), check=False)
    assert bad.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in bad.stderr

    # the structural schema itself (type and minimum) is enforced too
    neg = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("neg", -1, 2, crd_group), check=False)
    assert neg.returncode != 0 and "should be greater than or equal to 0" in neg.stderr

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("good", 1, 3, crd_group))
    got = json.loads(cluster.kubectl("get", "-n", namespace, f"widgets.{crd_group}", "good", "-o", "json").stdout)
    assert got["spec"] == {"minReplicas": 1, "maxReplicas": 3}


def test_owned_child_is_garbage_collected(cluster, namespace, crd_group):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget("owner", 1, 2, crd_group))
    owner = json.loads(cluster.kubectl("get", "-n", namespace, f"widgets.{crd_group}", "owner", "-o", "json").stdout)
    child = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "child", "ownerReferences": [{
            "apiVersion": f"{crd_group}/v1", "kind": "Widget", "name": "owner",
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]},
        "data": {"k": "v"},
    }
    orphan = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "unowned"}}
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/configmaps", child)
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/configmaps", orphan)
    cluster.kubectl("delete", "-n", namespace, f"widgets.{crd_group}", "owner")
    # the garbage collector learns about new CRDs from discovery every 30 s
    cluster.wait_gone(f"/api/v1/namespaces/{namespace}/configmaps/child", timeout=90)
    assert cluster.kube.get(f"/api/v1/namespaces/{namespace}/configmaps/unowned")


def test_serviceaccount_token_needs_rbac(cluster, namespace):
    cluster.kubectl("create", "serviceaccount", "robot", "-n", namespace)
    token = cluster.kubectl("create", "token", "robot", "-n", namespace, "--duration=10m").stdout.strip()
    ctx = ssl.create_default_context(cafile=str(cluster.cfg.pki / "ca.crt"))
    url = f"{cluster.cfg.apiserver_url}/api/v1/namespaces/{namespace}/configmaps"

    def get() -> int:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            assert e.code != 401, "the ServiceAccount token must authenticate"
            if e.code == 403:
                assert f"system:serviceaccount:{namespace}:robot" in e.read().decode()
            return e.code

    assert get() == 403
    cluster.kubectl("create", "role", "cm-reader", "-n", namespace, "--verb=get,list", "--resource=configmaps")
    cluster.kubectl("create", "rolebinding", "robot-reads", "-n", namespace, "--role=cm-reader",
                    f"--serviceaccount={namespace}:robot")
    wait_for(lambda: get() == 200, 30, what="RoleBinding to take effect")
    # still scoped: another verb stays forbidden
    assert "no" in cluster.kubectl("auth", "can-i", "delete", "configmaps", "-n", namespace,
                                   f"--as=system:serviceaccount:{namespace}:robot", check=False).stdout


def test_kubectl_apply_get_wait(cluster, namespace):
    manifest = textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: settings}
        data: {greeting: hello}
        ---
        apiVersion: v1
        kind: Pod
        metadata: {name: waiter, labels: {app: waiter}}
        spec:
          restartPolicy: Never
          containers:
          - name: main
            image: TRAINER_IMAGE
            imagePullPolicy: Never
            command: [python, -c, "import time; time.sleep(300)"]
        """).replace("TRAINER_IMAGE", TRAINER_IMAGE)
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest).stdout
    assert "configmap/settings created" in out and "pod/waiter created" in out
    again = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest).stdout
    assert "unchanged" in again
    cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/waiter", "--timeout=90s")
    got = cluster.kubectl("get", "-n", namespace, "pod", "waiter", "-o",
                          "jsonpath={.status.phase} {.spec.nodeName}").stdout
    phase, node = got.split()
    assert phase == "Running" and node in cluster.cfg.nodes
    assert "hello" in cluster.kubectl("get", "-n", namespace, "cm", "settings", "-o",
                                      "jsonpath={.data.greeting}").stdout
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    from hack.localcluster.config import VERSIONS

    assert version["serverVersion"]["gitVersion"] == VERSIONS["K8S_VERSION"]
    assert version["clientVersion"]["gitVersion"] == VERSIONS["K8S_VERSION"]
    cluster.kubectl("delete", "-n", namespace, "pod", "waiter", "--grace-period=1")


def test_helm_install_small_chart(cluster, namespace, tmp_path):
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n")
    (chart / "values.yaml").write_text("message: hi\nreplicas: 1\n")
    (chart / "templates" / "all.yaml").write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: {{ .Release.Name }}-config}
        data:
          message: {{ .Values.message | quote }}
          kube: {{ .Capabilities.KubeVersion.Version | quote }}
        ---
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: {{ .Release.Name }}-app}
        spec:
          replicas: {{ .Values.replicas }}
          selector: {matchLabels: {app: {{ .Release.Name }}}}
          template:
            metadata: {labels: {app: {{ .Release.Name }}}}
            spec:
              terminationGracePeriodSeconds: 2
              containers:
              - name: app
                image: {TRAINER_IMAGE}
                command: [python, -c, "import time; time.sleep(3600)"]
        """).replace("{TRAINER_IMAGE}", TRAINER_IMAGE))
    cluster.helm("install", "rel", str(chart), "-n", namespace, "--set", "message=from-helm",
                 "--wait", "--timeout", "120s")
    releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("rel", "deployed")]
    cm = cluster.kube.get(f"/api/v1/namespaces/{namespace}/configmaps/rel-config")
    assert cm["data"]["message"] == "from-helm"
    from hack.localcluster.config import VERSIONS

    assert cm["data"]["kube"] == VERSIONS["K8S_VERSION"]
    dep = cluster.kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/rel-app")
    assert dep["status"].get("readyReplicas") == 1
    cluster.helm("uninstall", "rel", "-n", namespace, "--wait", "--timeout", "60s")
    cluster.wait_gone(f"/api/v1/namespaces/{namespace}/configmaps/rel-config")


def test_a_pod_delete_reaches_only_the_pod_it_was_decided_for(cluster, namespace):
    """Pod names repeat across a job's attempts: a delete decided on an older listing must
    not remove the next attempt's pod of the same name (the operator's deletes carry the uid)."""
    import asyncio

    from sftjob_operator.kube import Kube

    path = f"/api/v1/namespaces/{namespace}/pods"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "same-name"},
           "spec": {"nodeSelector": {"no-such-node": "x"}, "containers": [{"name": "c", "image": "none"}]}}
    old_uid = cluster.kube.create(path, pod)["metadata"]["uid"]
    cluster.kubectl("-n", namespace, "delete", "pod", "same-name", "--wait=true")
    new_uid = cluster.kube.create(path, pod)["metadata"]["uid"]
    kube = Kube(cluster.api_client())
    asyncio.run(kube.delete_pod(namespace, "same-name", uid=old_uid))    # refused: another pod now
    assert cluster.kube.get(f"{path}/same-name")["metadata"]["uid"] == new_uid
    asyncio.run(kube.delete_pod(namespace, "same-name", uid=new_uid))
    wait_for(lambda: not cluster.kubectl("-n", namespace, "get", "pod", "same-name", "--ignore-not-found",
                                         "-o", "name").stdout.strip(), 30, what="the pod of that uid to go")
