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

Written for Debian 12's Slurm 22.05 and munge 0.5. Needs root (slurmd runs jobs as any user, the
fake GPUs are device nodes, ``/etc/hosts`` gets the node names).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed.resources import NodeResources

DEFAULT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "hpc-dl-labs-slurm"
MARKER = ".hpc-dl-labs-testbed"            # a directory holding this file is a cluster's, ours to delete
DIR_VARIABLE = "HPC_DL_LABS_TESTBED_DIR"    # in every daemon's environment: its cluster's directory
OWNER_VARIABLE = "HPC_DL_LABS_TESTBED_OWNER"  # "<pid>:<start time>" of the run that owns it, or ""
FIRST_PORT, PORT_BLOCK, PORT_BLOCKS = 16817, 8, 100  # slurmctld on a block's first port, slurmds after it
HOSTS_TAG = "# added by hpc-dl-labs slurm testbed"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
MAX_NODES = 4


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


def free_port_block(nodes: int) -> int:
    """The first port of a block whose ports (slurmctld, then one per slurmd) are all free."""
    for block in range(PORT_BLOCKS):
        first = FIRST_PORT + block * PORT_BLOCK
        if all(_port_free(port) for port in range(first, first + 1 + nodes)):
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

def install_packages() -> None:
    missing = [cmd for cmd in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(cmd) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"Slurm is not installed (missing: {' '.join(missing)}) and installing it needs root")
    if shutil.which("apt-get") is None:
        raise ClusterError(f"Slurm is not installed (missing: {' '.join(missing)}) and there is no apt-get")
    say(f"installing {' '.join(PACKAGES)} with apt-get (missing: {' '.join(missing)})")
    began = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-10:])
            raise ClusterError(f"{' '.join(command)} failed: {tail}")
    say(f"installed in {time.monotonic() - began:.1f} s")


# ---------------------------------------------------------------------------------------------
# One cluster

class Testbed:
    """The test cluster living in ``directory``, with emulated nodes n1..nN."""

    def __init__(self, directory: Path = DEFAULT_DIR, nodes: int = 2) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be 1 to {MAX_NODES}, got {nodes}")
        self.directory = Path(directory).absolute()
        self.nodes = nodes

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
        install_packages()
        began = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o711)  # munged insists that everyone may traverse its socket's directory
        (self.directory / MARKER).touch()
        port = free_port_block(self.nodes)
        self.write_config(resources, port)
        add_host_entries(self.directory, self.node_names)
        try:
            self.start_daemons(owner_token(owner) if owner else "")
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
        say(f"{self.nodes} node(s) idle in {time.monotonic() - began:.1f} s on ports {port}-{port + self.nodes}: "
            f"partitions {partitions}")
        say(f"GPUs per node: {','.join(f'{m}:{n}' for m, n in resources.gpus)}; features: "
            f"{','.join(resources.features) or 'none'}; reservations: {','.join(resources.reservations) or 'none'}")
        return left_behind

    def write_config(self, resources: NodeResources, port: int) -> None:
        directory, host = self.directory, socket.gethostname().split(".")[0]
        for sub in ("log", "state", "spool", "tmp", "dev", "pids"):
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
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
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

    def _launch(self, name: str, command: list[str], owner: str) -> int:
        """Start a daemon in its own session, output to its log; record its pid under ``name``."""
        env = {**os.environ, DIR_VARIABLE: str(self.directory), OWNER_VARIABLE: owner}
        with open(self.directory / "log" / f"{name}.out", "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        process.returncode = 0  # reaped by is_running(); no "still running" warning when this object goes
        (self.directory / "pids" / name).write_text(f"{process.pid}\n")
        return process.pid

    def start_daemons(self, owner: str) -> None:
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
        self._launch("slurmctld", ["slurmctld", "-D", "-f", str(self.slurm_conf)], owner)
        for node in self.node_names:
            self._launch(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.slurm_conf), "-N", node], owner)

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
        slurm = {pid for name, pid in pids.items() if name != "munged" and is_running(pid)}
        terminate(slurm, 20)
        terminate({pid for pid in also if is_running(pid)}, 10)
        if is_running(pids.get("munged", 0)):
            terminate({pids["munged"]}, 10)
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


def check_node_list(text: str) -> list[tuple[str, int]]:
    """``a100:8,v100:16`` as [("a100", 8), ("v100", 16)]."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+:\d+(,[A-Za-z0-9_.-]+:\d+)*", text):
        raise ClusterError(f"GPUs must look like a100:8,v100:16, got '{text}'")
    return [(model, int(count)) for model, count in (item.split(":") for item in text.split(","))]
