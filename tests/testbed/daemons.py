"""Start and stop the throwaway Slurm cluster: munged, slurmctld and one slurmd per emulated node.

Everything of one cluster lives in one directory (configuration, munge key and socket, state,
spool, logs, fake GPU devices); :meth:`Testbed.stop` deletes it. Each cluster listens on ports of
its own (the first free block from 16817 up, away from Slurm's 6817 and from the jobs' rendezvous
ports 20000-29999), so a cluster that is still running never blocks the next one.

Every daemon carries two variables in its environment: the cluster's directory and its *owner*,
the process (pid and start time) of the test run that started it, or none for a cluster started by
hand. A run that is killed (SIGKILL, SIGTERM, a CI timeout) cannot stop its cluster; the next
:meth:`Testbed.start` finds such a cluster by reading ``/proc/*/environ``, sees that its owner is
gone, and stops it with its jobs. A cluster started by hand stays until ``stop``.

Accounting, as on a real cluster (``sacct``, ``sstat``, ``jobacct_gather/linux``; submitit and Lab-09
read it): a MariaDB server of the cluster's own (its data directory under the cluster's directory, on
the block's last port, 127.0.0.1 only) and ``slurmdbd`` on the port before it, started after munged
and stopped after slurmctld. A fresh MariaDB data directory takes 4-15 s to create
(``mariadb-install-db``), so it is made once per MariaDB version under ``/var/cache`` and copied
(a fraction of a second). ``accounting=False`` leaves both out (``accounting_storage/none``).

Written for Debian 12's Slurm 22.05, munge 0.5 and MariaDB 10.11. Needs root (slurmd runs jobs as any
user, the fake GPUs are device nodes, ``/etc/hosts`` gets the node names).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed.resources import NodeResources

DEFAULT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "hpc-dl-labs-slurm"
MARKER = ".hpc-dl-labs-testbed"            # a directory holding this file is a cluster's, ours to delete
DIR_VARIABLE = "HPC_DL_LABS_TESTBED_DIR"    # in every daemon's environment: its cluster's directory
OWNER_VARIABLE = "HPC_DL_LABS_TESTBED_OWNER"  # "<pid>:<start time>" of the run that owns it, or ""
FIRST_PORT, PORT_BLOCK, PORT_BLOCKS = 16817, 8, 100  # slurmctld on a block's first port, slurmds after it
SLURMDBD_PORT, MARIADB_PORT = 6, 7  # their offsets in the block (after at most MAX_NODES slurmds)
HOSTS_TAG = "# added by hpc-dl-labs slurm testbed"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
ACCOUNTING_PACKAGES = ("slurmdbd", "mariadb-server")
MAX_NODES = 4
#: Where the pristine MariaDB data directory is kept between clusters, one per MariaDB version.
MARIADB_CACHE = Path(os.environ.get("HPC_DL_LABS_TESTBED_CACHE", "/var/cache/hpc-dl-labs-testbed"))
#: A throwaway database: no doublewrite, no fsync, small buffers (the cluster's few jobs need little).
MARIADB_OPTIONS = ("--no-defaults", "--user=root", "--skip-name-resolve", "--skip-log-bin",
                   "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=4M", "--innodb-doublewrite=0",
                   "--innodb-flush-method=nosync", "--innodb-flush-log-at-trx-commit=0")


class ClusterError(RuntimeError):
    """The test cluster could not be started or stopped; the message says why."""


def say(message: str) -> None:
    print(f"testbed: {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Processes

def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), None if gone.

    With the pid it names one process for good: a pid alone may be reused after the process ends.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name, in brackets, may contain spaces
    return fields[19] if fields[0] != "Z" else None  # a zombie has ended


def is_running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, which a container's PID 1 may never reap, has stopped)."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child and has ended
    except ChildProcessError:
        pass
    return start_time(pid) is not None


def owner_token(pid: int) -> str:
    return f"{pid}:{start_time(pid)}"


def owner_alive(token: str) -> bool:
    pid, _, started = token.partition(":")
    return pid.isdigit() and start_time(int(pid)) == started


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _parents() -> dict[int, int]:
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def descendants(pids: set[int]) -> set[int]:
    """``pids`` and every process below them."""
    parents, found = _parents(), set(pids)
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found and pid not in found}
        found |= children
        grew = bool(children)
    return found


def terminate(pids: set[int], seconds: float) -> None:
    """SIGTERM, then SIGKILL what still runs after ``seconds``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + seconds
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if is_running(pid):
            say(f"pid {pid} ignored SIGTERM for {seconds:.0f} s; sending SIGKILL")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class RunningCluster:
    """A cluster found among the running processes: its directory, owner and processes."""

    directory: Path
    owner: str                       # "" when started by hand
    pids: set[int] = field(default_factory=set)

    @property
    def left_behind(self) -> bool:
        return bool(self.owner) and not owner_alive(self.owner)


def running_clusters() -> dict[Path, RunningCluster]:
    """Every test cluster with a process still running (daemons, and slurmstepd, which inherits
    slurmd's environment), by directory."""
    found: dict[Path, RunningCluster] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        env = _environ(int(proc.name))
        if DIR_VARIABLE in env and is_running(int(proc.name)):
            directory = Path(env[DIR_VARIABLE])
            cluster = found.setdefault(directory, RunningCluster(directory, env.get(OWNER_VARIABLE, "")))
            cluster.pids.add(int(proc.name))
    return found


# ---------------------------------------------------------------------------------------------
# Ports and host names

def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def block_ports(first: int, nodes: int, accounting: bool = True) -> list[int]:
    """The ports a cluster takes from its block: slurmctld, one per slurmd, then slurmdbd and MariaDB."""
    extra = [first + SLURMDBD_PORT, first + MARIADB_PORT] if accounting else []
    return [*range(first, first + 1 + nodes), *extra]


def free_port_block(nodes: int, accounting: bool = True) -> int:
    """The first port of a block whose ports (:func:`block_ports`) are all free."""
    for block in range(PORT_BLOCKS):
        first = FIRST_PORT + block * PORT_BLOCK
        if all(_port_free(port) for port in block_ports(first, nodes, accounting)):
            return first
    raise ClusterError(f"no free block of {nodes + 1} ports from {FIRST_PORT} to {first + PORT_BLOCK}")


def add_host_entries(directory: Path, nodes: list[str]) -> None:
    """Node names must resolve: the templates take ``MASTER_ADDR`` from the node list."""
    added = []
    for node in nodes:
        try:
            socket.gethostbyname(node)
        except OSError:
            added.append(node)
    if added:
        with open("/etc/hosts", "a", encoding="utf-8") as hosts:
            hosts.writelines(f"127.0.0.1 {node} {HOSTS_TAG}\n" for node in added)
        (directory / "hosts-added").write_text("\n".join(added) + "\n")


def remove_host_entries(directory: Path) -> None:
    """Remove the lines the testbed added, unless another test cluster still runs and needs them."""
    if not (directory / "hosts-added").is_file():
        return
    (directory / "hosts-added").unlink()
    if any(cluster.directory != directory for cluster in running_clusters().values()):
        return
    # Rewrite in place (not a new file: a bind-mounted /etc/hosts cannot be replaced).
    lines = Path("/etc/hosts").read_text(encoding="utf-8").splitlines(keepends=True)
    with open("/etc/hosts", "w", encoding="utf-8") as hosts:
        hosts.writelines(line for line in lines if HOSTS_TAG not in line)


# ---------------------------------------------------------------------------------------------
# Installing Slurm

def install_packages(accounting: bool = True) -> None:
    commands = ("munged", "slurmctld", "slurmd", "sbatch") + (("slurmdbd", "mariadbd") if accounting else ())
    missing = [cmd for cmd in commands if shutil.which(cmd, path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"Slurm is not installed (missing: {' '.join(missing)}) and installing it needs root")
    if shutil.which("apt-get") is None:
        raise ClusterError(f"Slurm is not installed (missing: {' '.join(missing)}) and there is no apt-get")
    packages = PACKAGES + (ACCOUNTING_PACKAGES if accounting else ())
    say(f"installing {' '.join(packages)} with apt-get (missing: {' '.join(missing)})")
    began = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *packages]):
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-10:])
            raise ClusterError(f"{' '.join(command)} failed: {tail}")
    say(f"installed in {time.monotonic() - began:.1f} s")


# ---------------------------------------------------------------------------------------------
# One cluster

class Testbed:
    """The test cluster living in ``directory``, with emulated nodes n1..nN."""

    def __init__(self, directory: Path = DEFAULT_DIR, nodes: int = 2, accounting: bool = True) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be 1 to {MAX_NODES}, got {nodes}")
        self.directory = Path(directory).absolute()
        self.nodes = nodes
        self.accounting = accounting

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_range(self) -> str:
        """Slurm's short form of the node list: n1 or n[1-2]."""
        return "n1" if self.nodes == 1 else f"n[1-{self.nodes}]"

    @property
    def slurm_conf(self) -> Path:
        return self.directory / "slurm.conf"

    def is_ours(self) -> bool:
        return (self.directory / MARKER).is_file()

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def slurm(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sinfo, squeue, scontrol ...) against this cluster."""
        return subprocess.run(list(command), capture_output=True, text=True, env=self.env(), check=False)

    def daemon_pids(self) -> dict[str, int]:
        """The daemons started here, by name (munged, slurmctld, slurmd-n1 ...), running or not."""
        pids = {}
        for path in sorted((self.directory / "pids").glob("*")):
            text = path.read_text().strip()
            if text.isdigit():
                pids[path.name] = int(text)
        return pids

    def running(self) -> bool:
        return any(is_running(pid) for pid in self.daemon_pids().values())

    # -- start ---------------------------------------------------------------------------------

    def start(self, resources: NodeResources, owner: int | None = None) -> list[RunningCluster]:
        """Start the cluster and wait until its nodes are idle; return the clusters left behind by
        ended runs that were stopped first. ``owner``: the pid of the run the cluster belongs to (it
        is stopped by the next start after that process has ended), or None (stopped by hand)."""
        if os.geteuid() != 0:
            raise ClusterError("starting the test cluster needs root (slurmd runs jobs as any user)")
        left_behind = self.stop_left_behind()
        if self.directory.exists():
            if self.is_ours() and self.running():
                raise ClusterError(f"a test cluster is already running in {self.directory} (stop it first)")
            if self.is_ours():
                say(f"removing the leftovers of a stopped test cluster in {self.directory}")
                remove_host_entries(self.directory)
                shutil.rmtree(self.directory)
            elif any(self.directory.iterdir()):
                raise ClusterError(f"{self.directory} exists and is not a test cluster directory; choose another")
        install_packages(self.accounting)
        began = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o711)  # munged insists that everyone may traverse its socket's directory
        (self.directory / MARKER).touch()
        port = free_port_block(self.nodes, self.accounting)
        self.write_config(resources, port)
        add_host_entries(self.directory, self.node_names)
        try:
            self.start_daemons(owner_token(owner) if owner else "", port, resources.accounts)
            self.wait_for_idle_nodes(30)
            for name in resources.reservations:
                created = self.slurm("scontrol", "create", "reservation", f"ReservationName={name}", "Users=root",
                                     "StartTime=now", "Duration=UNLIMITED", f"Nodes={self.node_range}",
                                     "CoreCnt=" + ",".join([str(resources.cpus)] * self.nodes))
                if created.returncode != 0:
                    raise ClusterError(f"cannot create reservation {name}: {created.stderr.strip()}")
        except ClusterError as err:
            logs = self.log_tails()
            self.stop()
            raise ClusterError(f"the test cluster did not start: {err}{logs}") from None
        partitions = " ".join(resources.partitions)
        ports = block_ports(port, self.nodes, self.accounting)
        say(f"{self.nodes} node(s) idle in {time.monotonic() - began:.1f} s on ports {','.join(map(str, ports))}: "
            f"partitions {partitions}; accounting: {'slurmdbd + MariaDB' if self.accounting else 'none'}")
        say(f"GPUs per node: {','.join(f'{m}:{n}' for m, n in resources.gpus)}; features: "
            f"{','.join(resources.features) or 'none'}; reservations: {','.join(resources.reservations) or 'none'}")
        return left_behind

    def write_config(self, resources: NodeResources, port: int) -> None:
        directory, host = self.directory, socket.gethostname().split(".")[0]
        for sub in ("log", "state", "spool", "tmp", "dev", "pids", "run"):
            (directory / sub).mkdir()
        # Fake GPUs: character devices with NVIDIA's major number 195 and nothing behind them. Slurm
        # needs device files in gres.conf to set CUDA_VISIBLE_DEVICES (regular files leave it empty).
        gres = ["AutoDetect=off"]
        for node in self.node_names:
            first = 0
            for model, count in resources.gpus:
                for index in range(first, first + count):
                    os.mknod(directory / "dev" / f"{node}-gpu{index}", 0o600 | stat.S_IFCHR, os.makedev(195, index))
                gres.append(f"NodeName={node} Name=gpu Type={model} "
                            f"File={directory}/dev/{node}-gpu[{first}-{first + count - 1}]")
                first += count
        (directory / "gres.conf").write_text("\n".join(gres) + "\n")

        # Each reservation holds `cpus` cores of every node for its own jobs, so a node claims them once
        # more per reservation: jobs outside a reservation always find room and never wait behind one.
        node_cpus = resources.cpus * (1 + len(resources.reservations))
        sockets = 2 if node_cpus % 2 == 0 else 1
        features = f" Feature={','.join(resources.features)}" if resources.features else ""
        gpus = ",".join(f"gpu:{model}:{count}" for model, count in resources.gpus)
        partitions = "\n".join(f"PartitionName={name} Nodes={self.node_range} Default={'YES' if i == 0 else 'NO'} "
                               "MaxTime=INFINITE State=UP" for i, name in enumerate(resources.partitions))
        self.slurm_conf.write_text(f"""\
# Written by the hpc-dl-labs test cluster (tests/testbed/): a throwaway cluster, everything under {directory}.
ClusterName=hpcdllabs
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a revoked job credential is remembered, and so how long Slurm holds a
# requeued job back before it may start again (default 120 s). A node refuses to start a job whose
# credential it still holds as revoked ("Job credential revoked"), so a requeued job released
# earlier than this fails on the node it ran on; 15 s keeps the pre-emption test short.
AuthInfo=socket={directory}/munge.sock,cred_expire=15
MailProg=/bin/true
TmpFS={directory}/tmp/%n
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
{self.accounting_config(port)}
JobCompType=jobcomp/filetxt
JobCompLoc={directory}/log/jobcomp.txt
SchedulerType=sched/backfill
# A requeued job becomes eligible again once cred_expire has passed, but nothing wakes the scheduler
# then: it waits for the next periodic pass (60 s main loop, 30 s backfill by default). Passes every
# 2 s start it within seconds: the pre-emption test's requeue gap went from 33 s to 17 s.
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Nodes claim the real clusters' sizes, not this machine's (nothing is enforced).
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MinJobAge=300
KillWait=5
GresTypes=gpu
NodeName={self.node_range} NodeHostname={host} NodeAddr=127.0.0.1 Port=[{port + 1}-{port + self.nodes}] \
CPUs={node_cpus} Boards=1 SocketsPerBoard={sockets} CoresPerSocket={node_cpus // sockets} ThreadsPerCore=1 \
RealMemory={resources.mem_mb} Gres={gpus}{features} State=UNKNOWN
{partitions}
""")

    def accounting_config(self, port: int) -> str:
        """slurm.conf's accounting lines (and, with accounting, slurmdbd.conf beside it)."""
        if not self.accounting:
            return "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none"
        directory = self.directory
        dbd_conf = directory / "slurmdbd.conf"
        dbd_conf.write_text(f"""\
# slurmdbd of the hpc-dl-labs test cluster: job records into its own MariaDB ({directory}/mariadb).
AuthType=auth/munge
AuthInfo=socket={directory}/munge.sock
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={port + SLURMDBD_PORT}
SlurmUser=root
LogFile={directory}/log/slurmdbd.log
PidFile={directory}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={port + MARIADB_PORT}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        dbd_conf.chmod(0o600)  # slurmdbd refuses a configuration others may read (it may hold a password)
        # jobacct_gather/linux samples each task's CPU time and memory (sacct's TotalCPU, MaxRSS; sstat);
        # gres/gpu in the TRES makes sacct's AllocTRES show the GPUs a job held (GPU-hours).
        return f"""\
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=10
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={port + SLURMDBD_PORT}
# For slurmdbd, Slurm's clients take munged's socket from here, not from AuthInfo.
AccountingStoragePass={directory}/munge.sock
AccountingStorageTRES=gres/gpu"""

    def _launch(self, name: str, command: list[str], owner: str) -> int:
        """Start a daemon in its own session, output to its log; record its pid under ``name``."""
        env = {**os.environ, DIR_VARIABLE: str(self.directory), OWNER_VARIABLE: owner,
               "SLURM_CONF": str(self.slurm_conf)}  # slurmdbd reads slurmdbd.conf beside it
        with open(self.directory / "log" / f"{name}.out", "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        process.returncode = 0  # reaped by is_running(); no "still running" warning when this object goes
        (self.directory / "pids" / name).write_text(f"{process.pid}\n")
        return process.pid

    def start_daemons(self, owner: str, port: int, accounts: tuple[str, ...] = ()) -> None:
        directory = self.directory
        key = directory / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # Its own key and socket, so a munged already running on this machine is left alone.
        munged = self._launch("munged", ["munged", "--foreground", f"--key-file={key}",
                                         f"--socket={directory}/munge.sock", f"--pid-file={directory}/munged.pid",
                                         f"--seed-file={directory}/munge.seed",
                                         f"--log-file={directory}/log/munged.log"], owner)
        deadline = time.monotonic() + 10
        while not (directory / "munge.sock").is_socket():
            if time.monotonic() > deadline or not is_running(munged):
                raise ClusterError("munged did not start")
            time.sleep(0.05)
        if self.accounting:
            self.start_accounting(owner, port)
            self.add_accounts(accounts)
        self._launch("slurmctld", ["slurmctld", "-D", "-f", str(self.slurm_conf)], owner)
        for node in self.node_names:
            self._launch(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.slurm_conf), "-N", node], owner)

    def start_accounting(self, owner: str, port: int) -> None:
        """MariaDB (a copy of the cached data directory), then slurmdbd, with the cluster registered.

        The first cluster on a machine registers it (``sacctmgr add cluster``: slurmdbd creates its
        tables, ~5 s), then stops both and keeps a copy of that database in the cache; the next
        clusters start from the copy, tables and all."""
        directory, cached = self.directory, accounting_cache()
        fresh = not (cached / "slurm_acct_db").is_dir()
        shutil.copytree(pristine_mariadb_datadir() if fresh else cached, directory / "mariadb", symlinks=True)
        self._start_database(owner, port)
        if not fresh:
            return
        added = self.slurm("sacctmgr", "--immediate", "add", "cluster", "hpcdllabs")
        if added.returncode != 0:
            raise ClusterError(f"sacctmgr add cluster failed: {(added.stderr or added.stdout).strip()}")
        pids = self.daemon_pids()
        for name in ("slurmdbd", "mariadbd"):  # a clean shutdown: every table written out
            terminate({pids[name]}, 20)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=MARIADB_CACHE))
        shutil.copytree(directory / "mariadb", building / "data", symlinks=True)
        try:
            (building / "data").rename(cached)
        except OSError:  # another cluster kept its copy first
            pass
        shutil.rmtree(building, ignore_errors=True)
        say(f"kept the registered accounting database in {cached}")
        self._start_database(owner, port)

    def add_accounts(self, accounts: tuple[str, ...]) -> None:
        """The sites' accounts, with root in each: with accounting, a job's --account must name an account
        its user belongs to, or Slurm drops it (the job runs without SLURM_JOB_ACCOUNT)."""
        if not accounts:
            return
        for command in (["sacctmgr", "--immediate", "add", "account", ",".join(accounts)],
                        ["sacctmgr", "--immediate", "add", "user", "root", f"account={','.join(accounts)}"]):
            done = self.slurm(*command)
            if done.returncode != 0 and "Nothing new added" not in done.stdout + done.stderr:
                raise ClusterError(f"{' '.join(command)} failed: {(done.stderr or done.stdout).strip()}")

    def _start_database(self, owner: str, port: int) -> None:
        directory = self.directory
        mariadb = self._launch("mariadbd", [mariadbd(), *MARIADB_OPTIONS, f"--datadir={directory}/mariadb",
                                            "--bind-address=127.0.0.1", f"--port={port + MARIADB_PORT}",
                                            f"--socket={directory}/run/mariadb.sock",
                                            f"--pid-file={directory}/run/mariadb.pid",
                                            f"--log-error={directory}/log/mariadb.log"], owner)
        ping = ["mariadb-admin", "--no-defaults", f"--socket={directory}/run/mariadb.sock", "--user=root", "ping"]
        self._wait_until(lambda: subprocess.run(ping, capture_output=True, check=False).returncode == 0,
                         mariadb, "MariaDB", 30)
        dbd = self._launch("slurmdbd", ["slurmdbd", "-D"], owner)
        self._wait_until(lambda: not _port_free(port + SLURMDBD_PORT), dbd, "slurmdbd", 30)

    def _wait_until(self, ready, pid: int, name: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if not is_running(pid):
                raise ClusterError(f"{name} ended at start")
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not ready within {seconds:.0f} s")
            time.sleep(0.05)

    def wait_for_idle_nodes(self, seconds: float) -> None:
        """Poll until every node is idle (they register within about a second)."""
        deadline, states = time.monotonic() + seconds, ""
        while time.monotonic() < deadline:
            states = self.slurm("sinfo", "--noheader", "--Node", "--format=%N %t").stdout
            idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
            if idle == set(self.node_names):
                return
            if not self.running():
                break
            time.sleep(0.1)
        raise ClusterError(f"nodes not idle within {seconds:.0f} s; sinfo says: {' | '.join(states.split(chr(10)))}")

    def log_tails(self, lines: int = 8) -> str:
        text = []
        for log in sorted((self.directory / "log").glob("*")):
            if log.is_file() and log.stat().st_size:
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                text.append(f"\n---- {log} (last lines)\n" + "\n".join(tail))
        return "".join(text)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, keep_logs: bool = False, also: set[int] = frozenset()) -> None:
        """Cancel every job and let it end, stop every daemon (munged last), delete the directory.

        ``also``: more processes to end after the daemons (a cluster left behind: its jobs).
        """
        pids = self.daemon_pids()
        if is_running(pids.get("slurmctld", 0)):
            # Running job steps survive a killed slurmd: cancel every job first and let them end.
            self.slurm("scancel", "--full", "--quiet", "--user=root")
            deadline = time.monotonic() + 10
            while self.slurm("squeue", "--noheader", "--states=RUNNING,COMPLETING", "--format=%i").stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        # slurmctld hands its last job records to slurmdbd as it stops, slurmdbd writes them to MariaDB.
        last = ("slurmdbd", "mariadbd", "munged")
        slurm = {pid for name, pid in pids.items() if name not in last and is_running(pid)}
        terminate(slurm, 20)
        terminate({pid for pid in also if is_running(pid)}, 10)
        for name in last:
            if is_running(pids.get(name, 0)):
                terminate({pids[name]}, 10)
        remove_host_entries(self.directory)
        if keep_logs:  # the marker stays, so the next start in this directory may clear it
            for path in self.directory.iterdir():
                if path.name not in ("log", MARKER):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            say(f"logs kept in {self.directory}/log")
        else:
            shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def stop_left_behind() -> list[RunningCluster]:
        """Stop every test cluster whose run has ended without stopping it (killed, timed out)."""
        stopped = []
        for cluster in running_clusters().values():
            if not cluster.left_behind:
                continue
            pid = cluster.owner.partition(":")[0]
            say(f"stopping a test cluster left behind in {cluster.directory} by a run that ended (pid {pid})")
            jobs = descendants(cluster.pids)  # slurmstepd and the jobs' processes below them
            testbed = Testbed(cluster.directory, nodes=1)
            if testbed.is_ours():
                testbed.stop(also=jobs)
            else:  # its directory is gone: no configuration to talk to it with, so end its processes
                terminate(jobs, 10)
            stopped.append(cluster)
        return stopped


def mariadbd() -> str:
    return shutil.which("mariadbd") or "/usr/sbin/mariadbd"


def _version(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = re.search(r"(?:Ver |slurm-wlm )(\S+)", done.stdout)
    return match[1] if match else "unknown"


def accounting_cache() -> Path:
    """Where the database of a registered test cluster is kept, per MariaDB and Slurm version."""
    mariadb, slurm = _version([mariadbd(), "--version"]), _version(["slurmctld", "-V"])
    return MARIADB_CACHE / f"accounting-mariadb-{mariadb}-slurm-{slurm}"


def pristine_mariadb_datadir() -> Path:
    """A fresh MariaDB data directory (root without a password over TCP from 127.0.0.1), made once per
    MariaDB version under :data:`MARIADB_CACHE`, where clusters copy it from. Made in a temporary
    directory beside it and renamed, so two clusters starting at once never see half of one."""
    target = MARIADB_CACHE / f"mariadb-{_version([mariadbd(), '--version'])}"
    if (target / "mysql").is_dir():
        return target
    MARIADB_CACHE.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=MARIADB_CACHE))
    say(f"creating a pristine MariaDB data directory in {target} (once per MariaDB version)")
    done = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={building}/data",
                           "--auth-root-authentication-method=normal", "--skip-test-db", *MARIADB_OPTIONS[1:]],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise ClusterError(f"mariadb-install-db failed: {tail}")
    try:
        (building / "data").rename(target)
    except OSError:  # another cluster made it first
        pass
    shutil.rmtree(building, ignore_errors=True)
    return target


def check_node_list(text: str) -> list[tuple[str, int]]:
    """``a100:8,v100:16`` as [("a100", 8), ("v100", 16)]."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+:\d+(,[A-Za-z0-9_.-]+:\d+)*", text):
        raise ClusterError(f"GPUs must look like a100:8,v100:16, got '{text}'")
    return [(model, int(count)) for model, count in (item.split(":") for item in text.split(","))]
