"""The test cluster by hand: ``python tests/testbed start|stop|status|env`` (as root, from anywhere).

    .venv/bin/python tests/testbed start                 # 2 nodes; --nodes 1, --dir D
    eval "$(.venv/bin/python tests/testbed env)"         # export SLURM_CONF=...
    sbatch --wait job.sbatch
    .venv/bin/python tests/testbed status                # daemons, nodes, jobs; every test cluster running
    .venv/bin/python tests/testbed stop                  # --keep-logs keeps D/log

A cluster started here belongs to nobody: it runs until ``stop``. Errors are one ``testbed: error:``
line and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

for _path in Path(__file__).resolve().parents[1:3]:  # tests/ (`import testbed`, as the tests do) and the repository
    sys.path.insert(0, str(_path))

from testbed import resources as node_resources  # noqa: E402
from testbed.daemons import DEFAULT_DIR, MAX_NODES, ClusterError, Testbed, check_node_list, is_running  # noqa: E402
from testbed.daemons import owner_alive, running_clusters, say  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tests/testbed", description="A throwaway Slurm cluster on this "
                                     "machine, for testing the course's sbatch templates.")
    parser.add_argument("command", choices=("start", "stop", "status", "env"),
                        help="start: install Slurm when missing, configure, start, wait until the nodes are idle; "
                             "stop: cancel the jobs, stop the daemons, delete the directory; status: daemons, "
                             "nodes and jobs (exit 3 when none runs); env: print `export SLURM_CONF=...`")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the cluster's directory (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=2, choices=range(1, MAX_NODES + 1), metavar="N",
                        help=f"emulated compute nodes n1..nN, 1 to {MAX_NODES} [start] (default: %(default)s)")
    parser.add_argument("--no-accounting", dest="accounting", action="store_false",
                        help="no slurmdbd and MariaDB: sacct does not answer [start] (default: accounting on)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep D/log after stopping [stop] (default: delete everything)")
    claims = parser.add_argument_group("what the nodes claim [start] (default: enough for every site profile "
                                       "in slurm/sites/)")
    claims.add_argument("--partitions", help="comma-separated partition names; the first is the default")
    claims.add_argument("--gpus", help="typed GPUs per node, e.g. a100:8,v100:16")
    claims.add_argument("--features", help="node features for --constraint, e.g. a100,v100")
    claims.add_argument("--reservations", help="reservations to create, e.g. itp-450-th")
    claims.add_argument("--cpus", type=int, help="CPUs per node")
    claims.add_argument("--mem-mb", type=int, help="memory per node in MB")
    return parser


def resources_from(args: argparse.Namespace) -> node_resources.NodeResources:
    """The site profiles' claims, with what the command line names instead."""
    claims = node_resources.for_sites()
    split = (lambda text: tuple(item for item in text.split(",") if item))
    try:
        return node_resources.NodeResources(
            partitions=split(args.partitions) if args.partitions is not None else claims.partitions,
            gpus=tuple(check_node_list(args.gpus)) if args.gpus is not None else claims.gpus,
            features=split(args.features) if args.features is not None else claims.features,
            reservations=split(args.reservations) if args.reservations is not None else claims.reservations,
            accounts=claims.accounts,
            cpus=args.cpus if args.cpus is not None else claims.cpus,
            mem_mb=args.mem_mb if args.mem_mb is not None else claims.mem_mb)
    except ValueError as err:
        raise ClusterError(str(err)) from None


def status(testbed: Testbed) -> int:
    for cluster in running_clusters().values():
        owner = "started by hand"
        if cluster.owner:
            owner = f"run {cluster.owner.partition(':')[0]} " + ("running" if owner_alive(cluster.owner) else "ENDED")
        say(f"a test cluster runs in {cluster.directory} ({owner}; {len(cluster.pids)} process(es))")
    if not testbed.is_ours():
        say(f"no test cluster in {testbed.directory}")
        return 3
    say(f"cluster directory {testbed.directory}")
    for name, pid in testbed.daemon_pids().items():
        print(f"  {name:12s} pid {pid:<8d} {'running' if is_running(pid) else 'stopped'}")
    if not testbed.running():
        return 3
    print(testbed.slurm("sinfo").stdout, testbed.slurm("squeue").stdout, sep="", end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    testbed = Testbed(args.dir, nodes=args.nodes, accounting=args.accounting)
    try:
        if args.command == "start":
            testbed.start(resources_from(args))
            say(f'use it with: eval "$({sys.executable} {Path(__file__).parent} env --dir {testbed.directory})"')
        elif args.command == "stop":
            if not testbed.is_ours():
                raise ClusterError(f"no test cluster in {testbed.directory}")
            testbed.stop(keep_logs=args.keep_logs)
            say("stopped")
        elif args.command == "status":
            return status(testbed)
        elif args.command == "env":
            if not (testbed.is_ours() and testbed.running()):
                raise ClusterError(f"no test cluster is running in {testbed.directory} (start one first)")
            print(f"export SLURM_CONF={testbed.slurm_conf}")
    except ClusterError as err:
        print(f"testbed: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
