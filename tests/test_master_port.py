"""The rendezvous port of a Slurm job: the whole range, the step id counts, shell and Python agree.

Two jobs that share a node need different ``MASTER_PORT``s, or the second one's rank 0 cannot open
its rendezvous ("address already in use") or, worse, its ranks join the other job's. The port comes
from the job id (and step id), computed by ``slurm/lib/job_header.sh`` in the batch script and by
``common.runtime.launch.port_from_job`` in a task started by ``srun`` without the header; both must give the
same number. (On the test cluster: ``tests/slurm/test_testbed.py`` runs two such jobs at once.)
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

from common.runtime import launch
from helpers import REPO


def test_consecutive_job_ids_use_every_port_of_the_range():
    ports = {launch.port_from_job(job_id) for job_id in range(123_456, 123_456 + launch.PORT_SPAN)}
    assert ports == set(range(launch.PORT_BASE, launch.PORT_BASE + launch.PORT_SPAN))


def test_a_jobs_first_steps_avoid_the_ports_of_nearby_jobs():
    job = 777_777
    steps = [launch.port_from_job(job, step) for step in range(11)]
    nearby = {launch.port_from_job(other) for other in range(job - 500, job + 501) if other != job}
    assert len(set(steps)) == len(steps)
    assert not set(steps[1:]) & (nearby | {steps[0]})
    assert launch.port_from_job(job, "batch") == launch.port_from_job(job, None) == steps[0]


def test_the_job_header_and_common_launch_compute_the_same_port():
    rng = random.Random(10)
    pairs = [(str(job), "") for job in range(1, 400)]
    pairs += [(str(rng.randrange(1, 2**32)), str(rng.choice([0, 1, 2, 7, 99, rng.randrange(2**32)])))
              for _ in range(1500)]
    pairs += [("4242", "batch"), ("4242", "extern"), ("67108863", "4294967294"), ("10000", "0")]
    calls = "\n".join(f"port_from_job {job} {step}" for job, step in pairs)
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "MASTER_"))}
    done = subprocess.run([shutil.which("bash"), "-c", f"set -euo pipefail\nsource slurm/lib/job_header.sh "
                           f">/dev/null\n{calls}\n"], capture_output=True, text=True, cwd=REPO, env=clean)
    assert done.returncode == 0, done.stderr
    shell = [int(port) for port in done.stdout.split()]
    python = [launch.port_from_job(job, step or None) for job, step in pairs]
    assert shell == python
