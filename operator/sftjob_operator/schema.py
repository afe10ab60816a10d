"""What every SFTJob API model shares: the wire conventions and the CEL and pattern vocabulary.

The spec (api.py) and the status (status.py) are both generated into the CRD (crd.py);
both are camelCase on the wire and reject unknown keys, so a misspelled field fails loudly
instead of being stored or ignored.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# A URI the trainer can read or write: s3://BUCKET[/key] (a valid bucket name) or an absolute
# path in the pod.
S3_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
URI_RULE = f"self.startsWith('s3://') ? self.matches('{S3_URI}') : self.startsWith('/')"
URI_MESSAGE = "must be s3://BUCKET[/prefix] with a valid bucket name, or an absolute path"
# RFC 1123 subdomain, label by label as the API server validates object names: `a..b` and
# `a.-b` are refused here rather than at every pod create.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Label keys (also taint and toleration keys) and label values, as core/v1 validates them.
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# An environment variable name the kubelet accepts (no '=', no leading digit).
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Names that carry credentials: these must come from a Secret (valueFrom.secretKeyRef).
CREDENTIAL_NAME = r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?|SESSION_TOKEN)(_|$)"
IMMUTABLE = "self == oldSelf"


class SpecModel(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown keys rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, Any]:
    """One CEL rule (`x-kubernetes-validations` entry), evaluated by the API server."""
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def rules(*rules: dict[str, Any]) -> dict[str, Any]:
    """Schema keywords attaching CEL rules to a model or field."""
    return {"x-kubernetes-validations": list(rules)}
