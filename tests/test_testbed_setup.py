"""The Slurm test cluster's set-up, without starting one: what the nodes claim, ports, owners, CLI.

(The cluster itself, started as root, is tested under tests/slurm/.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from common.slurm.sites import find_site, load_sites
from testbed import daemons, resources
from testbed.__main__ import main as cli_main

def test_the_nodes_claim_enough_for_every_site():
    claims = resources.for_sites()
    gpus = dict(claims.gpus)
    assert claims.partitions[0] == find_site("generic").default_partitions["cpu"]  # the default
    for site in load_sites().values():
        for partition in site.partitions.values():
            assert partition.name in claims.partitions
            assert partition.cpus_per_node <= claims.cpus
            for model in partition.gpu_types:
                assert gpus[model] >= partition.gpus_per_node
                assert model in claims.features  # --constraint=a100 works
        if site.reservation:
            assert site.reservation in claims.reservations


def test_a_cluster_takes_the_first_block_of_ports_that_is_free():
    first = daemons.free_port_block(nodes=2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", first + 2))  # the second slurmd's port
        second = daemons.free_port_block(nodes=2)
    assert second >= first + daemons.PORT_BLOCK
    assert (second - daemons.FIRST_PORT) % daemons.PORT_BLOCK == 0
    assert second + 2 < 20000  # below the jobs' rendezvous ports (common.runtime.launch.PORT_BASE)


def test_an_owner_is_alive_only_while_its_process_runs():
    assert daemons.owner_alive(daemons.owner_token(os.getpid()))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    token = daemons.owner_token(ended.pid)
    assert daemons.owner_alive(token)
    ended.wait()
    assert not daemons.owner_alive(token)
    assert not daemons.owner_alive(f"{os.getpid()}:1")  # the same pid, another process (pid reused)
    assert not daemons.owner_alive("")  # started by hand: nobody to outlive


@pytest.mark.parametrize(("argv", "message"), [
    (["start", "--gpus", "a100"], "GPUs must look like a100:8,v100:16, got 'a100'"),
    (["stop", "--dir", "/nonexistent/cluster"], "no test cluster in /nonexistent/cluster"),
    (["env", "--dir", "/nonexistent/cluster"], "no test cluster is running in /nonexistent/cluster"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"testbed: error: {message}") and err.count("\n") == 1, err
