"""`sftjob-operator`: run the SFTJob operator (one namespace, several, or the whole cluster).

    sftjob-operator --namespace team-a            # namespace scope
    sftjob-operator --all-namespaces              # cluster scope
    sftjob-operator --print-crd > crd.yaml        # the CRD this operator serves

Kubernetes credentials: in-cluster service account, else $KUBECONFIG / ~/.kube/config.
Serves Prometheus metrics on --metrics-port and a liveness endpoint on --liveness-port
(`GET /healthz`).
"""
from __future__ import annotations

import argparse
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sftjob-operator", description=__doc__.split("\n\n")[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like team-* allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus port (0: off); default 8080")
    p.add_argument("--liveness-port", type=int, default=8081, help="liveness port (0: off); default 8081")
    p.add_argument("--peering", metavar="NAME", default=None,
                   help="coordinate with other operator replicas through kopf peering NAME "
                   "(needs kopf's peering CRDs); default: standalone")
    p.add_argument("--watch-timeout", type=int, default=300,
                   help="server-side watch timeout in seconds, so watches never silently stall")
    p.add_argument("--log-format", choices=("plain", "json"), default="plain")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--print-crd", action="store_true", help="print the CRD YAML and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.print_crd:
        from . import crd

        sys.stdout.write(crd.render())
        return 0
    if not args.namespace and not args.all_namespaces:
        _parser().error("choose a scope: --namespace NS (repeatable) or --all-namespaces")

    import kopf

    from . import handlers, metrics

    handlers.CONFIG.update(
        namespaces=list(args.namespace) or None,
        watch_server_timeout=args.watch_timeout,
        standalone=args.peering is None,
        peering_name=args.peering,
    )
    kopf.configure(verbose=args.verbose,
                   log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not args.verbose:
        # kopf logs every pod event it handles ("Handler ... succeeded"); the operator's own
        # log lines (sftjob_operator) say what was decided and done.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("sftjob_operator").setLevel(logging.INFO)
    metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        standalone=args.peering is None,
        peering_name=args.peering,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
