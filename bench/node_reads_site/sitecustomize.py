"""Byte counters for bench/node_reads.py, loaded into every trainer process through
PYTHONPATH, so the trainer before and after a change is measured the same way: the bytes
each process reads from S3 (botocore's response bodies) and the disk a node's checkpoint
restore copy takes (its allocated blocks, recorded when the trainer deletes it)."""
import atexit
import json
import logging
import os
import shutil

_OUT = os.environ.get("NODE_READS_OUT")
_counts = {"s3_read": 0, "restore_disk": 0}

if _OUT:
    from botocore.response import StreamingBody

    _read = StreamingBody.read

    def read(self, amt=None):
        data = _read(self, amt)
        _counts["s3_read"] += len(data)
        return data

    StreamingBody.read = read
    _rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if "/restore/" in str(path) and os.path.isdir(path):
            for root, _, names in os.walk(path):
                for n in names:
                    try:
                        _counts["restore_disk"] += os.lstat(os.path.join(root, n)).st_blocks * 512
                    except OSError:
                        pass
        return _rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree

    def _write() -> None:
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as fh:
            json.dump(_counts | {"rank": os.environ.get("RANK")}, fh)

    # The trainer leaves with os._exit (cli.entrypoint), after logging.shutdown: no atexit.
    _shutdown = logging.shutdown

    def shutdown(*args, **kwargs):
        _write()
        return _shutdown(*args, **kwargs)

    logging.shutdown = shutdown
    atexit.register(_write)
