"""Render a course sbatch template for one cluster ("site"): a file ready to submit, in one step.

    python scripts/render_sbatch.py --site lanta slurm/examples/hello.sbatch.j2 -o hello.sbatch
    python scripts/render_sbatch.py --site lanta TEMPLATE.j2 --set account=lt200123 --set nodes=2
    python scripts/render_sbatch.py --list-sites
    python scripts/render_sbatch.py --all-sites build/sbatch labs chapters slurm/examples
    python scripts/render_sbatch.py --write-committed   # refresh the plain .sbatch files in the repository
    sbatch hello.sbatch          # from the repository root: jobs start where sbatch was called

A template's first block says what the job needs (nodes, GPUs per node, time ...); the site profile
(slurm/sites/NAME.yaml) says what the cluster has. A request the site cannot satisfy (more GPUs per
node than the partition has, a GPU model it lacks, an unknown partition) fails here on one line,
not hours later in the queue. The template contract and the profile format: slurm/sites/README.md.

This script must not import torch (tests call ``main(argv)`` in-process).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jinja2
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python scripts/render_sbatch.py` from a checkout without install
    sys.path.insert(0, str(REPO_ROOT))

from common.errors import UserError, run_main  # noqa: E402

SITES_DIR = REPO_ROOT / "slurm" / "sites"
TEMPLATE_SUFFIX = ".j2"
FOLDER_PATTERN = ".sbatch.j2"  # what --all-sites picks up in a folder (not, e.g., report.html.j2)
PLACEHOLDER = "edit-me"  # a site value starting with this must be replaced before a real submission
#: Templates whose rendering for a site is also committed next to them, for READMEs that say
#: `sbatch sbatch/single_gpu.sbatch`: template -> site. `--write-committed` refreshes them and
#: tests/test_render_sbatch.py fails when one differs from a fresh rendering.
COMMITTED_RENDERINGS = {
    "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch.j2": "generic",
    "chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch.j2": "generic",
}
JOB_BLOCK = re.compile(r"\A\{#-?\s*\n?(?P<body>job:.*?)-?#\}", re.DOTALL)

#: Keys a template's job block (and --set) may use, with what each means.
JOB_KEYS = {
    "name": "job name (default: the template's file name without .sbatch.j2)",
    "kind": "cpu or gpu: picks the site's default partition for that kind (default: gpu when GPUs are asked for)",
    "partition": "a partition of the site (default: the site's default partition for the kind)",
    "nodes": "number of nodes (default: 1)",
    "ntasks_per_node": "processes per node that srun starts, or 'gpus' for one per GPU (default: 1)",
    "gpus_per_node": "GPUs per node (default: 1 for gpu jobs, 0 for cpu jobs)",
    "gpu_type": "GPU model, e.g. a100 (default: any model the partition has)",
    "cpus_per_task": "CPU cores per process (default: the site's CPUs per GPU share, or 1 for cpu jobs)",
    "mem": "memory per node, e.g. 32G (default: the site's default, no --mem line)",
    "time": "wall-clock limit, e.g. 00:10:00 or 1-00:00:00 (default: 00:10:00)",
    "constraint": "node feature for --constraint (default: none)",
    "account": "project charged for the job (default: the site's account)",
    "reservation": "reservation to run in (default: the site's reservation)",
    "output": "log file pattern (default: %x-%j.out, i.e. <job name>-<job id>.out)",
    "sites": "only render for these sites in --all-sites mode (default: every site)",
}


# ---------------------------------------------------------------------------------------------
# YAML without YAML 1.1's base-60 integers: `time: 10:00` stays the text "10:00", not 600.

class _Loader(yaml.SafeLoader):
    pass


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)


def load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{where}{line}: not valid YAML: {problem}") from None


# ---------------------------------------------------------------------------------------------
# Slurm's time and memory formats

_TIME = re.compile(r"^(?:(?P<days>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")


def time_to_seconds(text: str) -> int:
    """Slurm's --time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    match = _TIME.match(str(text).strip())
    if not match:
        raise ValueError(f"not a Slurm time: {text!r} (use e.g. 00:30:00 or 1-00:00:00)")
    parts = [int(part) for part in match["rest"].split(":")]
    if match["days"] is not None:
        days = int(match["days"])
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        days, (hours, minutes, seconds) = 0, parts
    else:  # MM or MM:SS
        days, hours, (minutes, seconds) = 0, 0, (parts + [0])[:2]
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


_MEMORY = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?)B?$", re.IGNORECASE)
_MB_PER_UNIT = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}


def memory_to_mb(text: str | int) -> int:
    """Slurm's --mem formats: 4000 (MB), 500M, 32G, 1T."""
    match = _MEMORY.match(str(text).strip())
    if not match:
        raise ValueError(f"not a Slurm memory size: {text!r} (use e.g. 32G or 8000M)")
    return int(float(match["number"]) * _MB_PER_UNIT[match["unit"].upper()])


# ---------------------------------------------------------------------------------------------
# Site profiles

@dataclass(frozen=True)
class Partition:
    name: str
    description: str
    cpus_per_node: int
    mem_per_node: str | None
    gpus_per_node: int
    gpu_types: tuple[str, ...]
    gpu_memory: str | None
    typed_gres: bool
    cpus_per_gpu: int | None
    features: tuple[str, ...]
    max_time: str | None

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "gpu_types": list(self.gpu_types), "features": list(self.features)}


@dataclass(frozen=True)
class Site:
    name: str
    title: str
    source: str
    account: str | None
    account_required: bool
    reservation: str | None
    max_time: str
    default_partitions: dict[str, str]
    partitions: dict[str, Partition]
    setup: tuple[str, ...]
    path: Path

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "title": self.title, "source": self.source,
            "account": self.account, "account_required": self.account_required,
            "reservation": self.reservation, "max_time": self.max_time,
            "default_partitions": dict(self.default_partitions),
            "partitions": {name: part.as_dict() for name, part in self.partitions.items()},
            "setup": list(self.setup),
        }


SITE_KEYS = {"name", "title", "source", "account", "account_required", "reservation", "max_time",
             "default_partitions", "partitions", "setup", "notes"}
PARTITION_KEYS = {"description", "cpus_per_node", "mem_per_node", "gpus_per_node", "gpu_types",
                  "gpu_memory", "typed_gres", "cpus_per_gpu", "features", "max_time"}


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _check_keys(mapping: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def _whole(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{where} must be a whole number >= {minimum}, got {value!r}")
    return value


def _text_or_none(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return str(value)
    raise UserError(f"{where} must be text or null, got {value!r}")


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise UserError(f"{where} must be a list of names, e.g. [a100], got {value!r}")
    return tuple(value)


def _checked_time(value: Any, where: str) -> str:
    try:
        time_to_seconds(str(value))
    except ValueError as err:
        raise UserError(f"{where}: {err}") from None
    return str(value)


def _parse_partition(name: str, data: Any, where: str) -> Partition:
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping of partition fields")
    _check_keys(data, PARTITION_KEYS, where)
    if "cpus_per_node" not in data:
        raise UserError(f"{where}: cpus_per_node is required")
    gpus = _whole(data.get("gpus_per_node", 0), f"{where}.gpus_per_node")
    mem = _text_or_none(data.get("mem_per_node"), f"{where}.mem_per_node")
    if mem is not None:
        try:
            memory_to_mb(mem)
        except ValueError as err:
            raise UserError(f"{where}.mem_per_node: {err}") from None
    cpus_per_gpu = data.get("cpus_per_gpu")
    if gpus and cpus_per_gpu is None:
        raise UserError(f"{where}: a partition with GPUs needs cpus_per_gpu")
    max_time = data.get("max_time")
    return Partition(
        name=name,
        description=str(data.get("description") or name),
        cpus_per_node=_whole(data["cpus_per_node"], f"{where}.cpus_per_node", 1),
        mem_per_node=mem,
        gpus_per_node=gpus,
        gpu_types=_string_list(data.get("gpu_types"), f"{where}.gpu_types"),
        gpu_memory=_text_or_none(data.get("gpu_memory"), f"{where}.gpu_memory"),
        typed_gres=bool(data.get("typed_gres", False)),
        cpus_per_gpu=None if cpus_per_gpu is None else _whole(cpus_per_gpu, f"{where}.cpus_per_gpu", 1),
        features=_string_list(data.get("features"), f"{where}.features"),
        max_time=None if max_time is None else _checked_time(max_time, f"{where}.max_time"),
    )


def load_site(path: Path) -> Site:
    """Read and check one site profile; every problem names the file and the field."""
    where = _display(path)
    data = load_yaml(path.read_text(encoding="utf-8"), where)
    if not isinstance(data, dict):
        raise UserError(f"{where}: a site profile is a mapping (name:, partitions: ...)")
    _check_keys(data, SITE_KEYS, where)
    for key in ("name", "partitions", "default_partitions", "max_time"):
        if key not in data:
            raise UserError(f"{where}: '{key}' is required")
    if data["name"] != path.stem:
        raise UserError(f"{where}: name is {data['name']!r} but must match the file name {path.stem!r}")
    if not isinstance(data["partitions"], dict) or not data["partitions"]:
        raise UserError(f"{where}: partitions must map partition names to their sizes")
    partitions = {str(name): _parse_partition(str(name), part, f"{where}: partitions.{name}")
                  for name, part in data["partitions"].items()}
    defaults = data["default_partitions"]
    if not isinstance(defaults, dict) or set(defaults) != {"cpu", "gpu"}:
        raise UserError(f"{where}: default_partitions must name a partition for cpu and for gpu jobs")
    for kind, name in defaults.items():
        if name not in partitions:
            raise UserError(f"{where}: default_partitions.{kind} is {name!r}, which is not in partitions")
    if partitions[defaults["gpu"]].gpus_per_node == 0:
        raise UserError(f"{where}: default_partitions.gpu names {defaults['gpu']!r}, which has no GPUs")
    setup = data.get("setup") or []
    if not isinstance(setup, list) or not all(isinstance(line, str) for line in setup):
        raise UserError(f"{where}: setup must be a list of shell lines")
    return Site(
        name=data["name"],
        title=str(data.get("title") or data["name"]),
        source=str(data.get("source") or ""),
        account=_text_or_none(data.get("account"), f"{where}: account"),
        account_required=bool(data.get("account_required", False)),
        reservation=_text_or_none(data.get("reservation"), f"{where}: reservation"),
        max_time=_checked_time(data["max_time"], f"{where}: max_time"),
        default_partitions=dict(defaults),
        partitions=partitions,
        setup=tuple(setup),
        path=path,
    )


def site_names(sites_dir: Path = SITES_DIR) -> list[str]:
    return sorted(path.stem for path in sites_dir.glob("*.yaml"))


def load_sites(sites_dir: Path = SITES_DIR) -> dict[str, Site]:
    return {name: load_site(sites_dir / f"{name}.yaml") for name in site_names(sites_dir)}


def find_site(name: str, sites_dir: Path = SITES_DIR) -> Site:
    path = sites_dir / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(site_names(sites_dir)) or "none"
        raise UserError(f"unknown site {name!r} (known sites: {known}; add slurm/sites/{name}.yaml)")
    return load_site(path)


# ---------------------------------------------------------------------------------------------
# Templates: the job block, the request checked against the site, the rendered script

@dataclass(frozen=True)
class Template:
    path: Path
    request: dict[str, Any]  # the job block, before --set


def read_template(path: Path) -> Template:
    where = _display(path)
    if not path.is_file():
        raise UserError(f"{where}: no such template")
    match = JOB_BLOCK.match(path.read_text(encoding="utf-8"))
    if not match:
        raise UserError(f"{where}: a template must start with its job block, e.g. '{{# job:' ... '#}}' "
                        "(see slurm/sites/README.md)")
    data = load_yaml(match["body"], f"{where} (job block)")
    request = data.get("job") if isinstance(data, dict) else None
    if request is None:
        request = {}
    if not isinstance(request, dict):
        raise UserError(f"{where}: the job block must map keys to values, e.g. 'nodes: 2'")
    _check_keys(request, set(JOB_KEYS), f"{where}: job block")
    return Template(path=path, request=request)


def parse_settings(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set key=value`` pairs; values are read as YAML (numbers stay numbers, null clears)."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--set {pair!r}: expected key=value, e.g. --set nodes=2")
        if key not in JOB_KEYS:
            raise UserError(f"--set {key}: unknown key (known: {', '.join(JOB_KEYS)})")
        settings[key] = load_yaml(value, f"--set {key}") if value.strip() else None
    return settings


def template_stem(path: Path) -> str:
    name = path.name.removesuffix(TEMPLATE_SUFFIX)
    return name.removesuffix(".sbatch").removesuffix(".sh")


def resolve_job(site: Site, request: dict[str, Any], default_name: str) -> dict[str, Any]:
    """Fill the request's defaults from the site and check that the site can run it."""
    def whole(key: str, default: int, minimum: int) -> int:
        value = request.get(key)
        return default if value is None else _whole(value, key, minimum)

    gpus_asked = request.get("gpus_per_node")
    kind = request.get("kind") or ("gpu" if gpus_asked else "cpu")
    if kind not in ("cpu", "gpu"):
        raise UserError(f"kind must be cpu or gpu, got {kind!r}")
    partition_name = request.get("partition") or site.default_partitions[kind]
    partition = site.partitions.get(str(partition_name))
    if partition is None:
        raise UserError(f"site {site.name} has no partition {partition_name!r} "
                        f"(it has: {', '.join(site.partitions)})")
    where = f"site {site.name}, partition {partition.name}"

    nodes = whole("nodes", 1, 1)
    gpus_per_node = whole("gpus_per_node", 1 if kind == "gpu" else 0, 0)
    if gpus_per_node > partition.gpus_per_node:
        has = f"has {partition.gpus_per_node} per node" if partition.gpus_per_node else "has no GPUs"
        raise UserError(f"the job asks for {gpus_per_node} GPU(s) per node but {where} {has}")
    # `ntasks_per_node: gpus` (one process per GPU, as srun-launched DDP needs) follows
    # gpus_per_node, so `--set gpus_per_node=2` resizes such a job in one setting.
    if request.get("ntasks_per_node") == "gpus":
        if gpus_per_node == 0:
            raise UserError("ntasks_per_node is 'gpus' (one process per GPU) but the job asks for no GPUs")
        ntasks_per_node = gpus_per_node
    else:
        ntasks_per_node = whole("ntasks_per_node", 1, 1)

    gpu_type = request.get("gpu_type")
    if gpu_type is not None:
        gpu_type = str(gpu_type)
        if gpus_per_node == 0:
            raise UserError(f"gpu_type {gpu_type!r} is set but the job asks for no GPUs")
        if gpu_type not in partition.gpu_types:
            models = ", ".join(partition.gpu_types) or "no named models"
            raise UserError(f"the job asks for {gpu_type} GPUs but {where} has {models}")

    share = (partition.cpus_per_gpu or 0) * gpus_per_node // ntasks_per_node
    cpus_per_task = whole("cpus_per_task", max(1, share) if gpus_per_node else 1, 1)
    cpus_per_node = cpus_per_task * ntasks_per_node
    if cpus_per_node > partition.cpus_per_node:
        raise UserError(f"the job asks for {cpus_per_node} CPUs per node ({ntasks_per_node} task(s) x "
                        f"{cpus_per_task}) but {where} has {partition.cpus_per_node}")
    if gpus_per_node and partition.cpus_per_gpu and cpus_per_node > partition.cpus_per_gpu * gpus_per_node:
        raise UserError(f"the job asks for {cpus_per_node} CPUs per node with {gpus_per_node} GPU(s) but "
                        f"{where} allows {partition.cpus_per_gpu} CPUs per GPU")

    mem = _text_or_none(request.get("mem"), "mem")
    if mem is not None:
        try:
            mem_mb = memory_to_mb(mem)
        except ValueError as err:
            raise UserError(f"mem: {err}") from None
        if partition.mem_per_node is not None and mem_mb > memory_to_mb(partition.mem_per_node):
            raise UserError(f"the job asks for {mem} of memory per node but {where} has {partition.mem_per_node}")

    time = str(request.get("time") or "00:10:00")
    limit = partition.max_time or site.max_time
    try:
        seconds = time_to_seconds(time)
    except ValueError as err:
        raise UserError(f"time: {err}") from None
    if seconds > time_to_seconds(limit):
        raise UserError(f"the job asks for time {time} but {where} allows at most {limit}")

    constraint = request.get("constraint")
    if constraint is not None and str(constraint) not in partition.features:
        features = ", ".join(partition.features) or "none"
        raise UserError(f"the job asks for feature {constraint!r} but {where} has features: {features}")

    account = _text_or_none(request.get("account", site.account), "account")
    if site.account_required and not account:
        raise UserError(f"site {site.name} needs an account: pass --set account=YOUR_PROJECT")
    reservation = _text_or_none(request.get("reservation", site.reservation), "reservation")

    if gpus_per_node == 0:
        gres = ""
    elif gpu_type is not None and partition.typed_gres:
        gres = f"gpu:{gpu_type}:{gpus_per_node}"
    else:
        gres = f"gpu:{gpus_per_node}"

    job = {
        "name": str(request.get("name") or default_name),
        "kind": kind,
        "partition": partition.name,
        "nodes": nodes,
        "ntasks_per_node": ntasks_per_node,
        "ntasks": nodes * ntasks_per_node,
        "gpus_per_node": gpus_per_node,
        "gpus": nodes * gpus_per_node,
        "gpu_type": gpu_type,
        "gres": gres,
        "cpus_per_task": cpus_per_task,
        "cpus_per_node": cpus_per_node,
        "mem": mem,
        "time": time,
        "constraint": None if constraint is None else str(constraint),
        "account": account,
        "reservation": reservation,
        "output": str(request.get("output") or "%x-%j.out"),
    }
    job["sbatch"] = sbatch_directives(site, partition, job)
    return job


def committed_path(template: str) -> Path:
    """Where the committed rendering of ``template`` (a repository path ending in .j2) lives."""
    return REPO_ROOT / template.removesuffix(TEMPLATE_SUFFIX)


def committed_text(template: str) -> str:
    """The committed rendering of ``template``: its rendering for its site, marked as generated."""
    site_name = COMMITTED_RENDERINGS[template]
    text, _ = render(read_template(REPO_ROOT / template), find_site(site_name))
    shebang, _, rest = text.partition("\n")
    note = (f"# Generated from {Path(template).name} for site '{site_name}' by "
            "`python scripts/render_sbatch.py --write-committed`:\n"
            "# change the template, not this file. Lines marked \"edit me\" are for your cluster.\n")
    return f"{shebang}\n{note}{rest}"


def write_committed() -> list[Path]:
    """Write the committed rendering of every template in COMMITTED_RENDERINGS beside it."""
    return [write_script(committed_path(template), committed_text(template)) for template in COMMITTED_RENDERINGS]


def write_script(path: Path, text: str) -> Path:
    """Write an executable script whole: a temporary file renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.chmod(0o755)
    temporary.replace(path)  # never a half-written script
    return path


def _gpu_words(partition: Partition, job: dict[str, Any]) -> str:
    model = job["gpu_type"] or (partition.gpu_types[0] if len(partition.gpu_types) == 1 else None)
    what = f"{model.upper()} GPU(s)" if model else "GPU(s)"
    return f"{job['gpus_per_node']} {what} per node"


def sbatch_directives(site: Site, partition: Partition, job: dict[str, Any]) -> str:
    """The job's ``#SBATCH`` lines, each with a comment saying what it asks for."""
    lines: list[tuple[str, str]] = [
        (f"--job-name={job['name']}", "name shown by squeue and used in the log file name"),
        (f"--partition={job['partition']}", partition.description),
    ]
    if job["account"]:
        note = f" (edit me: your {site.name} project)" if job["account"].startswith(PLACEHOLDER) else ""
        lines.append((f"--account={job['account']}", f"project charged for the job{note}"))
    if job["reservation"]:
        lines.append((f"--reservation={job['reservation']}", "run in this reservation (a class's reserved nodes)"))
    lines += [
        (f"--nodes={job['nodes']}", "number of nodes"),
        (f"--ntasks-per-node={job['ntasks_per_node']}", "processes per node that srun starts"),
        (f"--cpus-per-task={job['cpus_per_task']}", "CPU cores per process: threads and DataLoader workers"),
    ]
    if job["gres"]:
        lines.append((f"--gres={job['gres']}", _gpu_words(partition, job)))
    if job["constraint"]:
        lines.append((f"--constraint={job['constraint']}", "only nodes with this feature"))
    if job["mem"]:
        lines.append((f"--mem={job['mem']}", "memory per node"))
    lines += [
        (f"--time={job['time']}", "wall-clock limit: the job is stopped after this"),
        (f"--output={job['output']}", "log file (%x = job name, %j = job id), stdout and stderr"),
    ]
    width = max(len(directive) for directive, _ in lines) + len("#SBATCH ") + 2
    return "\n".join(f"{('#SBATCH ' + directive).ljust(width)}# {comment}" for directive, comment in lines)


def preamble(site: Site) -> str:
    """What every job does after its #SBATCH lines: strict mode, repository root, site setup, header."""
    setup = "\n".join(f"    {line}" for line in site.setup) or "    :  # this site needs no setup"
    return f"""set -euo pipefail

# Jobs start in the directory sbatch was called from; what follows runs from the repository root:
# $HPC_DL_LABS_ROOT when set, else the nearest folder upwards that holds slurm/lib/job_header.sh
# (so `cd chapters/ch04_deep_learning && sbatch sbatch/single_gpu.sbatch` works too).
cd "${{HPC_DL_LABS_ROOT:-${{SLURM_SUBMIT_DIR:-.}}}}"
while [[ ! -f slurm/lib/job_header.sh && "$PWD" != / ]]; do
    cd ..
done
if [[ ! -f slurm/lib/job_header.sh ]]; then
    echo "error: submitted from outside the hpc-dl-labs repository; submit from inside it or set HPC_DL_LABS_ROOT" >&2
    exit 2
fi

# Software environment on {site.title}.
# Skipped when HPC_DL_LABS_SKIP_MODULES=1 (the CI test cluster, whose Python is already on PATH).
# conda and some module systems read unset variables, hence `set +u` around them.
# shellcheck disable=SC1091  # files sourced here exist only on that cluster
if [[ "${{HPC_DL_LABS_SKIP_MODULES:-0}}" != 1 ]]; then
    set +u
{setup}
    set -u
fi

# Prints the host, date and SLURM_* variables; exports MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS,
# NUM_WORKERS, NPROC_PER_NODE, DEVICE (cuda, or cpu when the GPUs are not real), TINY_ARGS and
# RESULTS_DIR (see the header of that file).
# shellcheck source=slurm/lib/job_header.sh
source slurm/lib/job_header.sh"""


def _environment(template_path: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(template_path.parent), str(REPO_ROOT)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - shell scripts, not HTML
    )


def _template_line(err: BaseException, template_path: Path) -> str:
    """The template line a Jinja error happened on, as ':LINE' (empty when unknown)."""
    line = getattr(err, "lineno", None)
    if line is None:
        frames = [frame for frame in traceback.extract_tb(err.__traceback__)
                  if Path(frame.filename).name == template_path.name]
        line = frames[-1].lineno if frames else None
    return f":{line}" if line else ""


def render(template: Template, site: Site, settings: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Render ``template`` for ``site``; return the script and the resolved job."""
    where = _display(template.path)
    request = {**template.request, **(settings or {})}
    try:
        job = resolve_job(site, request, template_stem(template.path))
    except UserError as err:
        raise UserError(f"{where} for site {site.name}: {err}") from None
    context = {"site": site.as_dict(), "job": job, "preamble": preamble(site)}
    try:
        text = _environment(template.path).get_template(template.path.name).render(context)
    except jinja2.UndefinedError as err:
        raise UserError(f"{where}{_template_line(err, template.path)}: undefined variable: {err.message} "
                        "(templates get site.*, job.* and preamble; see slurm/sites/README.md)") from None
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"{where}:{err.lineno}: template syntax error: {err.message}") from None
    except jinja2.TemplateError as err:
        raise UserError(f"{where}{_template_line(err, template.path)}: {err}") from None
    if not text.startswith("#!"):
        raise UserError(f"{where}: the rendered script must start with '#!/bin/bash' right after the job block")
    return text, job


# ---------------------------------------------------------------------------------------------
# Many templates for every site (what CI submits), and what the test cluster must provide

def find_templates(paths: Sequence[Path]) -> list[tuple[Path, Path]]:
    """(template, where its rendering goes below OUT_DIR/<site>/) for files and folders of templates.

    Inside the repository a rendering keeps the template's repository path; elsewhere, its path
    below the folder that was named (or its file name).
    """
    found: list[tuple[Path, Path]] = []
    for path in paths:
        if path.is_dir():
            templates = sorted(p for p in path.rglob(f"*{FOLDER_PATTERN}") if p.is_file())
            base = path.resolve().parent
        elif path.is_file():
            templates, base = [path], path.resolve().parent
        else:
            raise UserError(f"{path}: no such file or directory")
        for template in templates:
            resolved = template.resolve()
            inside = REPO_ROOT in resolved.parents
            relative = resolved.relative_to(REPO_ROOT if inside else base)
            found.append((template, relative.with_name(relative.name.removesuffix(TEMPLATE_SUFFIX))))
    return found


def render_all(paths: Sequence[Path], out_dir: Path, settings: dict[str, Any],
               sites: dict[str, Site]) -> tuple[list[dict[str, Any]], list[str]]:
    """Render every template under ``paths`` for every site into ``out_dir/<site>/...``.

    Returns the manifest entries and the errors (one line each); nothing is written when any
    template fails, so a half-rendered folder is never submitted.
    """
    templates = [(read_template(path), relative) for path, relative in find_templates(paths)]
    if not templates:
        raise UserError(f"no *{FOLDER_PATTERN} templates under {', '.join(map(str, paths))}")
    entries, errors, outputs = [], [], []
    for template, relative in templates:
        only = template.request.get("sites")
        if only is not None and not (isinstance(only, list) and set(only) <= set(sites)):
            errors.append(f"{_display(template.path)}: 'sites' must list known sites ({', '.join(sites)})")
            continue
        for site in sites.values():
            if only is not None and site.name not in only:
                continue
            try:
                text, job = render(template, site, settings)
            except UserError as err:
                errors.append(str(err))
                continue
            target = out_dir / site.name / relative
            outputs.append((target, text))
            entries.append({"site": site.name, "template": _display(template.path),
                            "script": str(Path(site.name) / relative),
                            "job": {key: value for key, value in job.items() if key != "sbatch"}})
    if not errors:
        for target, text in outputs:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            target.chmod(0o755)
        (out_dir / "manifest.json").write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
    return entries, errors


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Render a course sbatch template (Jinja2) for one cluster's site profile.",
        epilog="Template contract and site profile format: slurm/sites/README.md",
    )
    parser.add_argument("templates", nargs="*", type=Path, metavar="TEMPLATE",
                        help="a *.sbatch.j2 template; with --all-sites, templates or folders (default: none)")
    parser.add_argument("--site", help="site profile name, see --list-sites (default: none)")
    parser.add_argument("-o", "--output", type=Path,
                        help="write the script here instead of printing it (default: standard output)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job block value, e.g. --set nodes=2 --set account=lt200123 "
                             f"(keys: {', '.join(JOB_KEYS)}) (default: none)")
    parser.add_argument("--list-sites", action="store_true", help="list the site profiles and exit (default: off)")
    parser.add_argument("--all-sites", type=Path, metavar="OUT_DIR",
                        help="render every *.sbatch.j2 under TEMPLATE folders (and TEMPLATE files) for every site into "
                             "OUT_DIR/<site>/<path> plus OUT_DIR/manifest.json (default: off)")
    parser.add_argument("--write-committed", action="store_true",
                        help="refresh the committed renderings (" + ", ".join(
                            f"{t.removesuffix(TEMPLATE_SUFFIX)} for {s}" for t, s in COMMITTED_RENDERINGS.items())
                        + ") (default: off)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_sites:
        for site in load_sites().values():
            parts = ", ".join(
                f"{p.name} ({p.gpus_per_node}x {'/'.join(p.gpu_types) or 'GPU'})" if p.gpus_per_node else p.name
                for p in site.partitions.values())
            print(f"{site.name:16s} {site.title}\n{'':16s} partitions: {parts}")
        return 0
    if args.write_committed:
        for path in write_committed():
            print(f"wrote {_display(path)}")
        return 0
    settings = parse_settings(args.settings)
    if args.all_sites is not None:
        if args.site or args.output:
            raise UserError("--all-sites renders for every site into OUT_DIR: drop --site and --output")
        if not args.templates:
            raise UserError("--all-sites needs template files or folders after it")
        entries, errors = render_all(args.templates, args.all_sites, settings, load_sites())
        if errors:
            for line in errors[:-1]:
                print(f"error: {line}", file=sys.stderr)
            raise UserError(f"{errors[-1]} ({len(errors)} template/site pair(s) failed; nothing written)")
        print(f"rendered {len(entries)} script(s) into {args.all_sites} (list: {args.all_sites / 'manifest.json'})")
        return 0
    if not args.site:
        raise UserError("choose a site with --site NAME (see --list-sites)")
    if len(args.templates) != 1:
        raise UserError("give exactly one TEMPLATE (or use --all-sites OUT_DIR with folders)")
    site = find_site(args.site)
    text, job = render(read_template(args.templates[0]), site, settings)
    for key in ("account", "reservation"):
        if str(job[key] or "").startswith(PLACEHOLDER):
            print(f"warning: {key} is the placeholder {job[key]!r}: pass --set {key}=... or edit "
                  f"{_display(site.path)} before submitting", file=sys.stderr)
    if args.output:
        if args.output.is_dir():
            raise UserError(f"-o {args.output}: is a folder; give a file name")
        write_script(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    run_main(main)
