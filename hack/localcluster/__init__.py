"""A real local Kubernetes cluster for tests and the demo, without docker.

    from hack import localcluster
    cfg = localcluster.up()            # build missing binaries, start what is not running
    localcluster.env()                 # KUBECONFIG, AWS_* and PATH as in .cluster/env
    localcluster.node_lost("sftjob-node-1")
    localcluster.down()

CLI: python -m hack.localcluster {up,down,status,env,node-lost,node-restore,logs}
"""
from .cluster import down, is_up, kubeconfig_path, leftover_processes, prepare, status, up  # noqa: F401 - re-exported API
from .credentials import env  # noqa: F401 - re-exported API
from .config import ClusterConfig, bin_dir, load  # noqa: F401 - re-exported API
from .kueue import kueue_down, kueue_up  # noqa: F401 - re-exported API
from .kwok import kwok_down, kwok_up  # noqa: F401 - re-exported API
from .nodes import node_lost, node_restore, pod_log  # noqa: F401 - re-exported API
