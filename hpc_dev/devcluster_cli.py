"""`dspark-dev devcluster up|down|status`: the local multi-node Slurm cluster.

The cluster itself is in hpc_dev/devcluster.py.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from hpc_dev.devcluster import DevCluster
from hpc_dev.devcluster_net import DEFAULT_SUBNET, SUBNET_ENV


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "devcluster",
        help="run a real multi-node Slurm cluster on this host (root, Debian/Ubuntu)",
        description=(
            "Start/stop munged, MariaDB, slurmdbd, slurmctld and one slurmd per node under a "
            "private state directory. Installs the Debian packages it needs when missing."
        ),
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="state directory (default: $DSPARK_DEVCLUSTER_DIR or /var/tmp/dspark-devcluster)",
    )
    parser.add_argument("--partition", default="debug", help="partition name (default: debug)")
    parser.add_argument("--nodes", type=int, default=3, help="number of nodes (default: 3)")
    parser.add_argument("--network", choices=["netns", "loopback"], default="netns",
                        help="netns (default): each node a host of its own, in a network namespace with its own "
                             "address on a private bridge; loopback: every node on 127.0.0.1, for machines "
                             "where namespaces cannot be made")
    parser.add_argument("--subnet", default=None,
                        help=f"the private IPv4 range of the cluster network (default: ${SUBNET_ENV} or "
                             f"{DEFAULT_SUBNET}); the login side takes .1, node N takes .N+1")
    parser.add_argument("--force", action="store_true",
                        help="start even where a real Slurm is installed (its config in /etc, or its daemons)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The library reports progress through logging; show it as plain lines on stderr.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cluster = DevCluster(args.dir, partition=args.partition, num_nodes=args.nodes, network=args.network,
                         subnet=args.subnet)
    conf = cluster.env()["SLURM_CONF"]
    if args.action == "up":
        start = time.monotonic()
        started = cluster.up(force=args.force)
        took = time.monotonic() - start
        what = "started" if started else "already up"
        nodes = ", ".join(f"{n} {a}" for n, a in cluster.node_addrs().items())
        print(f"devcluster {what} ({took:.1f} s): partition {cluster.partition}, login {cluster.login_addr}, "
              f"nodes {nodes}")
        print(f"export SLURM_CONF={conf}")
        return 0
    if args.action == "down":
        print("devcluster stopped" if cluster.down() else "devcluster was not running")
        return 0
    print(cluster.status_text())
    return 0 if cluster.is_healthy() else 1
