"""What a job asks for, checked against what a site has.

A template starts with its job block, a Jinja comment holding YAML (``{# job: nodes: 2 ... #}``);
``--set key=value`` overrides its values. :func:`resolve_job` fills in the site's defaults (the
partition for the job's kind, one GPU's share of the cores ...) and refuses, in one line, what the
site cannot give: more GPUs per node than the partition has, a GPU model or feature it lacks, more
cores, memory or time than it allows, no account where one is required. The resolved job carries
its ``#SBATCH`` lines, each with a comment saying what it asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from common.errors import UserError
from common.slurm.sites import (REPO_ROOT, Partition, Site, check_keys, display_path, load_yaml, memory_to_mb, one_line,
                                read_text, slurm_name, text_or_none, time_to_seconds, whole_number)

__all__ = ["JOB_KEYS", "PLACEHOLDER", "TEMPLATE_SUFFIX", "SiteLacks", "Template", "parse_settings", "read_template",
           "resolve_job", "sbatch_directives", "template_stem"]

TEMPLATE_SUFFIX = ".j2"
PLACEHOLDER = "edit-me"  # a site value starting with this must be replaced before a real submission
#: --mem as sbatch reads it (Slurm's str_to_mbytes): a whole number of MB, or one with K, M, G or T (B after it allowed)
_SBATCH_MEMORY = re.compile(r"\d+(?:[KMGTkmgt][Bb]?)?")
_JOB_BLOCK = re.compile(r"\A\{#-?\s*\n?(?P<body>job:.*?)-?#\}", re.DOTALL)

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
    "sites": "only render for these sites in --all-sites mode (default: every site that can run the job)",
}


class SiteLacks(UserError):
    """The site has no partition that gives what the job asks for (GPUs per node, a GPU model, cores, memory,
    time, a feature): ``--all-sites`` skips that site for the template and says why; one rendering fails."""


@dataclass(frozen=True)
class Template:
    path: Path
    request: dict[str, Any]  # the job block, before --set


def _templates_named(path: Path) -> list[str]:
    """The repository's templates a mistyped ``path`` may have meant: its name with ``.j2`` (the rendered script's
    name, the one READMEs submit), or the same name in another folder (a template given without its folder)."""
    names = {path.name, path.name + TEMPLATE_SUFFIX}
    return sorted(display_path(found) for folder in ("chapters", "labs", "slurm")
                  for found in (REPO_ROOT / folder).rglob(f"*{TEMPLATE_SUFFIX}")
                  if found.name in names)


def read_template(path: Path) -> Template:
    """A template file and its job block (checked for unknown keys)."""
    where = display_path(path)
    beside = path.with_name(path.name + TEMPLATE_SUFFIX)
    if not path.is_file():
        meant = [display_path(beside)] if beside.is_file() else _templates_named(path)
        raise UserError(f"{where}: no such template" + (f" (did you mean {' or '.join(meant[:3])}?)" if meant else ""))
    match = _JOB_BLOCK.match(read_text(path, where))
    if not match:
        if beside.is_file():  # Chapter 4's committed renderings sit beside their templates
            raise UserError(f"{where}: a rendered script, not a template: render its template, {display_path(beside)}")
        raise UserError(f"{where}: a template must start with its job block, e.g. '{{# job:' ... '#}}' "
                        "(see slurm/sites/README.md)")
    data = load_yaml(match["body"], f"{where} (job block)")
    request = data.get("job") if isinstance(data, dict) else None
    if request is None:
        request = {}
    if not isinstance(request, dict):
        raise UserError(f"{where}: the job block must map keys to values, e.g. 'nodes: 2'")
    check_keys(request, set(JOB_KEYS), f"{where}: job block")
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
    """The default job name: the file name without .sbatch.j2 (or .sh.j2)."""
    name = path.name.removesuffix(TEMPLATE_SUFFIX)
    return name.removesuffix(".sbatch").removesuffix(".sh")


def _word(value: Any, where: str) -> str | None:
    """An account or reservation: one word, or None (text_or_none refuses yes/no/on/off)."""
    text = text_or_none(value, where)
    return None if not text else slurm_name(text, where)


def _output(value: Any) -> str:
    """The log file pattern: one word, as sbatch splits an ``#SBATCH`` line into words (``my logs/%j.out`` would log
    to ``my``) and reads quotes in it."""
    output = one_line(str(value or "%x-%j.out"), "output")
    if re.search(r"[\s'\"\\]", output):
        raise UserError(f"output must be one path without spaces or quotes (sbatch splits an #SBATCH line into "
                        f"words), got {output!r}")
    return output


def resolve_job(site: Site, request: dict[str, Any], default_name: str) -> dict[str, Any]:
    """Fill the request's defaults from the site and check that the site can run it."""
    def whole(key: str, default: int, minimum: int) -> int:
        value = request.get(key)
        return default if value is None else whole_number(value, key, minimum)

    gpus_asked = request.get("gpus_per_node")
    kind = request.get("kind") or ("gpu" if gpus_asked else "cpu")
    if kind not in ("cpu", "gpu"):
        raise UserError(f"kind must be cpu or gpu, got {kind!r}")
    partition_name = request.get("partition") or site.default_partitions[kind]
    partition = site.partitions.get(str(partition_name))
    if partition is None:
        raise SiteLacks(f"site {site.name} has no partition {partition_name!r} "
                        f"(it has: {', '.join(site.partitions)})")
    where = f"site {site.name}, partition {partition.name}"

    nodes = whole("nodes", 1, 1)
    gpus_per_node = whole("gpus_per_node", 1 if kind == "gpu" else 0, 0)
    if gpus_per_node > partition.gpus_per_node:
        has = f"has {partition.gpus_per_node} per node" if partition.gpus_per_node else "has no GPUs"
        raise SiteLacks(f"the job asks for {gpus_per_node} GPU(s) per node but {where} {has}")
    # `ntasks_per_node: gpus` (one process per GPU, as srun-launched DDP needs) follows
    # gpus_per_node, so `--set gpus_per_node=2` resizes such a job in one setting.
    if request.get("ntasks_per_node") == "gpus":
        if gpus_per_node == 0:
            raise UserError("ntasks_per_node is 'gpus' (one process per GPU) but the job asks for no GPUs")
        ntasks_per_node = gpus_per_node
    elif isinstance(request.get("ntasks_per_node"), str):  # `gpu`, `GPUs`: the word meant, misspelt
        raise UserError(f"ntasks_per_node must be a whole number >= 1 or gpus (one process per GPU), got "
                        f"{request['ntasks_per_node']!r}")
    else:
        ntasks_per_node = whole("ntasks_per_node", 1, 1)

    gpu_type = request.get("gpu_type")
    if gpu_type is not None:
        gpu_type = str(gpu_type)
        if gpus_per_node == 0:
            raise UserError(f"gpu_type {gpu_type!r} is set but the job asks for no GPUs")
        if gpu_type not in partition.gpu_types:
            models = ", ".join(partition.gpu_types) or "no named models"
            raise SiteLacks(f"the job asks for {gpu_type} GPUs but {where} has {models}")

    share = (partition.cpus_per_gpu or 0) * gpus_per_node // ntasks_per_node
    cpus_per_task = whole("cpus_per_task", max(1, share) if gpus_per_node else 1, 1)
    cpus_per_node = cpus_per_task * ntasks_per_node
    if cpus_per_node > partition.cpus_per_node:
        raise SiteLacks(f"the job asks for {cpus_per_node} CPUs per node ({ntasks_per_node} task(s) x "
                        f"{cpus_per_task}) but {where} has {partition.cpus_per_node}")
    if gpus_per_node and partition.cpus_per_gpu and cpus_per_node > partition.cpus_per_gpu * gpus_per_node:
        raise SiteLacks(f"the job asks for {cpus_per_node} CPUs per node with {gpus_per_node} GPU(s) but "
                        f"{where} allows {partition.cpus_per_gpu} CPUs per GPU")

    mem = text_or_none(request.get("mem"), "mem")
    if mem is not None:
        try:
            mem_mb = memory_to_mb(mem)
        except ValueError as err:
            raise UserError(f"mem: {err}") from None
        if not _SBATCH_MEMORY.fullmatch(mem):  # what the profile's mem_per_node may say, but sbatch refuses it
            raise UserError(f"mem: {mem!r} is not a size sbatch reads: a whole number, then K, M, G or T "
                            "(e.g. 1536M for 1.5G)")
        if mem_mb == 0:  # Slurm reads --mem=0 as all of the node's memory
            raise UserError(f"mem: {mem!r} asks Slurm for all of each node's memory; give an amount, e.g. 16G")
        if partition.mem_per_node is not None and mem_mb > memory_to_mb(partition.mem_per_node):
            raise SiteLacks(f"the job asks for {mem} of memory per node but {where} has {partition.mem_per_node}")

    time = "00:10:00" if request.get("time") is None else str(request["time"]).strip()
    limit = partition.max_time or site.max_time
    try:
        seconds = time_to_seconds(time)
    except ValueError as err:
        raise UserError(f"time: {err}") from None
    if seconds == 0:  # Slurm reads --time=0 as no limit at all, past any the site sets
        raise UserError(f"time: {time!r} is no time limit to Slurm; give one, e.g. 00:30:00")
    if seconds > time_to_seconds(limit):
        raise SiteLacks(f"the job asks for time {time} but {where} allows at most {limit}")

    constraint = request.get("constraint")
    if constraint is not None and str(constraint) not in partition.features:
        features = ", ".join(partition.features) or "none"
        raise SiteLacks(f"the job asks for feature {constraint!r} but {where} has features: {features}")

    account = _word(request.get("account", site.account), "account")
    if site.account_required and not account:
        raise UserError(f"site {site.name} needs an account: pass --set account=YOUR_PROJECT, or give "
                        f"{display_path(site.path)} an account ({PLACEHOLDER} renders, with a warning)")
    reservation = _word(request.get("reservation", site.reservation), "reservation")

    if gpus_per_node == 0:
        gres = ""
    elif gpu_type is not None and partition.typed_gres:
        gres = f"gpu:{gpu_type}:{gpus_per_node}"
    else:
        gres = f"gpu:{gpus_per_node}"

    job = {
        "name": slurm_name(request.get("name") or default_name, "name"),
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
        "output": _output(request.get("output")),
    }
    job["sbatch"] = sbatch_directives(site, partition, job)
    return job


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
        (f"--output={job['output']}", "log file (%x job name, %j job id, %A_%a array job_task), stdout and stderr"),
    ]
    width = max(len(directive) for directive, _ in lines) + len("#SBATCH ") + 2
    return "\n".join(f"{('#SBATCH ' + directive).ljust(width)}# {comment}" for directive, comment in lines)
