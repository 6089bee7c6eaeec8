"""What the CI test cluster's nodes must claim so every site's partitions, GPUs and limits fit.

Used only by ``render_sbatch.py --testbed-resources`` (which ``slurm/testbed/testbed.sh`` calls);
it belongs with the test cluster, not with the students' renderer.
"""

from __future__ import annotations

from common.sites import Site, memory_to_mb

__all__ = ["testbed_resources"]


def testbed_resources(sites: dict[str, Site]) -> dict[str, str]:
    """``key=value`` settings for testbed.sh: partitions, typed GPUs, features, reservations, sizes."""
    partitions: list[str] = []
    gpus: dict[str, int] = {}
    features: list[str] = []
    reservations: list[str] = []
    cpus = mem_mb = 1
    untyped_gpus = 0
    ordered = sorted(sites.values(), key=lambda site: site.name != "generic")  # generic's 'cpu' first
    for site in ordered:
        for kind in ("cpu", "gpu"):
            if site.default_partitions[kind] not in partitions:
                partitions.append(site.default_partitions[kind])
        for part in site.partitions.values():
            if part.name not in partitions:
                partitions.append(part.name)
            cpus = max(cpus, part.cpus_per_node)
            if part.mem_per_node:
                mem_mb = max(mem_mb, memory_to_mb(part.mem_per_node))
            for model in part.gpu_types:
                gpus[model] = max(gpus.get(model, 0), part.gpus_per_node)
            if not part.gpu_types:
                untyped_gpus = max(untyped_gpus, part.gpus_per_node)
            for name in (*part.features, *part.gpu_types):
                if name not in features:
                    features.append(name)
        if site.reservation and site.reservation not in reservations:
            reservations.append(site.reservation)
    if untyped_gpus and sum(gpus.values()) < untyped_gpus:
        first = next(iter(gpus), "a100")
        gpus[first] = max(gpus.get(first, 0), untyped_gpus)
    return {
        "partitions": ",".join(partitions),
        "gpus": ",".join(f"{model}:{count}" for model, count in gpus.items()),
        "features": ",".join(features),
        "reservations": ",".join(reservations),
        "cpus": str(cpus),
        "mem_mb": str(mem_mb),
    }
