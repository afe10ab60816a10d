"""A very small Kubernetes REST client on the standard library.

The control-plane scripts use it instead of the `kubernetes` package so that `make cluster-up`
needs nothing beyond python3.
"""
from __future__ import annotations

import functools
import http.client
import json
import time
import ssl
import urllib.parse
from typing import Any
from collections.abc import Callable, Iterator


class ApiError(Exception):
    def __init__(self, status: int, body: str, method: str, path: str):
        self.status = status
        self.body = body
        try:
            self.reason = json.loads(body).get("reason", "")
            message = json.loads(body).get("message", body)
        except ValueError:
            self.reason, message = "", body
        super().__init__(f"{method} {path}: {status} {message}")


class Kube:
    def __init__(self, server: str, token: str, cafile: str | None):
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname, url.port or 443
        self.token = token
        self.ctx = ssl.create_default_context(cafile=cafile) if cafile else ssl._create_unverified_context()

    @classmethod
    def from_state(cls, cfg) -> Kube:
        secrets = json.loads(cfg.secrets_file.read_text())
        return cls(cfg.apiserver_url, secrets["admin_token"], str(cfg.pki / "ca.crt"))

    def _conn(self, timeout: float) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, params: dict | None = None,
                content_type: str = "application/json", timeout: float = 30, raw: bool = False) -> Any:
        """One API call: the decoded JSON answer (the text with raw, for logs); ApiError on 4xx/5xx."""
        if params:
            path += "?" + urllib.parse.urlencode(params)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "*/*" if raw else "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        conn = self._conn(timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")
        finally:
            conn.close()
        if resp.status >= 400:
            raise ApiError(resp.status, text, method, path)
        if raw:
            return text
        return json.loads(text) if text else None

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params=params or None)

    def text(self, path: str, **params) -> str:
        """GET a plain-text subresource (a pod's log)."""
        return self.request("GET", path, params=params or None, raw=True)

    def create(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_s: int = 300, **extra: str) -> Iterator[dict]:
        """Yield watch events until the server ends the watch (after about timeout_s). extra:
        more query parameters (fieldSelector, labelSelector)."""
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_s), **extra}
        for line in self.lines(path, timeout_s + 30, **params):
            if line.strip():
                yield json.loads(line)

    def lines(self, path: str, timeout_s: float, **params: str) -> Iterator[bytes]:
        """Yield the lines of a streamed GET (a watch, `log?follow=true`) until the server ends
        it or the connection breaks; ApiError when the server refuses."""
        conn = self._conn(timeout_s)
        try:
            conn.request("GET", path + "?" + urllib.parse.urlencode(params),
                         headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise ApiError(resp.status, resp.read().decode(errors="replace"), "GET", path)
            while True:
                try:
                    line = resp.readline()
                except (TimeoutError, OSError):
                    return
                if not line:
                    return
                yield line
        finally:
            conn.close()


# Pod Security Admission's strictest level: the namespaces the demo and chaos runs create
# prove that the trainer and operator pods need no privilege.
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


def ensure_namespace(kube: Kube, name: str, labels: dict[str, str] | None = None, timeout: float = 60.0) -> None:
    """Create namespace `name` with `labels` (or give an existing one those labels), then wait
    for its default ServiceAccount: the API server refuses pods until the controller made it.
    Raises TimeoutError when it does not appear within `timeout` seconds."""
    labels = RESTRICTED if labels is None else labels
    try:
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": {"name": name, "labels": labels}})
    except ApiError as e:
        if e.status != 409:
            raise
        kube.merge_patch(f"/api/v1/namespaces/{name}", {"metadata": {"labels": labels}})
    wait_for(lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), timeout,
             f"the default ServiceAccount of namespace {name}", interval=0.5)



def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """Call `pred` until it returns something truthy, and return that. An exception from `pred`
    counts as "not yet" (the API server, nodes and pods restart under tests and chaos runs).
    Raises TimeoutError naming `what`, and the last exception, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            if value := pred():
                return value
        except Exception as e:  # noqa: BLE001 - transient API errors while things restart
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({last})" if last else ""))
        time.sleep(interval)


def crd_established(kube: Kube, name: str) -> bool:
    """Whether CustomResourceDefinition `name` (e.g. "sftjobs.sftjob.io") has condition
    Established=True, i.e. its kind can be used."""
    crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in (crd.get("status") or {}).get("conditions") or [])


def wait_crds_established(kube: Kube, *names: str, timeout: float = 60.0) -> None:
    """Wait until each CRD in `names` is Established, all within `timeout` seconds; the
    TimeoutError names the first that is not. `kubectl wait --for=condition=Established` errors
    instead of waiting while a CRD created a moment ago has no conditions yet (kubectl 1.36:
    ".status.conditions accessor error: <nil>"), so every install path waits with this."""
    deadline = time.monotonic() + timeout
    for name in names:
        wait_for(functools.partial(crd_established, kube, name), deadline - time.monotonic(),
                 f"CRD {name} to be Established", interval=0.2)
