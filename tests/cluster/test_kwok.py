"""kwok fake nodes for scale tests: a Job scheduled onto them completes without running anything."""
from __future__ import annotations

import pytest

from hack import localcluster
from tests.fixtures.cluster import wait_for

pytestmark = pytest.mark.cluster


def test_kwok_fake_nodes_complete_job_pods(cluster, namespace):
    names = localcluster.kwok_up(nodes=3, cfg=cluster.cfg)
    try:
        job = {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "fake-work"},
            "spec": {"completions": 6, "parallelism": 6, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"type": "kwok"},
                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "c", "image": "fake", "command": ["false"]}]}}},
        }
        cluster.kube.create(f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
        wait_for(lambda: cluster.kube.get(f"/apis/batch/v1/namespaces/{namespace}/jobs/fake-work")["status"]
                 .get("succeeded") == 6, 120, what="Job on fake nodes to complete")
        pods = cluster.kube.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
        assert {p["spec"]["nodeName"] for p in pods} <= set(names)
        # `false` would have failed on a real node: nothing ran
        assert all(p["status"]["phase"] == "Succeeded" for p in pods)
    finally:
        localcluster.kwok_down(cluster.cfg)
    assert not cluster.kube.get("/api/v1/nodes", labelSelector="type=kwok")["items"]
