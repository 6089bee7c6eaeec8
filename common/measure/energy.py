"""What a run cost in energy, from whatever the machine can tell, and ``unavailable`` with the reason otherwise.

    meter = EnergyMeter(device)
    with meter:                              # every rank: start the counters ...
        ... the timed region ...             # ... stop them on the way out (also on an error)
    energy = meter.result(samples=n)         # every rank calls it (it gathers); the record's `energy`

Three sources, each read at the start and the end of the region (never estimated):

- **NVML** (``nvidia-ml-py``, imported lazily as ``pynvml``): the GPU's total-energy counter
  (``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver loaded; Volta and newer).
  Each rank reads its own GPU, found by PCI bus id so ``CUDA_VISIBLE_DEVICES`` cannot confuse it.
- **RAPL** (``/sys/class/powercap/intel-rapl:N/energy_uj``): the CPU packages of the node, read on
  local rank 0 only (the counter is the node's, not a process's). The counter wraps at
  ``max_energy_range_uj`` (about 262 kJ on most Intel CPUs: under 20 minutes at 250 W), so it is
  also read every ``RAPL_POLL_S`` seconds by a small thread and the wraps are added back. Linux lets only root read
  it since 5.10 (CVE-2020-8694), so on most clusters it is unreadable: the record says so.
- **Slurm** (``sstat --format=ConsumedEnergyRaw``): the job step's energy as Slurm accounts it,
  read on global rank 0, where the cluster gathers energy (``AcctGatherEnergyType``). It updates
  only every ``AcctGatherNodeFreq`` seconds, so a short region often shows no change: the record
  then says that instead of 0 J. After the job, ``sacct -j JOBID --format=JobID,ConsumedEnergy``.

The total (``joules``) is NVML + RAPL where either worked (GPUs + CPU packages; they do not
overlap), else Slurm's figure; ``sources`` keeps every source's own result or reason. The result
is a plain dict for ``common.results.make_record(energy=...)``; the schema is in
``docs/results-schema.md``.

This module does not import torch at import time (the record tools and the tests use it without).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["EnergyMeter", "EnergyUnavailable", "NvmlSource", "RaplSource", "SlurmSource", "not_measured",
           "combine", "POWERCAP", "RAPL_POLL_S", "SLURM_TIMEOUT_S", "SOURCE_NAMES"]

POWERCAP = Path("/sys/class/powercap")
#: Seconds between RAPL reads while a region runs (a counter wraps after minutes at full power).
RAPL_POLL_S = 20.0
SLURM_TIMEOUT_S = 15.0
#: Sources in the order they are listed; the first two add up to the total.
SOURCE_NAMES = ("nvml", "rapl", "slurm")


class EnergyUnavailable(Exception):
    """A source cannot measure here; the message says why, for the record."""


def _unavailable(reason: str) -> dict[str, Any]:
    return {"status": "unavailable", "reason": reason}


def not_measured(reason: str = "this script does not measure energy") -> dict[str, Any]:
    """The ``energy`` entry of a record whose script measured nothing (never a guessed number)."""
    return {"status": "unavailable", "joules": None, "reason": reason, "sources": {}}


# --- NVML: the GPU's energy counter ---------------------------------------------------------------

def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise EnergyUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    return pynvml


def _gpu_bus_id(device: Any) -> str:
    from common.runtime.placement import gpu_pci_bus_id

    return gpu_pci_bus_id(device)


class NvmlSource:
    """This rank's GPU through NVML's total-energy counter (millijoules)."""

    name = "nvml"

    def __init__(self, device: Any, *, nvml: Any = None, bus_id: Callable[[Any], str] = _gpu_bus_id) -> None:
        self.device = device
        self._nvml = nvml
        self._bus_id = bus_id
        self._handle = None
        self._start_mj: float | None = None
        self.key = ""

    def begin(self) -> None:
        # A torch.device, or its name as text ("cuda:0", as Lab-01's environment check passes it).
        if getattr(self.device, "type", str(self.device).partition(":")[0]) != "cuda":
            raise EnergyUnavailable("no GPU in this run")
        nvml = self._nvml = self._nvml or _import_pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise EnergyUnavailable(f"NVML did not start ({err}): no NVIDIA driver visible to this process") from None
        bus_id = self._bus_id(self.device)
        self.key = f"{socket.gethostname()}/{bus_id.lower()}"
        try:
            self._handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            self._start_mj = float(nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except nvml.NVMLError as err:
            self._shutdown()
            if isinstance(err, getattr(nvml, "NVMLError_NotSupported", ())):
                raise EnergyUnavailable(f"the GPU at {bus_id} has no energy counter "
                                        "(NVML needs Volta or newer)") from None
            raise EnergyUnavailable(f"NVML could not read the GPU at {bus_id}: {err}") from None

    def end(self) -> float:
        nvml = self._nvml
        try:
            end_mj = float(nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except nvml.NVMLError as err:
            raise EnergyUnavailable(f"NVML could not read the GPU at the end: {err}") from None
        finally:
            self._shutdown()
        return (end_mj - self._start_mj) / 1000.0

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down must never cost the record
            pass


# --- RAPL: the CPU packages' energy counters -------------------------------------------------------

_PACKAGE_DOMAIN = re.compile(r"^intel-rapl:\d+$")


class RaplSource:
    """The node's CPU packages through the powercap RAPL interface (microjoules, wrapping)."""

    name = "rapl"

    def __init__(self, root: Path = POWERCAP, *, poll_s: float = RAPL_POLL_S) -> None:
        self.root = Path(root)
        self.poll_s = poll_s
        self.domains: list[tuple[str, Path, int]] = []  # (name, energy_uj file, wrap range)
        self._last: list[int] = []
        self._total_uj = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.key = f"{socket.gethostname()}/rapl"

    def _find_domains(self) -> list[tuple[str, Path, int]]:
        if not self.root.is_dir():
            raise EnergyUnavailable(f"{self.root} does not exist: no RAPL interface on this machine "
                                    "(a virtual machine, a container without it, or not an x86 CPU)")
        domains = []
        for folder in sorted(p for p in self.root.iterdir() if _PACKAGE_DOMAIN.match(p.name)):
            try:
                name = (folder / "name").read_text().strip()
                wrap = int((folder / "max_energy_range_uj").read_text().strip())
            except (OSError, ValueError) as err:
                raise EnergyUnavailable(f"{folder} is not readable: {err}") from None
            # "psys" (the whole platform, laptops) contains the packages: counting it too would double them.
            if not name.startswith("psys"):
                domains.append((name, folder / "energy_uj", wrap))
        if not domains:
            raise EnergyUnavailable(f"no CPU package domain (intel-rapl:N) under {self.root}")
        return domains

    def _read(self) -> list[int]:
        values = []
        for _, path, _ in self.domains:
            try:
                values.append(int(path.read_text().strip()))
            except PermissionError:
                raise EnergyUnavailable(f"{path} is readable by root only (Linux 5.10 and later, after "
                                        "CVE-2020-8694); ask the admins, or use Slurm's ConsumedEnergy") from None
            except (OSError, ValueError) as err:
                raise EnergyUnavailable(f"{path} could not be read: {err}") from None
        return values

    def poll(self) -> None:
        """Add what every counter moved since the last read, a wrap included."""
        values = self._read()
        with self._lock:
            for i, ((_, _, wrap), now) in enumerate(zip(self.domains, values)):
                before = self._last[i]
                self._total_uj += now - before if now >= before else now + wrap - before
            self._last = values

    def begin(self) -> None:
        self.domains = self._find_domains()
        self._last = self._read()
        self._total_uj = 0
        if self.poll_s > 0:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll_until_stopped, name="hpc-dl-labs-rapl", daemon=True)
            self._thread.start()

    def _poll_until_stopped(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except EnergyUnavailable:
                return  # end() reads again and reports it

    def end(self) -> float:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.poll()
        return self._total_uj / 1e6


# --- Slurm: the job step's accounted energy --------------------------------------------------------

def _run(command: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)


class SlurmSource:
    """The job step's ``ConsumedEnergyRaw`` from ``sstat`` (joules), where the cluster gathers energy."""

    name = "slurm"

    def __init__(self, env: Mapping[str, str] | None = None, *,
                 run: Callable[[Sequence[str]], subprocess.CompletedProcess] = _run,
                 which: Callable[[str], str | None] = shutil.which) -> None:
        self.env = os.environ if env is None else env
        self._run = run
        self._which = which
        self.step = ""
        self._start: float | None = None
        self._began = 0.0
        self.key = ""

    def _read(self) -> float:
        try:
            done = self._run(["sstat", "--noheader", "--parsable2", "--format=ConsumedEnergyRaw", "-j", self.step])
        except (OSError, subprocess.SubprocessError) as err:
            raise EnergyUnavailable(f"sstat did not answer: {err}") from None
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip().splitlines()
            raise EnergyUnavailable(f"sstat -j {self.step} failed: {message[0] if message else done.returncode}")
        values = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        if not values:
            raise EnergyUnavailable(f"sstat -j {self.step} printed nothing: Slurm keeps no energy for this step")
        try:
            return sum(float(value) for value in values)
        except ValueError:
            raise EnergyUnavailable(f"sstat -j {self.step} printed {values[0]!r}, not a number of joules") from None

    def begin(self) -> None:
        job = self.env.get("SLURM_JOB_ID")
        if not job:
            raise EnergyUnavailable("not inside a Slurm job")
        if self._which("sstat") is None:
            raise EnergyUnavailable("sstat is not on PATH")
        # Inside `srun` the process belongs to step SLURM_STEP_ID; run straight from the batch script, to "batch".
        self.step = f"{job}.{self.env.get('SLURM_STEP_ID') or 'batch'}"
        self.key = f"slurm/{self.step}"
        self._start = self._read()
        self._began = time.monotonic()

    def end(self) -> float:
        end = self._read()
        seconds = time.monotonic() - self._began
        if end == 0 and self._start == 0:
            raise EnergyUnavailable(f"Slurm reports ConsumedEnergy 0 for step {self.step}: this cluster does not "
                                    "gather energy (AcctGatherEnergyType is none)")
        if end <= self._start:
            raise EnergyUnavailable(f"ConsumedEnergy of step {self.step} did not grow during the {seconds:.0f} s "
                                    "region: Slurm samples energy every AcctGatherNodeFreq seconds; "
                                    "time a longer region")
        return end - self._start


# --- the meter --------------------------------------------------------------------------------------

def _launch() -> tuple[int, int]:
    from common.runtime.launch import detect_launch

    launch = detect_launch()
    return launch.rank, launch.local_rank


class EnergyMeter:
    """Reads every source this rank is responsible for at the start and end of a region.

    ``sources`` replaces the default set (tests pass fakes); by default a rank reads NVML for its
    own GPU, local rank 0 also RAPL, and global rank 0 also Slurm. A region may come in pieces:
    every ``with meter:`` (or ``start()`` ... ``stop()``) adds to the same totals, e.g. the epochs of
    one variant of a benchmark that interleaves several.
    """

    def __init__(self, device: Any = "cpu", *, sources: Sequence[Any] | None = None) -> None:
        if sources is None:
            rank, local_rank = _launch()
            sources = [NvmlSource(device)]
            if local_rank == 0:
                sources.append(RaplSource())
            if rank == 0:
                sources.append(SlurmSource())
        self.sources = list(sources)
        self._readings: dict[str, dict[str, Any]] = {}
        self._active: list[Any] = []
        self._started: float | None = None
        self.seconds: float | None = None

    def start(self) -> EnergyMeter:
        """Read every source's start value (a source that could not be read before stays unavailable)."""
        self._active = []
        for source in self.sources:
            if self._readings.get(source.name, {}).get("status") == "unavailable":
                continue
            try:
                source.begin()
            except EnergyUnavailable as why:
                self._readings[source.name] = _unavailable(str(why))
            else:
                self._active.append(source)
        self._started = time.perf_counter()
        return self

    def stop(self) -> EnergyMeter:
        """Read the end values and add them up (no communication; safe on an error path); idempotent."""
        if self._started is None:
            return self
        self.seconds = (self.seconds or 0.0) + time.perf_counter() - self._started
        self._started = None
        for source in self._active:
            try:
                joules = source.end()
            except EnergyUnavailable as why:
                self._readings[source.name] = _unavailable(str(why))
            else:
                before = self._readings.get(source.name, {}).get("joules", 0.0)
                self._readings[source.name] = {"status": "ok", "joules": before + joules, "key": source.key}
        self._active = []
        return self

    def __enter__(self) -> EnergyMeter:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def local_readings(self) -> dict[str, Any]:
        """This rank's readings (what :meth:`result` gathers): ``{"seconds", "readings": {source: ...}}``."""
        self.stop()
        return {"seconds": self.seconds, "readings": dict(self._readings)}

    def result(self, samples: int | None = None) -> dict[str, Any]:
        """The record's ``energy`` entry, over all ranks. Collective when a process group exists:
        every rank must call it."""
        local = self.local_readings()
        try:
            from common.runtime.distributed import gather_objects
        except ImportError:  # pragma: no cover - torch missing: one process
            gathered = [local]
        else:
            gathered = gather_objects(local)
        return combine(gathered, samples=samples)


def combine(per_rank: Sequence[Mapping[str, Any]], samples: int | None = None) -> dict[str, Any]:
    """Add up the ranks' readings into the record's ``energy`` entry.

    A counter read by several ranks (two ranks on one GPU, RAPL on one node) counts once (``key``).
    A source is ``ok`` when every rank that read it could; otherwise the first reason is kept.
    """
    sources: dict[str, dict[str, Any]] = {}
    for name in SOURCE_NAMES:
        readings = [rank["readings"][name] for rank in per_rank if name in rank.get("readings", {})]
        if not readings:
            continue
        failed = [r for r in readings if r["status"] != "ok"]
        if failed:
            sources[name] = _unavailable(failed[0]["reason"])
            continue
        unique = {r["key"]: r["joules"] for r in readings}
        sources[name] = {"status": "ok", "joules": sum(unique.values()), "counters": len(unique)}
    seconds = max((rank["seconds"] for rank in per_rank if rank.get("seconds") is not None), default=None)
    counted = [name for name in ("nvml", "rapl") if sources.get(name, {}).get("status") == "ok"]
    if not counted and sources.get("slurm", {}).get("status") == "ok":
        counted = ["slurm"]
    entry: dict[str, Any] = {"seconds": seconds, "samples": samples, "sources": sources}
    if not counted:
        reasons = "; ".join(f"{name}: {s['reason']}" for name, s in sources.items()) or "no source was read"
        return {"status": "unavailable", "joules": None, "reason": reasons, **entry}
    joules = sum(sources[name]["joules"] for name in counted)
    entry.update(joules_per_sample=joules / samples if samples else None,
                 watts=joules / seconds if seconds else None)
    return {"status": "ok", "joules": joules, "source": "+".join(counted), **entry}
