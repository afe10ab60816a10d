"""python -m hack.localcluster.images {build [NAME ...] [--rebuild],load --address SOCK,list}"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from .cache import build, status
from .containerd import load
from .spec import NAMES, NODE_IMAGES, ImagesError, image_refs
from .tools import human, log


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.localcluster.images",
                                 description="Build the project's images here without docker, cache them, "
                                             "load them into a containerd.")
    ap.add_argument("--operator-image", help="operator ref (default ghcr.io/sftjob/operator:<appVersion>)")
    ap.add_argument("--trainer-image", help="trainer ref (default ghcr.io/sftjob/trainer:<appVersion>)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", help="build what is missing or stale (default: all four)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(NAMES)}")
    p.add_argument("--rebuild", action="store_true", help="build the named images even when cached")
    p.add_argument("--quiet", action="store_true", help="do not echo the tools' output")
    p = sub.add_parser("load", help="import the node images into a containerd (k8s.io namespace)")
    p.add_argument("--address", required=True, help="containerd's socket")
    p.add_argument("--namespace", default="k8s.io")
    p.add_argument("--snapshotter", help="unpack for this snapshotter (default: containerd's default)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(NODE_IMAGES)} (default: all)")
    sub.add_parser("list", help="the images, their input keys and whether they are built")
    a = ap.parse_args(argv)
    refs = image_refs(operator=a.operator_image, trainer=a.trainer_image)
    try:
        if a.cmd == "build":
            started = time.monotonic()
            for img in build(a.names or NAMES, refs=refs, rebuild=a.rebuild, verbose=not a.quiet).values():
                print(f"{img.ref}\t{img.image_id}\t{img.archive}")
            log(f"done in {time.monotonic() - started:.1f} s")
        elif a.cmd == "load":
            states = load(a.address, a.namespace, a.names or NODE_IMAGES, refs=refs, snapshotter=a.snapshotter)
            for name, state in states.items():
                print(f"{refs[name]}\t{state}")
        else:
            for row in status(refs):
                size = human(row["size"]) if "size" in row else "-"
                print(f"{row['name']:<9} {row['state']:<15} {size:>9}  {row['key']:<16}  {row['ref']}")
    except ImagesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
