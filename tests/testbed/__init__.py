"""The throwaway Slurm test cluster that CI submits the course's sbatch templates to (README.md here).

- :mod:`testbed.daemons`: start and stop one cluster (``Testbed``), find and stop clusters whose run
  has ended without stopping them.
- :mod:`testbed.resources`: what the emulated nodes claim, from the site profiles in ``slurm/sites/``.
- :mod:`testbed.cluster`: ``SlurmTestCluster``, what tests use: start, submit, wait, output, stop.
- ``python tests/testbed start|stop|status|env``: the same by hand (``__main__.py``).

Importable as ``testbed`` from the tests (``tests/`` is on ``sys.path``).
"""

from testbed.cluster import JobResult, SbatchRejected, SlurmTestCluster, Submission
from testbed.daemons import ClusterError, Testbed

__all__ = ["ClusterError", "JobResult", "SbatchRejected", "SlurmTestCluster", "Submission", "Testbed"]
