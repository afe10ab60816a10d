"""Write the Argo CD health check's testdata: SFTJob objects as the operator writes them.

Each object is a job body driven through the operator's own pure planner
(`sftjob_operator.reconcile.plan`, with pods and clock as the operator's unit tests give
them) to one point of its life, so the statuses are the operator's, not hand-written.

    .venv/bin/python hack/tools/health/record.py            # rewrite testdata/*.yaml
    .venv/bin/python hack/tools/health/record.py --check    # exit 1 when a file is stale
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

import yaml

REPO = Path(__file__).resolve().parents[3]
TESTDATA = REPO / "integrations" / "argocd" / "resource_customizations" / "sftjob.io" / "SFTJob" / "testdata"
sys.path.insert(0, str(REPO))

from sftjob_operator import reconcile  # noqa: E402 - after the sys.path insert above

from tests.operator.op_testkit import apply, at, job_body, running_job, terminated  # noqa: E402 - after the sys.path insert

METRICS = {"step": 7, "totalSteps": 20, "loss": 1.23456, "tokensPerSecond": 999.44, "lastCheckpointStep": 5}


def new() -> dict[str, Any]:
    return job_body()


def pending() -> dict[str, Any]:
    body = job_body()
    return apply(body, reconcile.plan(body, [], at(0)))


def running() -> dict[str, Any]:
    body, pods = running_job()
    return apply(body, reconcile.plan(body, pods, at(10), metrics=METRICS))


def restarting() -> dict[str, Any]:
    body, pods = running_job()
    return apply(body, reconcile.plan(body, pods[:1], at(30)))   # rank 1's pod was deleted


def suspended() -> dict[str, Any]:
    body, pods = running_job()
    body["spec"]["suspend"] = True
    body["metadata"]["generation"] = 2
    return apply(body, reconcile.plan(body, pods, at(30)))


def succeeded() -> dict[str, Any]:
    body, pods = running_job()
    body = apply(body, reconcile.plan(body, pods, at(10), metrics=METRICS))
    return apply(body, reconcile.plan(body, [terminated(p, 0) for p in pods], at(31)))


def failed() -> dict[str, Any]:
    body, pods = running_job(**{"runPolicy.backoffLimit": 0})
    crashed = [terminated(pods[0], 1, "TrainingError: loss is nan"), pods[1]]
    return apply(body, reconcile.plan(body, crashed, at(30)))


def invalid_spec() -> dict[str, Any]:
    body = job_body({"data.trainBatchSize": 3})
    return apply(body, reconcile.plan(body, [], at(0)))


def edit_pending() -> dict[str, Any]:
    """A running job whose spec was just edited: the API server bumped metadata.generation
    and the operator has not reconciled the new spec yet."""
    body = running()
    body["spec"]["training"]["totalTrainingSteps"] = 40
    body["metadata"]["generation"] = 2
    return body


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "new": new, "pending": pending, "running": running, "restarting": restarting, "suspended": suspended,
    "succeeded": succeeded, "failed": failed, "invalid-spec": invalid_spec, "edit-pending": edit_pending,
}


def render(name: str) -> str:
    body = copy.deepcopy(SCENARIOS[name]())
    head = f"# Recorded by hack/tools/health/record.py ({name}): the operator's own planner wrote this status.\n"
    return head + yaml.safe_dump(body, sort_keys=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a testdata file differs")
    args = parser.parse_args()
    stale = []
    for name in SCENARIOS:
        path = TESTDATA / f"{name}.yaml"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            TESTDATA.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"stale: {path.relative_to(REPO)} (run hack/tools/health/record.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
