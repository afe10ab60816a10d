"""Loading the node images into a containerd: each image is streamed to `ctr images import`
as an OCI layout without the layers that containerd already holds (as blobs or as unpacked
snapshots), and skipped when it holds the image, unpacked, with the same config digest.

Once unpacked, an image's layer blobs are removed from the content store, as the CRI's
`discard_unpacked_layers` does for pulled images: a node runs containers from its snapshots
only, and keeping the blobs as well would hold the trainer's 5.5 GB twice on every node.
The image stays usable (`ctr images check` calls it incomplete, unpacked)."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from collections.abc import Iterable, Mapping

from .cache import build
from .spec import NODE_IMAGES, ImageRef, ImagesError
from .tools import human, log, need, run


def _ctr(address: str, namespace: str, *args: str) -> str:
    return run([need("ctr"), "--address", address, "-n", namespace, *args])


def _ready_images(address: str, namespace: str, snapshotter: str | None = None) -> dict[str, str]:
    """ref -> manifest digest of the images that are unpacked (for the default snapshotter, or
    `snapshotter`): what a container can start from, whether or not their layer blobs are
    still in the content store."""
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    out = {}
    # REF TYPE DIGEST STATUS SIZE UNPACKED; STATUS and SIZE hold spaces, UNPACKED is last
    for line in _ctr(address, namespace, "images", "check", *extra).splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 4 and fields[-1] == "true":
            out[fields[0]] = fields[2]
    return out


def _chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain ID of each layer: the name its unpacked snapshot has in containerd."""
    chain: list[str] = []
    for d in diff_ids:
        chain.append(d if not chain else "sha256:" + hashlib.sha256(f"{chain[-1]} {d}".encode()).hexdigest())
    return chain


def _archive_layers(archive: Path) -> tuple[bytes, list[tuple[str, tarfile.TarInfo]]]:
    """The config (bytes) and the layers (digest, tar member) of the docker-archive's image.
    c/image names a docker-archive's layers by their digest (uncompressed: the diff ID)."""
    with tarfile.open(archive) as src:
        # extractfile is None only for a non-file member; c/image writes both as regular files
        entry = json.load(src.extractfile("manifest.json"))[0]  # type: ignore[arg-type]  # see above
        config = src.extractfile(entry["Config"]).read()  # type: ignore[union-attr]  # see above
        return config, [("sha256:" + name.removesuffix(".tar"), src.getmember(name)) for name in entry["Layers"]]


def _held_layers(address: str, namespace: str, config: bytes, snapshotter: str | None) -> set[str]:
    """The digests of the image's layers that this containerd needs not be sent: those in its
    content store, and those whose snapshot (by chain ID) it has unpacked already."""
    have = set(_ctr(address, namespace, "content", "ls", "-q").split())
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    snapshots = {line.split()[0] for line in _ctr(address, namespace, "snapshots", *extra, "ls").splitlines()[1:]
                 if line.strip()}
    diff_ids = json.loads(config)["rootfs"]["diff_ids"]
    return have | {d for d, chain in zip(diff_ids, _chain_ids(diff_ids)) if chain in snapshots}


def discard_unpacked_layers(address: str, namespace: str, layers: Iterable[str]) -> int:
    """Remove these layer blobs from the content store (their snapshots stay); returns how
    many were there."""
    present = set(_ctr(address, namespace, "content", "ls", "-q").split())
    gone = [d for d in layers if d in present]
    if gone:
        _ctr(address, namespace, "content", "rm", *gone)
    return len(gone)


def _config_digest(address: str, namespace: str, manifest_digest: str) -> str | None:
    try:
        manifest = json.loads(_ctr(address, namespace, "content", "get", manifest_digest))
    except (ImagesError, ValueError):
        return None
    return manifest.get("config", {}).get("digest")


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _oci_layout(archive: Path, ref: str, have: set[str], out) -> int:
    """Write to the binary stream `out` an OCI image layout (tar) of the image in the
    docker-archive `archive`, named `ref` for containerd, leaving out the layer blobs whose
    digests are in `have` (the containerd holds them; its unpacker reuses them). The config is
    copied byte for byte, so the image ID stays. Returns the bytes of layers written."""
    config, layers = _archive_layers(archive)
    with tarfile.open(archive) as src:
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": "sha256:" + hashlib.sha256(config).hexdigest(), "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": m.size}
                       for d, m in layers],
        }, separators=(",", ":")).encode()
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
            "size": len(manifest),
            "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref}}]},
            separators=(",", ":")).encode()
        sent = 0
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst:
            def add(name: str, size: int, data) -> None:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = size, 0o644, 0
                dst.addfile(info, data)

            add("oci-layout", 30, io.BytesIO(b'{"imageLayoutVersion":"1.0.0"}'))
            add("index.json", len(index), io.BytesIO(index))
            for blob in (manifest, config):
                add(f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", len(blob), io.BytesIO(blob))
            for digest, member in layers:
                if digest in have:
                    continue
                add(f"blobs/sha256/{digest.removeprefix('sha256:')}", member.size, src.extractfile(member))
                sent += member.size
    return sent


def _staging_ref(ref: str) -> str:
    """A name of its own for an image while it is imported (see _import)."""
    tag = f"loading-{uuid.uuid4().hex[:8]}"
    return f"{ref}-{tag}" if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:{tag}"


def _import(address: str, namespace: str, img: ImageRef, snapshotter: str | None) -> int:
    """ctr images import of img, sending only the layers this containerd lacks (an edited
    source changes the trainer's last, small layer, not its GBs of requirements), then the
    removal of its layer blobs once unpacked. Returns the bytes of layers sent.

    The image is imported under a name of its own and only then tagged as img.ref: importing
    straight over an earlier build of the same ref leaves that build unreferenced while the
    new one unpacks, and containerd's garbage collector may then remove the snapshots of the
    layers they share (the ones not sent), failing the unpack ("parent snapshot ... does not
    exist", "content digest ... not found")."""
    config, layers = _archive_layers(img.archive)
    have = _held_layers(address, namespace, config, snapshotter)
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    cmd = [need("ctr"), "--address", address, "-n", namespace, "images", "import", *extra, "-"]
    staging = _staging_ref(img.ref)
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        assert proc.stdin is not None
        try:
            sent = _oci_layout(img.archive, staging, have, proc.stdin)
        except BrokenPipeError:  # ctr quit early; its stderr says why
            sent = -1
        finally:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            rc = proc.wait()
        err.seek(0)
        if rc != 0 or sent < 0:
            why = err.read().decode(errors="replace")[-4000:]
            if "no space left on device" in why:
                why += (f"\nthe disk of {address}'s containerd is full: unpacking {img.ref} needs about "
                        f"{human(img.size)} more")
            subprocess.run([need("ctr"), "--address", address, "-n", namespace, "images", "rm", staging],
                           capture_output=True)
            raise ImagesError(f"{' '.join(cmd)} < {img.archive} failed (exit {rc}): {why}")
    _ctr(address, namespace, "images", "tag", "--force", staging, img.ref)
    _ctr(address, namespace, "images", "rm", staging)
    if img.ref in _ready_images(address, namespace, snapshotter):
        discard_unpacked_layers(address, namespace, [d for d, _ in layers])
    return sent


def prune_other_images(address: str, namespace: str, keep: set[str]) -> list[str]:
    """Remove every image whose config digest is not in `keep` (image IDs), whatever its ref:
    earlier builds under the same ref, the kubelet's `sha256:<id>` records of them, tags a
    test gave them. Removal is synchronous (`--sync`), so their layers and snapshots are
    freed before anything is imported. Snapshots that a container still uses stay until it
    is removed. Returns the refs removed."""
    stale = []
    for line in _ctr(address, namespace, "images", "ls").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and _config_digest(address, namespace, fields[2]) not in keep:
            stale.append(fields[0])
    if stale:
        _ctr(address, namespace, "images", "rm", "--sync", *stale)
    return stale


def load(address: str, namespace: str = "k8s.io", names: Iterable[str] = NODE_IMAGES, *,
         refs: Mapping[str, str] | None = None, snapshotter: str | None = None,
         prune: bool = False) -> dict[str, str]:
    """Import the images (building what is missing or stale first) into the containerd that
    listens on `address`, in `namespace` (the CRI's is k8s.io), unpacked for its default
    snapshotter (or `snapshotter`). An image it already holds, unpacked, under the same ref
    with the same config digest is skipped. Returns name -> "imported" or "present".

    `prune`: the containerd holds nothing but these images (a local cluster's node), so
    every other image in `namespace` is an earlier build and is removed first: without
    that, each change of the trainer's requirements would leave another 5 GB behind on
    every node."""
    need("ctr")
    built = build(names, refs=refs)
    started = time.monotonic()
    if prune:
        removed = prune_other_images(address, namespace, {img.image_id for img in built.values()})
        if removed:
            log(f"removed {len(removed)} earlier image(s) from {address}: {', '.join(removed)}")
    ready = _ready_images(address, namespace, snapshotter)
    result = {}
    for name, img in built.items():
        digest = ready.get(img.ref)
        if digest and _config_digest(address, namespace, digest) == img.image_id:
            result[name] = "present"
            # a store filled before layers were discarded after unpacking sheds them now
            discard_unpacked_layers(address, namespace, [d for d, _ in _archive_layers(img.archive)[1]])
            continue
        t0 = time.monotonic()
        sent = _import(address, namespace, img, snapshotter)
        now = _ready_images(address, namespace, snapshotter)
        if img.ref not in now or _config_digest(address, namespace, now[img.ref]) != img.image_id:
            raise ImagesError(f"{address}: {img.ref} is not there, unpacked with ID {img.image_id}, "
                              f"after importing {img.archive}")
        log(f"{name}: imported {img.ref} into {address} ({namespace}) in {time.monotonic() - t0:.1f} s "
             f"({human(sent)} of layers sent, of {human(img.size)})")
        result[name] = "imported"
    present = [n for n, s in result.items() if s == "present"]
    if present:
        log(f"already in {address} ({namespace}): {', '.join(present)}")
    log(f"load into {address} took {time.monotonic() - started:.1f} s")
    return result
