"""common.measure.energy: every source's logic on CPU, against a fake NVML, a fake RAPL tree and a fake sstat.

This machine has no GPU, no /sys/class/powercap and no Slurm job around the tests, so the real
sources all say ``unavailable``; the fakes below exercise what they do where they can read.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from common.measure import energy
from common.measure.energy import EnergyMeter, EnergyUnavailable, NvmlSource, RaplSource, SlurmSource, combine
from common.results import make_record, validate_record
from helpers import wait_for


# --- NVML ------------------------------------------------------------------------------------------

class FakeNvml:
    """What NvmlSource calls of pynvml; counters in millijoules, one list of readings per bus id."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's own name
        pass

    def __init__(self, readings: dict[str, list[int]], init_error: Exception | None = None) -> None:
        self.readings = {bus: list(values) for bus, values in readings.items()}
        self.init_error = init_error
        self.initialised = 0

    def nvmlInit(self):  # noqa: N802
        if self.init_error:
            raise self.init_error
        self.initialised += 1

    def nvmlShutdown(self):  # noqa: N802
        self.initialised -= 1

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):  # noqa: N802
        if bus_id not in self.readings:
            raise self.NVMLError("Not Found")
        return bus_id

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):  # noqa: N802
        values = self.readings[handle]
        if values and values[0] is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return values.pop(0)


class Cuda:
    type = "cuda"


def _nvml(fake, bus="0000:3b:00.0", device=None):
    return NvmlSource(Cuda() if device is None else device, nvml=fake, bus_id=lambda device: bus)


@pytest.mark.parametrize("device", [Cuda(), "cuda:0", "cuda"], ids=["torch.device", "cuda:0", "cuda"])
def test_nvml_counts_the_millijoules_its_gpu_used_between_start_and_end(device):
    fake = FakeNvml({"0000:3b:00.0": [1_000_000, 1_250_500]})
    source = _nvml(fake, device=device)
    source.begin()
    assert source.end() == pytest.approx(250.5)
    assert fake.initialised == 0  # NVML shut down again
    assert source.key.endswith("/0000:3b:00.0")


@pytest.mark.parametrize(("fake", "device", "reason"), [
    (FakeNvml({}), "cpu", "no GPU in this run"),
    (FakeNvml({}), "cudax", "no GPU in this run"),
    (FakeNvml({}, init_error=FakeNvml.NVMLError("Driver Not Loaded")), Cuda(),
     "NVML did not start (Driver Not Loaded)"),
    (FakeNvml({"0000:3b:00.0": [None]}), Cuda(), "has no energy counter (NVML needs Volta or newer)"),
    (FakeNvml({"0000:af:00.0": [1]}), Cuda(), "NVML could not read the GPU at 0000:3b:00.0"),
])
def test_nvml_says_why_it_cannot_measure(fake, device, reason):
    source = NvmlSource(device, nvml=fake, bus_id=lambda device: "0000:3b:00.0")
    with pytest.raises(EnergyUnavailable, match=r".*" + reason.replace("(", r"\(").replace(")", r"\)")):
        source.begin()
    assert fake.initialised == 0


def test_nvml_missing_package_is_unavailable_not_an_import_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    with pytest.raises(EnergyUnavailable, match=r"nvidia-ml-py is not installed"):
        NvmlSource(Cuda(), bus_id=lambda device: "0000:3b:00.0").begin()


# --- RAPL ------------------------------------------------------------------------------------------

def _rapl_tree(root: Path, packages: dict[str, tuple[int, int]], extra: bool = True) -> Path:
    """``intel-rapl:N`` folders with name, energy_uj, max_energy_range_uj; plus a sub-domain and psys."""
    for index, (name, (value, wrap)) in enumerate(packages.items()):
        folder = root / f"intel-rapl:{index}"
        folder.mkdir(parents=True)
        (folder / "name").write_text(name + "\n")
        (folder / "energy_uj").write_text(f"{value}\n")
        (folder / "max_energy_range_uj").write_text(f"{wrap}\n")
    if extra:  # must not be counted: a core sub-domain (inside its package) and the platform domain
        (root / "intel-rapl:0:0").mkdir()
        (root / "intel-rapl:0:0" / "name").write_text("core\n")
        psys = root / f"intel-rapl:{len(packages)}"
        psys.mkdir()
        for file, text in (("name", "psys"), ("energy_uj", "5"), ("max_energy_range_uj", "100")):
            (psys / file).write_text(text + "\n")
    return root


def _set(root: Path, domain: int, value: int) -> None:
    """A new counter value, written atomically as sysfs shows it (the poll thread may read at any time)."""
    path = root / f"intel-rapl:{domain}" / "energy_uj"
    path.with_suffix(".new").write_text(f"{value}\n")
    path.with_suffix(".new").replace(path)


def test_rapl_adds_up_the_packages_and_handles_a_wrap(tmp_path):
    wrap = 1_000_000_000
    root = _rapl_tree(tmp_path, {"package-0": (999_000_000, wrap), "package-1": (10, wrap)})
    source = RaplSource(root, poll_s=0)
    source.begin()
    assert [name for name, _, _ in source.domains] == ["package-0", "package-1"]  # psys and core left out
    _set(root, 0, 500)        # wrapped: 1_000_000 µJ to the top, then 500
    _set(root, 1, 2_000_010)  # +2 J
    assert source.end() == pytest.approx((1_000_000 + 500 + 2_000_000) / 1e6)


def test_rapl_polls_while_the_region_runs_so_two_wraps_are_both_counted(tmp_path):
    wrap = 1_000
    root = _rapl_tree(tmp_path, {"package-0": (900, wrap)}, extra=False)
    source = RaplSource(root, poll_s=0.01)
    source.begin()
    assert any(t.name == "hpc-dl-labs-rapl" for t in threading.enumerate())
    for value in (100, 950, 50):  # +200, +850, +100: two wraps a single end reading could not see
        _set(root, 0, value)
        wait_for(lambda: source._last == [value], timeout=10, what=f"the RAPL thread to read {value}")
    assert source.end() == pytest.approx(1150 / 1e6)
    assert not any(t.name == "hpc-dl-labs-rapl" for t in threading.enumerate())


def test_rapl_says_why_it_cannot_measure(tmp_path, monkeypatch):
    with pytest.raises(EnergyUnavailable, match=r"does not exist: no RAPL interface on this machine"):
        RaplSource(tmp_path / "powercap").begin()
    (tmp_path / "empty").mkdir()
    with pytest.raises(EnergyUnavailable, match=r"no CPU package domain"):
        RaplSource(tmp_path / "empty").begin()
    root = _rapl_tree(tmp_path / "locked", {"package-0": (1, 10**9)}, extra=False)
    real_read_text = Path.read_text

    def root_only(path, *args, **kwargs):  # the tests run as root, so chmod 000 would not stop a read
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", root_only)
    with pytest.raises(EnergyUnavailable, match=r"energy_uj is readable by root only"):
        RaplSource(root, poll_s=0).begin()


# --- Slurm -----------------------------------------------------------------------------------------

def _sstat(*outputs: str, returncode: int = 0, stderr: str = ""):
    calls = []

    def run(command):
        calls.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout=outputs[min(len(calls), len(outputs)) - 1],
                                           stderr=stderr)
    return run, calls


def _slurm(run, **env):
    return SlurmSource({"SLURM_JOB_ID": "42", **env}, run=run, which=lambda name: "/usr/bin/" + name)


def test_slurm_reads_the_steps_consumed_energy_before_and_after():
    run, calls = _sstat("1000\n", "1600\n")
    source = _slurm(run, SLURM_STEP_ID="3")
    source.begin()
    assert source.end() == 600
    assert calls[0] == ["sstat", "--noheader", "--parsable2", "--format=ConsumedEnergyRaw", "-j", "42.3"]
    batch, calls = _sstat("5\n", "9\n")
    source = _slurm(batch)  # python run straight from the batch script: the batch step
    source.begin()
    assert source.end() == 4 and calls[0][-1] == "42.batch"


@pytest.mark.parametrize(("outputs", "returncode", "reason"), [
    (("0\n", "0\n"), 0, "this cluster does not gather energy"),
    (("700\n", "700\n"), 0, "did not grow during the"),
    (("\n",), 0, "printed nothing"),
    (("n/a\n",), 0, "not a number of joules"),
    (("",), 1, "sstat -j 42.0 failed: sstat: error: no steps running"),
])
def test_slurm_says_why_it_cannot_measure(outputs, returncode, reason):
    run, _ = _sstat(*outputs, returncode=returncode, stderr="sstat: error: no steps running\n")
    source = _slurm(run, SLURM_STEP_ID="0")
    with pytest.raises(EnergyUnavailable, match=reason):
        source.begin()
        source.end()


def test_slurm_outside_a_job_or_without_sstat():
    with pytest.raises(EnergyUnavailable, match="not inside a Slurm job"):
        SlurmSource({}).begin()
    with pytest.raises(EnergyUnavailable, match="sstat is not on PATH"):
        SlurmSource({"SLURM_JOB_ID": "1"}, which=lambda name: None).begin()


# --- the meter and the record ----------------------------------------------------------------------

class Fixed:
    """A source that measured ``joules`` (or could not, with ``reason``)."""

    def __init__(self, name, joules=None, reason=None, key="k"):
        self.name, self.joules, self.reason, self.key = name, joules, reason, key

    def begin(self):
        if self.reason:
            raise EnergyUnavailable(self.reason)

    def end(self):
        return self.joules


def test_meter_adds_gpu_and_cpu_and_keeps_slurm_separate():
    meter = EnergyMeter(sources=[Fixed("nvml", 30.0), Fixed("rapl", 10.0), Fixed("slurm", 55.0)])
    with meter:
        pass
    entry = meter.result(samples=8)
    assert entry["status"] == "ok" and entry["source"] == "nvml+rapl"
    assert entry["joules"] == 40.0 and entry["joules_per_sample"] == 5.0
    assert entry["sources"]["slurm"] == {"status": "ok", "joules": 55.0, "counters": 1}
    assert entry["seconds"] >= 0 and entry["watts"] > 0


def test_meter_falls_back_to_slurm_and_otherwise_says_unavailable_with_every_reason():
    only_slurm = EnergyMeter(sources=[Fixed("nvml", reason="no GPU in this run"), Fixed("slurm", 12.0)]).start()
    entry = only_slurm.result(samples=None)
    assert (entry["status"], entry["source"], entry["joules"]) == ("ok", "slurm", 12.0)
    assert entry["joules_per_sample"] is None
    none = EnergyMeter(sources=[Fixed("nvml", reason="no GPU in this run"), Fixed("rapl", reason="no RAPL")]).start()
    entry = none.result(samples=4)
    assert entry["status"] == "unavailable" and entry["joules"] is None
    assert entry["reason"] == "nvml: no GPU in this run; rapl: no RAPL"
    record = make_record(lab="x", script="s", method="m", config={}, metrics={}, provenance={}, energy=entry)
    assert validate_record(record) == []


def test_a_meter_adds_up_a_region_that_comes_in_pieces():
    fake = FakeNvml({"0000:3b:00.0": [1_000, 3_000, 10_000, 10_500]})  # two laps: 2 J and 0.5 J
    meter = EnergyMeter(sources=[_nvml(fake), Fixed("rapl", reason="no RAPL")])
    for _ in range(2):
        with meter:
            pass
    entry = meter.result(samples=5)
    assert entry["joules"] == pytest.approx(2.5) and entry["joules_per_sample"] == pytest.approx(0.5)
    assert entry["sources"]["rapl"]["status"] == "unavailable"


def test_combine_counts_a_counter_read_by_several_ranks_once():
    def rank(nvml_key, rapl_key):
        return {"seconds": 2.0, "readings": {"nvml": {"status": "ok", "joules": 100.0, "key": nvml_key},
                                             "rapl": {"status": "ok", "joules": 40.0, "key": rapl_key}}}
    # Four ranks on two nodes, each with its own GPU: 4 GPUs, 2 nodes' packages.
    ranks = [rank(f"n{r // 2}/gpu{r % 2}", f"n{r // 2}/rapl") for r in range(4)]
    entry = combine(ranks, samples=100)
    assert entry["sources"]["nvml"] == {"status": "ok", "joules": 400.0, "counters": 4}
    assert entry["sources"]["rapl"] == {"status": "ok", "joules": 80.0, "counters": 2}
    assert entry["joules"] == 480.0 and entry["joules_per_sample"] == 4.8 and entry["watts"] == 240.0
    ranks[3]["readings"]["nvml"] = {"status": "unavailable", "reason": "NVML could not read the GPU at the end"}
    assert combine(ranks)["sources"]["nvml"]["status"] == "unavailable"  # a partial sum would be a guess


def test_on_this_machine_the_real_sources_say_why_they_are_unavailable(monkeypatch):
    """What the course's CPU runs record here: no GPU, and (on this CI machine) no RAPL, no Slurm job."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    meter = EnergyMeter("cpu")
    assert [type(s).__name__ for s in meter.sources] == ["NvmlSource", "RaplSource", "SlurmSource"]
    with meter:
        sum(range(1000))
    entry = meter.result(samples=10)
    assert entry["sources"]["nvml"] == {"status": "unavailable", "reason": "no GPU in this run"}
    assert entry["sources"]["slurm"] == {"status": "unavailable", "reason": "not inside a Slurm job"}
    if not energy.POWERCAP.is_dir():
        assert entry["status"] == "unavailable" and "no RAPL interface on this machine" in entry["reason"]


def test_a_version_2_record_needs_an_energy_entry_that_is_a_number_or_a_reason():
    def record(energy, version=2):
        made = make_record(lab="x", script="s", method="m", config={}, metrics={}, provenance={},
                           energy={"status": "unavailable", "reason": "r"})
        made["schema_version"] = version
        if energy is None:
            del made["energy"]
        else:
            made["energy"] = energy
        return made

    assert validate_record(record(None)) == ["missing key 'energy'"]
    assert validate_record(record(None, version=1)) == []  # written before energy was measured
    assert validate_record(record("12 J")) == ["key 'energy' should be dict"]
    assert validate_record(record({"status": "guessed", "joules": 3.0}))[0].startswith("energy.status is 'guessed'")
    assert "not a number of joules" in validate_record(record({"status": "ok", "joules": -1.0}))[0]
    assert "not a number of joules" in validate_record(record({"status": "ok", "joules": True}))[0]
    assert validate_record(record({"status": "unavailable", "reason": ""})) == [
        "energy.status is 'unavailable' without a reason"]
    assert validate_record(record({"status": "ok", "joules": 0.5})) == []
