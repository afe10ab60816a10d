"""The base model on local disk: a local ``spec.model.path`` as is, an s3:// one downloaded
once per node into a cache (``SFTJOB_MODEL_CACHE``)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sftjob_contract import env as E

from .errors import InvalidConfig
from .s3store import EmptyPrefix, fetch_once, is_s3

MODEL_FIELD = "spec.model.path"


def local_model_path(path: str) -> str:
    """A local directory holding the model: ``path`` itself, or a per-node cache of an s3:// prefix.

    Storage failures raise ``StorageDenied`` or ``StorageUnavailable`` naming ``spec.model.path``."""
    if not is_s3(path):
        return path
    cache = Path(os.environ.get(E.MODEL_CACHE) or "/tmp/sftjob-models")
    try:
        return str(fetch_once(path, cache / hashlib.sha256(path.encode()).hexdigest()[:16], MODEL_FIELD))
    except EmptyPrefix:
        raise InvalidConfig(f"{MODEL_FIELD} {path}: no objects under this prefix; point it at the prefix that "
                            "holds the model's config.json, weights and tokenizer") from None
