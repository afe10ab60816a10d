"""Download two jobs' exported models from S3 and compare their weights byte for byte."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from .monitor import split_uri


def download(s3, uri: str, dest: Path) -> list[Path]:
    """Every object under `uri` (status.output.uri, the hf/final directory) into dest."""
    bucket, prefix = split_uri(uri)
    files = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            rel = o["Key"][len(prefix) + 1:]
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, o["Key"], str(path))
            files.append(path)
    return files


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Comparison:
    files: dict[str, tuple[str, str]] = field(default_factory=dict)   # safetensors file -> (sha a, sha b)
    tensors: int = 0
    identical: int = 0
    differing: list[str] = field(default_factory=list)
    only_in_one: list[str] = field(default_factory=list)
    bytes_compared: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.tensors) and self.identical == self.tensors and not self.only_in_one

    def lines(self) -> list[str]:
        out = []
        for name, (a, b) in sorted(self.files.items()):
            out.append(f"{name}: sha256 {a[:16]} vs {b[:16]} ({'same file' if a == b else 'files differ'})")
        out.append(f"tensors: {self.identical}/{self.tensors} bitwise identical "
                   f"({self.bytes_compared / 1e6:.2f} MB compared byte for byte)")
        if self.differing:
            out.append("differing: " + ", ".join(self.differing[:10]))
        if self.only_in_one:
            out.append("only in one model: " + ", ".join(self.only_in_one[:10]))
        return out


def compare_dirs(a: Path, b: Path) -> Comparison:
    """Every tensor of every *.safetensors file: same names, dtypes, shapes and raw bytes."""
    import torch
    from safetensors import safe_open

    def raw(t) -> bytes:
        return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    cmp = Comparison()
    names_a = {p.relative_to(a).as_posix() for p in a.rglob("*.safetensors")}
    names_b = {p.relative_to(b).as_posix() for p in b.rglob("*.safetensors")}
    cmp.only_in_one += sorted(names_a ^ names_b)
    for name in sorted(names_a & names_b):
        cmp.files[name] = (sha256(a / name), sha256(b / name))
        with safe_open(str(a / name), framework="pt") as fa, safe_open(str(b / name), framework="pt") as fb:
            keys_a, keys_b = set(fa.keys()), set(fb.keys())
            cmp.only_in_one += [f"{name}:{k}" for k in sorted(keys_a ^ keys_b)]
            for k in sorted(keys_a & keys_b):
                ta, tb = fa.get_tensor(k), fb.get_tensor(k)
                cmp.tensors += 1
                same = ta.dtype == tb.dtype and tuple(ta.shape) == tuple(tb.shape)
                if same:
                    ba, bb = raw(ta), raw(tb)
                    same = ba == bb
                    cmp.bytes_compared += len(ba)
                if same:
                    cmp.identical += 1
                else:
                    cmp.differing.append(k)
    if not names_a:
        cmp.only_in_one.append(f"no *.safetensors under {a}")
    return cmp
