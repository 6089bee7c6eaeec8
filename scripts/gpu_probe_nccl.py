#!/usr/bin/env python3
"""What this PyTorch's NCCL does that a CPU cannot show: the GPU proof's ``nccl_flight_recorder`` check.

    python scripts/gpu_probe_nccl.py recorder FACTS.json   # which variable sizes the recorder, which dump reads it
    python scripts/gpu_probe_nccl.py watchdog FACTS.json   # a rank whose collective never finishes: what ends it

Each probe runs its rank in a child process (a one-rank NCCL group on this machine's first GPU) and
merges what it found into ``FACTS.json``:

- ``recorder``: for each of the flight recorder's variables (``common.runtime.compat``) set alone, how
  many of three all-reduces each dump function returns; and which timeout call this release has.
- ``watchdog``: a GPU kernel that spins for 30 s holds the stream, so an all-reduce queued behind it
  cannot finish within the group's 5 s timeout. Lab-06 catches a timeout as a Python exception on
  Gloo; the probe records whether NCCL's watchdog ends the process first (its exit status, after how
  long, whether Python's ``except`` ran) and whether it wrote its recorder's dump on the way
  (``TORCH_NCCL_DUMP_ON_TIMEOUT``), so Lab-06 can say what a student will see on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401 - a PyTorch older than the course's floor stops here, in one line
from common.cli import output_file, script_parser

RANK = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
store = dist.TCPStore("127.0.0.1", 0, 1, True)
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=5),
                        device_id=torch.device("cuda", 0))
x = torch.ones(1 << 10, device="cuda")
dist.all_reduce(x); torch.cuda.synchronize()
if sys.argv[1] == "recorder":
    dist.all_reduce(x); dist.all_reduce(x); torch.cuda.synchronize()
    counts = {}
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        try:
            counts[name] = len(json.loads(getattr(c10d, name)(True, False)).get("entries", []))
        except Exception as error:
            counts[name] = f"{type(error).__name__}: {str(error)[:120]}"
    print("COUNTS " + json.dumps(counts), flush=True)
else:
    torch.cuda._sleep(int(6e10))  # about 30 s of a spinning kernel on the stream the all-reduce waits for
    began = time.perf_counter()
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        print("finished after %.1f s" % (time.perf_counter() - began), flush=True)
    except Exception as error:
        print("PYTHON CAUGHT %s: %s" % (type(error).__name__, str(error)[:200]), flush=True)
dist.destroy_process_group()
"""


def child(mode: str, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, float]:
    began = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", RANK, mode], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - began
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else \
            (expired.stdout or "")
        return None, out, time.perf_counter() - began


def recorder() -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from common.runtime.compat import FLIGHT_RECORDER_BUFFER_VARIABLES, paths

    # paths(): which spelling of each release difference this PyTorch gets (compat.GPU_ONLY lists them).
    facts: dict = {"torch": torch.__version__, "set_timeout": hasattr(dist, "set_timeout"),
                   "_set_pg_timeout": hasattr(distributed_c10d, "_set_pg_timeout"), "dumps": {},
                   "compat": paths()}
    clean = {k: v for k, v in os.environ.items() if k not in FLIGHT_RECORDER_BUFFER_VARIABLES}
    for variable in FLIGHT_RECORDER_BUFFER_VARIABLES:
        status, output, _ = child("recorder", {**clean, variable: "64"}, 120)
        line = next((line for line in output.splitlines() if line.startswith("COUNTS ")), None)
        facts["dumps"][variable] = json.loads(line[7:]) if line else f"exit {status}: {output[-300:]}"
    return facts


def watchdog() -> dict:
    folder = Path(tempfile.mkdtemp(prefix="nccl-watchdog-"))
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_TRACE_BUFFER_SIZE": "64",
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(folder / "fr_"),
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder / "fr_")}
    # On the H100 (2026-11-26) the stalled rank ended after 74.6 s: its start, the 5 s timeout and about a minute
    # of the watchdog writing its dump. 150 s leaves room for a start beside three other checks (--jobs 4).
    status, output, seconds = child("watchdog", env, 150)
    caught = next((line for line in output.splitlines() if line.startswith("PYTHON CAUGHT")), None)
    return {"watchdog": {"exit_status": status, "ended_within_s": None if status is None else round(seconds, 1),
                         "python_except_ran": caught, "dump_files": sorted(p.name for p in folder.iterdir()),
                         "last_lines": output.strip().splitlines()[-6:]}}


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("probe", choices=("recorder", "watchdog"), help="what to find out")
    parser.add_argument("facts", type=output_file, help="the JSON file the findings are merged into")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # each probe's rank would fail on its first CUDA call: say so once, write nothing
        parser.error("NCCL needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False)")
    path = args.facts
    facts = json.loads(path.read_text()) if path.is_file() else {}
    facts.update(recorder() if args.probe == "recorder" else watchdog())
    path.write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
