"""Runs as the first process of a pod container: enters the pod's network namespace, gives the
container its own mount and UTS namespaces, bind-mounts the volumes at their mountPaths, then
exec()s the container command, so the agent's child *is* the container process and signals
(SIGTERM on deletion) reach it directly.

Usage: python3 podshim.py SPEC.json   (written by the node agent). Standard library only, and kept
to one small file because it starts once per container.
"""
import ctypes
import json
import os
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)


def check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src, dst, fstype, flags):
    check(libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None,
                     ctypes.c_ulong(flags), None), f"mount {src} {dst}")


def ensure_target(src, dst, created):
    """A bind mount needs an existing target of the same kind. Missing ones are created on the
    host file system (there is no image root file system); the agent records them so that
    `cluster-down` removes them again."""
    if os.path.lexists(dst):
        return
    parent = os.path.dirname(dst)
    missing = []
    while parent and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)
    if os.path.isdir(src):
        os.mkdir(dst)
    else:
        open(dst, "a").close()
    created.append(dst)


STASH = "/run/sftjob-podshim"


def stash(paths):
    """Bind each path under a tmpfs private to this pod's mount namespace; path -> stash."""
    if not paths:
        return {}
    os.makedirs(STASH, exist_ok=True)
    mount("tmpfs", STASH, "tmpfs", 0)
    moved = {}
    for i, path in enumerate(paths):
        d = f"{STASH}/{i}"
        os.mkdir(d)
        mount(path, d, None, MS_BIND | MS_REC)
        moved[path] = d
    return moved


def via(moved, path):
    """`path` reached through the stash, when it lies in a stashed tree."""
    for root, d in moved.items():
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return d + path[len(root.rstrip("/")):]
    return path


def main():
    spec = json.load(open(sys.argv[1]))
    try:
        fd = os.open(spec["netns"], os.O_RDONLY)
        check(libc.setns(fd, CLONE_NEWNET), "setns")
        os.close(fd)
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
        # Nothing mounted from here on may leak back into the host.
        mount("none", "/", None, MS_REC | MS_PRIVATE)
        try:  # /sys/class/net of the pod's own network namespace, as in a container
            mount("sysfs", "/sys", "sysfs", 0)
        except OSError:
            pass
        socket.sethostname(spec["hostname"])
        created = []
        # The checkout (and the cluster's state, where volume sources live) is bound to a
        # private stash first and everything is mounted from there: a volume mounted over one
        # of its parents (an emptyDir at /tmp, for a clone under /tmp) would otherwise hide
        # the sources of later mounts and the .venv the container runs from.
        moved = stash(spec.get("keep", []))
        try:
            for m in sorted(spec["mounts"], key=lambda m: m["dst"].rstrip("/").count("/")):
                src = via(moved, m["src"])
                ensure_target(src, m["dst"], created)
                mount(src, m["dst"], None, MS_BIND | MS_REC)
                if m.get("ro"):
                    mount("none", m["dst"], None, MS_BIND | MS_REMOUNT | MS_RDONLY)
            for path, kept in moved.items():  # put back what a volume now hides
                if os.path.exists(path) and os.path.samestat(os.stat(kept), os.stat(path)):
                    continue
                # Its mount point is made inside the volume that hid it (and goes with it), so it
                # is not recorded for `cluster-down`, which must never touch the checkout.
                ensure_target(kept, path, [])
                mount(kept, path, None, MS_BIND | MS_REC)
        finally:
            if created:
                with open(spec["created_log"], "a") as f:
                    f.write("".join(p + "\n" for p in created))
        os.chdir(spec["cwd"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except Exception as e:  # the container "could not run": say why, like a runtime would
        msg = f"sftjob node agent: cannot start container: {e}"
        print(msg, file=sys.stderr, flush=True)
        try:
            with open(spec["termlog_host"], "w") as f:
                f.write(msg)
        except OSError:
            pass
        os._exit(127 if isinstance(e, FileNotFoundError) else 128)


main()
