"""The base model on local disk: a local ``spec.model.path`` as is, an s3:// one downloaded
once per node into a cache (``SFTJOB_MODEL_CACHE``), and only the files its ranks read.

Only global rank 0 reads the weights (model.build_model; the LoRA merge of the export runs
there too); every other rank reads the config and the tokenizer. So the node of rank 0
downloads the whole model and every other node only those small files: for a 70B model,
140 GB (bf16) less per node. The two kinds of copy have their own completion markers, and
``with_weights`` completes a partial one (a model that cannot be built without its
weights, model.load_model).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sftjob_contract import env as E

from .errors import InvalidConfig
from .s3store import COMPLETE, EmptyPrefix, fetch_once, is_s3

MODEL_FIELD = "spec.model.path"
WITHOUT_WEIGHTS = ".sftjob-complete-without-weights"
# What from_pretrained reads the parameters from (the *.index.json maps of sharded
# checkpoints are small and kept; so is a tokenizer.model).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def local_model_path(path: str, weights: bool = True) -> str:
    """A local directory holding the model: ``path`` itself, or a per-node cache of an s3:// prefix.

    ``weights=False``: the cache may lack the weight files (this process never reads them).
    Storage failures raise ``StorageDenied`` or ``StorageUnavailable`` naming ``spec.model.path``;
    a filesystem path (absolute, or starting with ``.``) that is not a directory here raises
    ``InvalidConfig`` (transformers would call it a malformed hub repo id). ``~`` is not
    expanded: transformers does not expand it either."""
    if not is_s3(path):
        if path.startswith(("/", ".")) and not Path(path).is_dir():
            raise InvalidConfig(f"{MODEL_FIELD} {path}: no such directory in this pod; a local model must be on "
                                "a volume the pod mounts at that path, or give an s3:// URI")
        return path
    cache = Path(os.environ.get(E.MODEL_CACHE) or "/tmp/sftjob-models")
    return _fetch(path, cache / hashlib.sha256(path.encode()).hexdigest()[:16], weights)


def with_weights(local_dir: str) -> str:
    """``local_dir`` with every file of the model: a cache made with ``weights=False`` is
    completed (only the files it lacks are downloaded); anything else is returned as it is."""
    partial = Path(local_dir) / WITHOUT_WEIGHTS
    if not partial.exists() or (Path(local_dir) / COMPLETE).exists():
        return local_dir
    return _fetch(partial.read_text().strip(), Path(local_dir), weights=True)


def _fetch(uri: str, dest: Path, weights: bool) -> str:
    try:
        if weights:
            return str(fetch_once(uri, dest, MODEL_FIELD))
        return str(fetch_once(uri, dest, MODEL_FIELD, select=lambda name: not is_weight_file(name),
                              marker=WITHOUT_WEIGHTS))
    except EmptyPrefix:
        raise InvalidConfig(f"{MODEL_FIELD} {uri}: no objects under this prefix; point it at the prefix that "
                            "holds the model's config.json, weights and tokenizer") from None
