"""Results outside the range the course teaches, as warnings a student can act on: DDP should scale almost linearly
on one node, and DataParallel on several GPUs should at least beat one GPU. A warning is not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from common.precision import BF16_EMULATION_PREFIX

#: DDP below this scaling efficiency is flagged (the Lab-01 handout's 4-GPU run reached 94%).
DDP_MIN_EFFICIENCY = 0.80
DDP_METHODS_PREFIX = "ddp"
DP_METHODS = ("dp", "dataparallel")


@dataclass(frozen=True)
class Finding:
    """One warning: what it is about (a run id or a file name) and what is wrong, in words."""

    subject: str
    message: str


def _describe(run: Mapping[str, Any]) -> str:
    parts = [run["lab"], run["model"], run["device_type"], run["machine"]]
    return ", ".join(str(p) for p in parts if isinstance(p, str))


def is_ddp(method: object) -> bool:
    return isinstance(method, str) and (method == DDP_METHODS_PREFIX or method.startswith(("ddp-", "ddp_")))


def out_of_range(runs: pd.DataFrame) -> list[Finding]:
    """Runs that did not finish, bf16 runs on a CPU that emulates bf16, DDP runs below
    :data:`DDP_MIN_EFFICIENCY`, DP runs slower than baseline."""
    findings = []
    for run in runs.to_dict("records"):
        subject = f"run {run['run_id']} ({run['lab']} {run['method']})"
        if run["status"] != "ok":
            reason = f": {run['notes'][0]}" if run["notes"] else ""
            findings.append(Finding(subject, f"status is '{run['status']}'{reason}"))
            continue
        for note in run["notes"]:
            if note.startswith(BF16_EMULATION_PREFIX):  # its bf16 timing is not what bf16 hardware does
                findings.append(Finding(subject, note))
        efficiency = run["scaling_efficiency"]
        # DDP on CPU: the "devices" are processes sharing one machine's cores, so the GPU expectation
        # does not apply; the Lab-01 section explains the number instead of flagging it.
        if (is_ddp(run["method"]) and run["device_type"] != "cpu" and pd.notna(efficiency)
                and efficiency < DDP_MIN_EFFICIENCY):
            findings.append(Finding(subject, (
                f"DDP scaling efficiency {efficiency:.0%} on {run['devices']} devices is under the expected "
                f"{DDP_MIN_EFFICIENCY:.0%} ({_describe(run)})")))
        # DataParallel on one device (the CPU case) is the baseline plus overhead; only a
        # multi-device DP run is expected to be faster.
        speedup = run["speedup"]
        if run["method"] in DP_METHODS and run["devices"] > 1 and pd.notna(speedup) and speedup < 1:
            findings.append(Finding(subject, (
                f"DataParallel on {run['devices']} devices is slower than the single-device baseline "
                f"({run['samples_per_s']:,.1f} vs {run['baseline_samples_per_s']:,.1f} samples/s; {_describe(run)})")))
    return findings


def mixed_machines(runs: pd.DataFrame) -> list[Finding]:
    """One warning when the runs come from several machines: their numbers do not compare."""
    machines = sorted({str(m) for m in runs["machine"].dropna()})
    if len(machines) < 2:
        return []
    return [Finding(f"{len(machines)} machines", (
        "this report mixes records of different machines (" + "; ".join(machines) + "): compare a number only "
        "with numbers of the same machine (the summary's machine column); speed-ups and efficiencies are "
        "computed within one machine"))]


def missing_baselines(runs: pd.DataFrame) -> list[str]:
    """Comparison groups with multi-device runs but no baseline to compute an efficiency from."""
    lacking = runs[(runs["devices"] > 1) & runs["baseline_samples_per_s"].isna()]
    return sorted({_describe(run) for run in lacking.to_dict("records")})
