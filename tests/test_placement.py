"""common.runtime.placement: cores, the GPU's NUMA node and DataLoader workers, against a fake sysfs tree."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from common.runtime.placement import (check_placement, cpu_list, gpu_numa_node, numa_nodes, parse_cpu_list,
                              placement_lines, record_placement)

BUS = "0000:3b:00.0"


def _sysfs(root: Path, nodes: dict[int, str], gpu_node: int | None) -> Path:
    for node, cpus in nodes.items():
        folder = root / "devices/system/node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus + "\n")
    if gpu_node is not None:
        device = root / "bus/pci/devices" / BUS
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{gpu_node}\n")
    return root


@pytest.mark.parametrize("text", ["0", "0-3", "0-3,8,10-11", "1,3,5"])
def test_cpu_lists_round_trip(text):
    assert cpu_list(parse_cpu_list(text)) == text


def test_two_sockets_read_from_sysfs(tmp_path):
    root = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=1)
    assert numa_nodes(root) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert gpu_numa_node(BUS.upper(), root) == 1  # NVML spells bus ids in capitals
    assert gpu_numa_node("0000:af:00.0", root) is None


def test_a_rank_on_the_gpus_socket_with_enough_cores_has_no_warning(tmp_path):
    root = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=1)
    info = check_placement("cuda:0", 3, sysfs=root, cpus=[4, 5, 6, 7], bus_id=BUS, rank=2)
    assert info["numa_match"] is True and info["cpus_on_gpu_numa_node"] == 4 and info["warnings"] == []
    assert (info["cpus"], info["cpu_numa_nodes"], info["gpu_numa_node"], info["rank"]) == ("4-7", [1], 1, 2)
    assert placement_lines(info) == ["placement: cores 4-7 (4, NUMA 1) | GPU cuda:0 0000:3b:00.0 NUMA 1: same node "
                                     "| DataLoader workers 3"]


def test_cores_on_the_other_socket_and_too_many_workers_are_warned(tmp_path):
    root = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=1)
    info = check_placement("cuda:0", 4, sysfs=root, cpus=[0], bus_id=BUS, rank=0)
    assert info["numa_match"] is False and info["cpus_on_gpu_numa_node"] == 0
    other_socket, workers = info["warnings"]
    assert "are on NUMA node(s) 0, its GPU 0000:3b:00.0 on node 1" in other_socket
    assert "4 DataLoader workers but this rank owns 1 core(s) (0)" in workers and "SRUN_CPUS_PER_TASK" in workers
    lines = placement_lines(info)
    assert "MISMATCH" in lines[0] and lines[1].startswith("WARNING placement: all 1 of this rank's cores")
    half = check_placement("cuda:0", 0, sysfs=root, cpus=[2, 3, 4, 5], bus_id=BUS, rank=0)
    assert half["warnings"] == ["only 2 of this rank's 4 cores are on its GPU's NUMA node 1 "
                                "(srun --gpu-bind=closest)"]


def test_unknown_gpu_numa_node_is_not_a_mismatch(tmp_path):
    root = _sysfs(tmp_path, {0: "0-7"}, gpu_node=-1)  # one-socket machines and most VMs write -1
    info = check_placement("cuda:0", 2, sysfs=root, cpus=range(8), bus_id=BUS, rank=0)
    assert info["gpu_numa_node"] is None and info["numa_match"] is None and info["warnings"] == []
    assert "NUMA node unknown" in placement_lines(info)[0]


def test_record_placement_on_this_machine_prints_a_tagged_line_and_returns_one_entry_per_rank():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        placement = record_placement("cpu", 0)
    (info,) = placement
    assert info["device"] == "cpu" and info["cpu_count"] >= 1 and info["gpu_bus_id"] is None
    assert out.getvalue().startswith("[") and "] placement: cores " in out.getvalue()
