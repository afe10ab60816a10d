"""MLflow: one run per job across all its attempts, over MLflow's documented REST API.

Why a small client of our own rather than the `mlflow`/`mlflow-skinny` package: the trainer
uses eight endpoints (experiments get-by-name/create, runs search/create/get/log-batch/
set-tag/update), a hundred lines over urllib. mlflow-skinny would add tens of megabytes and
a dozen dependencies to the trainer image (databricks-sdk, opentelemetry, gitpython, ...) and
pins of its own against torch's and transformers' dependencies, for calls whose wire format
MLflow has kept stable since 1.0 (`/api/2.0/mlflow/...`). The maintenance cost is the
format; the test runs against a real tracking server from the `mlflow` package, so a change
there shows up as a failing test, not in production.

The run is found again by the tag ``sftjob.identity`` (``RunInfo.identity``); parameters are
logged once (only those the run lacks, so a resume adds nothing); the run's latest metrics
say the last step each holds (MLflow keeps, per metric, the value of the highest step).
Credentials come only from the environment the operator fills from the Secret:
MLFLOW_TRACKING_TOKEN (a bearer token) or MLFLOW_TRACKING_USERNAME/PASSWORD (basic auth).
"""
from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sftjob_contract import tracking as T
from sftjob_contract.tracking import MlflowConfig

from .track_base import OUTPUT_URI, RunInfo

IDENTITY_TAG = "sftjob.identity"
OUTPUT_DIR_TAG = "sftjob.output_dir"
TIMEOUT_S = 5.0            # per request: what one try may cost training while the server hangs
MAX_PARAMS = 100            # per log-batch request (MLflow's limit)
MAX_PARAM_VALUE = 6000      # characters (MLflow's limit)


class MlflowError(RuntimeError):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.code = code


class MlflowRest:
    """JSON over HTTP to ``<tracking_uri>/api/2.0/mlflow/``."""

    def __init__(self, base: str, timeout: float = TIMEOUT_S):
        self.base = base.rstrip("/") + "/api/2.0/mlflow/"
        self.timeout = timeout

    def _auth(self) -> dict[str, str]:
        token = os.environ.get(T.MLFLOW_TRACKING_TOKEN)
        if token:
            return {"Authorization": f"Bearer {token}"}
        user, password = os.environ.get(T.MLFLOW_TRACKING_USERNAME), os.environ.get(T.MLFLOW_TRACKING_PASSWORD)
        if user and password:
            return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
        return {}

    def call(self, endpoint: str, body: dict[str, Any] | None = None, query: dict[str, str] | None = None) -> dict:
        """POST ``body`` (GET when None) to ``endpoint``; MlflowError names MLflow's error code.
        The message never carries the request's headers, so no credential reaches a log."""
        url = self.base + endpoint + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **self._auth()})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode() or "{}"
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            try:
                parsed = json.loads(detail)
            except ValueError:
                parsed = {"message": detail[:200]}
            raise MlflowError(err.code, parsed.get("error_code", ""), parsed.get("message", "")) from None
        return json.loads(text)


class Mlflow:
    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, rest: MlflowRest | None = None):
        self.cfg = cfg
        self.rest = rest or MlflowRest(cfg.tracking_uri)
        self.run_id: str | None = None

    def start(self, run: RunInfo, params: dict[str, str]) -> dict[str, int]:
        experiment_id = self._experiment(self.cfg.experiment or "sftjob")
        found = self.rest.call("runs/search", {
            "experiment_ids": [experiment_id], "max_results": 1,
            "filter": f"tags.`{IDENTITY_TAG}` = '{run.identity}'"}).get("runs", [])
        if found:
            self.run_id = found[0]["info"]["run_id"]
        else:
            self.run_id = self.rest.call("runs/create", {
                "experiment_id": experiment_id, "start_time": _now_ms(), "run_name": self.cfg.run_name or run.name,
                "tags": [{"key": IDENTITY_TAG, "value": run.identity},
                         {"key": OUTPUT_DIR_TAG, "value": run.output_dir}]})["run"]["info"]["run_id"]
        data = self.rest.call("runs/get", query={"run_id": self.run_id})["run"].get("data", {})
        have = {p["key"] for p in data.get("params", [])}
        missing = [{"key": k, "value": v[:MAX_PARAM_VALUE]} for k, v in params.items() if k not in have]
        for i in range(0, len(missing), MAX_PARAMS):
            self.rest.call("runs/log-batch", {"run_id": self.run_id, "params": missing[i:i + MAX_PARAMS]})
        self.rest.call("runs/update", {"run_id": self.run_id, "status": "RUNNING"})
        return {m["key"]: int(m.get("step", 0)) for m in data.get("metrics", [])}

    def _experiment(self, name: str) -> str:
        for _ in range(2):   # a concurrent create wins once; then the name exists
            try:
                return self.rest.call("experiments/get-by-name", query={"experiment_name": name})["experiment"][
                    "experiment_id"]
            except MlflowError as err:
                if err.code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            try:
                return self.rest.call("experiments/create", {"name": name})["experiment_id"]
            except MlflowError as err:
                if err.code != "RESOURCE_ALREADY_EXISTS":
                    raise
        raise MlflowError(409, "RESOURCE_ALREADY_EXISTS", f"experiment {name!r} neither found nor created")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = _now_ms()
        self.rest.call("runs/log-batch", {"run_id": self.run_id, "metrics": [
            {"key": k, "value": v, "timestamp": now, "step": step} for k, v in metrics.items()]})

    def commit(self) -> None:
        """Every log is already on the server."""

    def finish(self, status: str, output_uri: str | None) -> None:
        if self.run_id is None:
            return
        if output_uri:
            self.rest.call("runs/set-tag", {"run_id": self.run_id, "key": OUTPUT_URI, "value": output_uri})
        self.rest.call("runs/update", {"run_id": self.run_id, "status": status, "end_time": _now_ms()})


def _now_ms() -> int:
    return int(time.time() * 1000)
