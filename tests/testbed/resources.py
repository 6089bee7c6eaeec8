"""What the test cluster's nodes claim: enough that a job rendered for any site profile fits.

Every partition name of every site (all on the same nodes; generic's ``cpu`` first, the default
partition), the largest CPU count and memory of any partition, every GPU model with the largest
count per node any site has, the GPU models and the sites' features as node features, and every
site's reservation. Slurm enforces none of it here: the nodes claim far more cores than this
machine has, so Slurm starts every job at once and the test code decides how many run together.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.slurm.sites import Site, load_sites, memory_to_mb


@dataclass(frozen=True)
class NodeResources:
    """What each emulated node claims (``slurm.conf``, ``gres.conf``, reservations)."""

    partitions: tuple[str, ...]          # the first is the default partition
    gpus: tuple[tuple[str, int], ...]    # (model, count per node), e.g. (("a100", 8), ("v100", 16))
    features: tuple[str, ...] = ()
    reservations: tuple[str, ...] = ()
    accounts: tuple[str, ...] = ()       # accounts jobs may name (--account), for root (with accounting)
    cpus: int = 64
    mem_mb: int = 512_000

    def __post_init__(self) -> None:
        if not self.partitions:
            raise ValueError("the nodes need at least one partition")
        if not self.gpus or any(count < 1 for _, count in self.gpus):
            raise ValueError(f"every GPU model needs a count of at least 1, got {self.gpus}")
        if self.cpus < 1 or self.mem_mb < 1:
            raise ValueError(f"CPUs and memory must be positive, got {self.cpus} and {self.mem_mb}")


def for_sites(sites: dict[str, Site] | None = None) -> NodeResources:
    """What the nodes must claim so that every site's partitions, GPUs, features and limits fit."""
    sites = load_sites() if sites is None else sites
    partitions: list[str] = []
    gpus: dict[str, int] = {}
    features: list[str] = []
    reservations: list[str] = []
    accounts: list[str] = []
    cpus = mem_mb = 1
    untyped_gpus = 0
    for site in sorted(sites.values(), key=lambda site: site.name != "generic"):  # generic's 'cpu' first
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
        if getattr(site, "account", None) and site.account not in accounts:
            accounts.append(site.account)
    if untyped_gpus and sum(gpus.values()) < untyped_gpus:  # --gres=gpu:N takes GPUs of any model
        first = next(iter(gpus), "a100")
        gpus[first] = max(gpus.get(first, 0), untyped_gpus)
    return NodeResources(partitions=tuple(partitions), gpus=tuple(gpus.items()) or (("a100", 4),),
                         features=tuple(features), reservations=tuple(reservations), accounts=tuple(accounts),
                         cpus=cpus, mem_mb=mem_mb)
