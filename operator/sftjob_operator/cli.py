"""`sftjob-operator`: run the SFTJob operator (one namespace, several, or the whole cluster).

    sftjob-operator --namespace team-a            # namespace scope
    sftjob-operator --all-namespaces              # cluster scope
    sftjob-operator --print-crd > crd.yaml        # the CRD this operator serves

Kubernetes credentials: in-cluster service account, else $KUBECONFIG / ~/.kube/config.
Serves Prometheus metrics on --metrics-port and a liveness endpoint on --liveness-port
(`GET /healthz`).

High availability: with --leader-elect (the default in a pod) several replicas may run; each
waits for a coordination.k8s.io Lease (leader.py) and only its holder acts. A standby serves
/healthz and /metrics (`sftjob_operator_leader 0`) and nothing else. A leader that cannot
renew the Lease within --leader-election-renew-deadline exits with status 75
(leader.EXIT_LEASE_LOST) before any standby may take over.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING

from .settings import Settings

if TYPE_CHECKING:
    from . import leader


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sftjob-operator", description=__doc__.split("\n\n")[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like team-* allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus port (0: off); default 8080")
    p.add_argument("--liveness-port", type=int, default=8081, help="liveness port (0: off); default 8081")
    p.add_argument("--peering", metavar="NAME", default=None,
                   help="kopf peering NAME (needs kopf's peering CRDs); not a way to run replicas "
                   "(it does not pause the operator's requeue scheduler): use --leader-elect; "
                   "default: standalone")
    le = p.add_argument_group("leader election (several replicas, one acts)")
    le.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=None,
                    help="hold a coordination.k8s.io/v1 Lease before acting; default: on in a pod "
                    "(in-cluster ServiceAccount), off elsewhere")
    le.add_argument("--leader-election-namespace", metavar="NS", default=None,
                    help="namespace of the Lease; default: $POD_NAMESPACE, else the ServiceAccount's")
    le.add_argument("--leader-election-name", metavar="NAME", default="sftjob-operator",
                    help="name of the Lease (one per set of replicas); default sftjob-operator")
    le.add_argument("--leader-election-id", metavar="ID", default=None,
                    help="this replica's identity in the Lease; default: $POD_NAME (or host name) "
                    "plus a random suffix")
    le.add_argument("--leader-election-lease-duration", type=float, default=15.0, metavar="S",
                    help="a standby takes over a Lease not renewed for this long; default 15")
    le.add_argument("--leader-election-renew-deadline", type=float, default=10.0, metavar="S",
                    help="a leader that could not renew for this long exits; default 10")
    le.add_argument("--leader-election-retry-period", type=float, default=2.0, metavar="S",
                    help="standby poll and leader renew interval; default 2")
    p.add_argument("--watch-timeout", type=int, default=300,
                   help="server-side watch timeout in seconds, so watches never silently stall")
    p.add_argument("--job-network-policy", action=argparse.BooleanOptionalAction, default=False,
                   help="give every job a NetworkPolicy: only its own pods reach its ranks, and only "
                        "--trainer-metrics-from peers its metrics port (the chart turns this on)")
    p.add_argument("--trainer-metrics-from", metavar="JSON", default="[]",
                   help="NetworkPolicy `from` peers (a JSON list) allowed to the trainers' metrics port: "
                        "the operator's own pods and your monitoring namespace")
    p.add_argument("--log-format", choices=("plain", "json"), default="plain")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--print-crd", action="store_true", help="print the CRD YAML and exit")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The operator's settings from parsed arguments; ValueError for a combination that
    cannot run (no scope, leader election without a namespace or with unsafe timings)."""
    from . import leader

    if not args.namespace and not args.all_namespaces:
        raise ValueError("choose a scope: --namespace NS (repeatable) or --all-namespaces")
    identity = args.leader_election_id or leader.default_identity()
    election = None
    elect = leader.in_cluster() if args.leader_elect is None else args.leader_elect   # default: on in a pod
    if elect:
        ns = args.leader_election_namespace or leader.default_namespace()
        if not ns:
            raise ValueError("--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)")
        election = leader.Config(namespace=ns, name=args.leader_election_name, identity=identity,
                                 lease_duration=args.leader_election_lease_duration,
                                 renew_deadline=args.leader_election_renew_deadline,
                                 retry_period=args.leader_election_retry_period)
    try:
        peers = json.loads(args.trainer_metrics_from)
    except ValueError as err:
        raise ValueError(f"--trainer-metrics-from is not JSON: {err}") from None
    if not isinstance(peers, list) or not all(isinstance(x, dict) for x in peers):
        raise ValueError("--trainer-metrics-from must be a JSON list of NetworkPolicy peers (objects)")
    return Settings(namespaces=tuple(args.namespace) or None, watch_server_timeout=args.watch_timeout,
                    peering_name=args.peering, identity=identity, metrics_port=args.metrics_port,
                    liveness_port=args.liveness_port, leader_election=election, log_format=args.log_format,
                    verbose=args.verbose, job_network_policy=args.job_network_policy,
                    trainer_metrics_from=tuple(peers))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.print_crd:
        from . import crd

        sys.stdout.write(crd.render())
        return 0
    try:
        settings = settings_from_args(args)
    except ValueError as err:
        _parser().error(str(err))

    # Imported before the election, so that a standby that takes over starts at once.
    import kopf

    from . import handlers, metrics  # noqa: F401 - importing registers the kopf handlers

    kopf.configure(verbose=settings.verbose,
                   log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.PLAIN)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not settings.verbose:
        # kopf logs every pod event it handles ("Handler ... succeeded"); the operator's own
        # log lines (sftjob_operator) say what was decided and done.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("sftjob_operator").setLevel(logging.INFO)
    metrics.serve(settings.metrics_port)
    liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz" if settings.liveness_port else None
    electors: list[leader.LeaderElector] = []   # filled by _elect as soon as the elector exists
    try:
        if settings.leader_election:
            _elect(settings.leader_election, settings.liveness_port, electors)
        kopf.run(
            clusterwide=settings.namespaces is None,
            namespaces=list(settings.namespaces or ()),
            liveness_endpoint=liveness,
            standalone=settings.peering_name is None,
            peering_name=settings.peering_name,
            # kopf's default identity comes from getpass.getuser(), which fails for a uid with
            # no /etc/passwd entry (the image's 65532, any runAsUser a cluster assigns)
            identity=settings.identity,  # type: ignore[arg-type]  # kopf's Identity: a NewType of str it does not export
            memo=kopf.Memo(settings=settings),
        )
    finally:
        # kopf has stopped (SIGTERM, SIGINT or a fatal error): nothing acts any more, so the
        # Lease can go to a standby now rather than after it expires.
        for elector in electors:
            elector.release()   # only if it holds the Lease
    return 0


def _elect(cfg: leader.Config, liveness_port: int, electors: list[leader.LeaderElector]) -> None:
    """Stand by until this replica holds the Lease; then renew it in the background."""
    from . import leader

    elector = leader.LeaderElector(cfg)
    electors.append(elector)
    # SIGTERM ends a standby at once (it holds nothing), and a new leader until kopf installs
    # its own handler: as SystemExit, so that main's `finally` still releases the Lease.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    health = leader.StandbyHealth(liveness_port, elector) if liveness_port else None
    try:
        elector.acquire()
    finally:
        if health is not None:
            health.stop()   # kopf serves /healthz on this port from now on
    elector.start_renewing()


if __name__ == "__main__":
    sys.exit(main())
