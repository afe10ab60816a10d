"""Fixtures of the operator's tests on the local cluster (the cluster itself, `namespace` and
`s3_bucket` come from tests/fixtures/cluster.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .cluster_kit import CRD, REPO
from hack.localcluster.kube import wait_crds_established
from hack.localcluster.operator_proc import OperatorProcess


@pytest.fixture(scope="module")
def crd(cluster):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    wait_crds_established(cluster.kube, "sftjobs.sftjob.io")


@pytest.fixture(scope="module")
def operator(cluster, crd, tmp_path_factory):
    op = OperatorProcess(cluster.env, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()
    print(f"operator log: {op.log_path}")


@pytest.fixture
def example_ns(cluster, namespace):
    """`make example-assets NAMESPACE=<ns>` without make: assets in MinIO, Secret in ns."""
    run = subprocess.run([sys.executable, str(REPO / "examples" / "assets.py"), "--namespace", namespace],
                         capture_output=True, text=True, env={**os.environ, **cluster.env},
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return namespace




@pytest.fixture
def scoped_operator(cluster, crd, example_ns, tmp_path):
    """An operator that watches only this test's namespace, so tests beside it are not touched."""
    op = OperatorProcess(cluster.env, tmp_path / "operator.log", namespaces=[example_ns])
    op.start()
    yield op
    op.stop()
