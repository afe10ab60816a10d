"""The Argo CD health check, kstatus and the Flux expressions on live SFTJobs: jobs driven
through their life on the local cluster, each observed state run through the harness
(hack/tools/health) and checked against the table in integrations/argocd/README.md."""
from __future__ import annotations

import time

import pytest

from .cluster_kit import apply, diagnose, example, get_job
from .health_kit import evaluate, summary
from .test_gitops_health import documented_mapping

pytestmark = [pytest.mark.cluster, pytest.mark.built]

JOBS = {
    # Four steps of the example: about a minute on this machine.
    "health-ok": {"training.totalTrainingSteps": 4, "training.testFreq": 4, "checkpoint.interval": 2},
    "health-suspended": {"suspend": True},
    # The API server refuses its pods: Failed (PodRejected) without training.
    "health-failed": {"resources.serviceAccountName": "no-such-sa"},
}
SETTLED = {"health-ok": "Succeeded", "health-suspended": "Suspended", "health-failed": "Failed"}


def expected(job: dict) -> tuple[str, str, str]:
    table = documented_mapping()
    st = job.get("status") or {}
    if not st.get("phase"):
        return table["new"]
    if st.get("observedGeneration") is not None and st["observedGeneration"] < job["metadata"]["generation"]:
        return table["edit-pending"]
    return table[st["phase"].lower()]


@pytest.mark.timeout(1200)
def test_live_jobs_map_as_documented_through_their_life(cluster, scoped_operator, example_ns):
    ns, op = example_ns, scoped_operator
    for name, overrides in JOBS.items():
        apply(cluster, ns, example(name, **overrides))
    seen: dict[str, list[tuple[str | None, tuple[str, str, str], dict]]] = {name: [] for name in JOBS}
    deadline = time.monotonic() + 900
    while True:
        for name in JOBS:
            job = get_job(cluster, ns, name)
            result = evaluate(job)
            phase = (job.get("status") or {}).get("phase")
            got, want = summary(result), expected(job)
            assert got == want, f"{name} in phase {phase}: got {got}, documented {want}\n{result}\n{job.get('status')}"
            seen[name].append((phase, got, result))
        if all(s[-1][0] == SETTLED[name] for name, s in seen.items()):
            break
        assert time.monotonic() < deadline, "jobs did not settle:\n" + "\n".join(
            diagnose(cluster, ns, name, op) for name in JOBS if seen[name][-1][0] != SETTLED[name])
        time.sleep(0.5)

    ok = seen["health-ok"]
    phases = [phase for phase, _, _ in ok]
    assert "Running" in phases and phases[-1] == "Succeeded", phases
    for tool, column in (("kstatus", 1), ("Flux", 2)):   # InProgress while starting, then Current
        states = [got[column] for _, got, _ in ok]
        assert "Current" in states and "InProgress" in states[:states.index("Current")], (tool, states)
        assert states[-1] == "Current", (tool, states)
    argo = [got[0] for _, got, _ in ok]
    assert argo[-1] == "Healthy" and set(argo[:-1]) == {"Progressing"}, argo
    assert seen["health-suspended"][-1][1] == ("Suspended", "InProgress", "Current")
    phase, got, result = seen["health-failed"][-1]
    assert got == ("Degraded", "Failed", "Failed")
    assert result["argo"]["message"].startswith("PodRejected: ") and "spec.resources.serviceAccountName" in \
        result["argo"]["message"], result["argo"]
