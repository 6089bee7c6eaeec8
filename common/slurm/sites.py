"""Site profiles: what one Slurm cluster has, read from ``slurm/sites/NAME.yaml`` and checked.

A profile names the cluster's partitions (cores, memory, GPUs per node and their models, CPU cores
per GPU, node features, time limits), the account and reservation jobs are charged to, the shell
lines that give a job its Python, and, optionally, the peak bandwidth of each partition's links.
The format, field by field: ``slurm/sites/README.md``.

    from common.slurm.sites import find_site, load_sites

    lanta = find_site("lanta")                        # one site by name (slurm/sites/lanta.yaml)
    gpu = lanta.partitions[lanta.default_partitions["gpu"]]
    gpu.gpus_per_node, gpu.gpu_types, gpu.cpus_per_gpu   # 4, ("a100",), 16
    for site in load_sites().values():                # every profile, by name
        for partition in site.partitions.values():
            nvlink = partition.links.get("nvlink")     # a Link, or None where the profile has none
            if nvlink:
                print(site.name, partition.name, nvlink.gb_per_s, "GB/s per", nvlink.per, nvlink.source)

``load_site(path)`` reads one file, ``load_sites(folder)`` every ``*.yaml`` in a folder,
``find_site(name)`` one profile of ``slurm/sites/`` by name and ``site_names()`` lists them. A
profile that is not valid raises :class:`common.errors.UserError` with one line naming the file and
the field (``slurm/sites/NAME.yaml: partitions.gpu: a partition with GPUs needs cpus_per_gpu``);
a script's ``run_main`` prints it as ``error: ...`` and exits 2.

Link peaks (``partitions.<name>.links``) are bandwidth in GB/s (10^9 bytes per second) in one
direction, the unit of nccl-tests' ``busbw``: ``nvlink`` and ``pcie`` per GPU, ``infiniband``,
``slingshot`` and ``ethernet`` per node (:data:`LINK_SCOPES`). Every peak carries its ``source``.

The YAML reader keeps Slurm's times and names as text: YAML 1.1 would read ``time: 10:00`` as the
base-60 number 600, ``account: 012345`` as the octal 5349 and ``reservation: 2024_05`` as 202405; a
number here is plain decimal. A key given twice is an error (YAML would keep the last silently), and
so is ``true``/``false`` (or YAML 1.1's ``yes``/``no``/``on``/``off``) where text belongs. Text that
goes into a script's ``#SBATCH`` or comment lines is one line, and each ``setup`` line one command that
``bash -n`` reads (where there is a bash to ask). This module must not import torch (the
sbatch renderer and the tests use it).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import UserError

__all__ = [
    "LINK_SCOPES", "REPO_ROOT", "SITES_DIR", "Link", "Partition", "Site", "check_keys", "display_path",
    "find_site", "flag", "load_site", "load_sites", "load_yaml", "memory_to_mb", "one_line", "read_text",
    "site_names", "slurm_name", "text_or_none", "time_to_seconds", "whole_number",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
SITES_DIR = REPO_ROOT / "slurm" / "sites"
#: Link kinds a partition may list, and what one peak is for: each GPU, or each node.
LINK_SCOPES = {"nvlink": "gpu", "pcie": "gpu", "infiniband": "node", "slingshot": "node", "ethernet": "node"}


def display_path(path: Path) -> str:
    """``path`` as messages show it: relative to the repository when it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# YAML whose numbers are plain decimals: `time: 10:00` stays the text "10:00" (not base-60 600),
# `account: 012345` the text "012345" (not octal 5349), `reservation: 2024_05` the text (not 202405).

class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A mapping whose keys are each given once: YAML would keep the last of two ``setup:`` silently."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader says so itself
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first on line {first + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBERS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"),
                              list("-+.0123456789"))


def read_text(path: Path, where: str) -> str:
    """The text of a profile or template; one that is not UTF-8 (an editor's Latin-1 or Windows-1252 ``ü`` in a title)
    or cannot be read is one line naming ``where`` and the line, not a traceback."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"{where}: cannot read it: {err.strerror}") from None
    try:
        return data.decode("utf-8-sig")  # the BOM older Windows editors put first is no part of the text
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise UserError(f"{where} line {line}: not UTF-8 text (byte 0x{data[err.start]:02x}): save the file as "
                        "UTF-8") from None


def load_yaml(text: str, where: str) -> Any:
    """Parse YAML (Slurm times stay text); a syntax error is one line naming ``where`` and the line."""
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
# The profile

@dataclass(frozen=True)
class Link:
    """The peak of one kind of link: ``gb_per_s`` in one direction, for each GPU or each node."""
    kind: str          # nvlink, pcie, infiniband, slingshot, ethernet
    gb_per_s: float    # GB/s (10^9 bytes/s), one direction
    per: str           # "gpu" or "node" (LINK_SCOPES[kind])
    source: str        # where the number comes from (a data sheet, the centre's documentation)


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
    links: dict[str, Link] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "gpu_types": list(self.gpu_types), "features": list(self.features),
                "links": {kind: dict(link.__dict__) for kind, link in self.links.items()}}


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
    node_local: str | None = None  # a node's own storage for staged data (Lab-08), e.g. '${TMPDIR:-/tmp}'

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "title": self.title, "source": self.source,
            "account": self.account, "account_required": self.account_required,
            "reservation": self.reservation, "max_time": self.max_time,
            "default_partitions": dict(self.default_partitions),
            "partitions": {name: part.as_dict() for name, part in self.partitions.items()},
            "setup": list(self.setup), "node_local": self.node_local,
        }


_SITE_KEYS = {"name", "title", "source", "account", "account_required", "reservation", "max_time",
             "default_partitions", "partitions", "setup", "notes", "node_local"}
_PARTITION_KEYS = {"description", "cpus_per_node", "mem_per_node", "gpus_per_node", "gpu_types",
                  "gpu_memory", "typed_gres", "cpus_per_gpu", "features", "max_time", "links"}
_LINK_KEYS = {"gb_per_s", "source"}


def check_keys(mapping: dict, allowed: set[str], where: str) -> None:
    """One line naming the keys of ``mapping`` that are not ``allowed``."""
    # YAML reads `2:` as a number and `on:` as true: sorted with the typos, they would raise TypeError
    unknown = [str(key) for key in sorted(set(mapping) - allowed, key=lambda key: (isinstance(key, str), str(key)))]
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def whole_number(value: Any, where: str, minimum: int = 0) -> int:
    """``value`` when it is an int >= ``minimum`` (not a bool), else one line naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{where} must be a whole number >= {minimum}, got {value!r}")
    return value


def one_line(value: str, where: str) -> str:
    """``value`` without the line end a YAML block (``|``, ``>``) adds; a line break inside is one line naming
    ``where``: it would start a new line of the script (a command before the ``#SBATCH`` lines ends them)."""
    value = value.strip()
    if "\n" in value or "\r" in value:
        raise UserError(f"{where} must be one line (it goes into the scripts' #SBATCH and comment lines), "
                        f"got {value!r}")
    return value


def text_or_none(value: Any, where: str) -> str | None:
    """One line of text (numbers become text) or None; anything else is one line naming ``where``."""
    if value is None:
        return value
    if isinstance(value, bool):
        raise UserError(f"{where} must be text or null, got {value!r} (YAML reads yes/no/on/off/true/false as "
                        "true or false: write null for none, or quote a name)")
    if isinstance(value, (str, int, float)):
        return one_line(str(value), where)
    raise UserError(f"{where} must be text or null, got {value!r}")


def flag(value: Any, where: str, default: bool = False) -> bool:
    """``true`` or ``false`` (``default`` when missing); quoted text is one line naming ``where``."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(f"{where} must be true or false, got {value!r}")
    return value


#: A name Slurm and a shell read as one word: a site, a partition, a GPU model, a feature, an account.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]*")


def slurm_name(value: Any, where: str) -> str:
    """``value`` when it is one word of letters, digits and ``. _ : + -``, else one line naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not _NAME.fullmatch(str(value)):
        raise UserError(f"{where} must be one word of letters, digits and . _ : + - (it goes into #SBATCH and "
                        f"shell lines), got {value!r}")
    return str(value)


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise UserError(f"{where} must be a list of names, e.g. [a100], got {value!r}")
    return tuple(slurm_name(item, where) for item in value)


def _checked_time(value: Any, where: str) -> str:
    try:
        time_to_seconds(str(value))
    except ValueError as err:
        raise UserError(f"{where}: {err}") from None
    return str(value)


def _parse_links(data: Any, where: str) -> dict[str, Link]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where} must map link kinds to their peaks, e.g. nvlink: {{gb_per_s: 300, source: ...}}")
    links = {}
    for kind, peak in data.items():
        here = f"{where}.{kind}"
        if kind not in LINK_SCOPES:
            raise UserError(f"{here}: unknown link kind (known: {', '.join(LINK_SCOPES)})")
        if not isinstance(peak, dict):
            raise UserError(f"{here} must be a mapping: {{gb_per_s: NUMBER, source: TEXT}}")
        check_keys(peak, _LINK_KEYS, here)
        speed = peak.get("gb_per_s")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed <= 0:
            raise UserError(f"{here}.gb_per_s must be a number > 0 (GB/s, one direction), got {speed!r}")
        source = peak.get("source")
        if not isinstance(source, str) or not source.strip():
            raise UserError(f"{here}.source must say where the number comes from (a data sheet, a user guide)")
        links[str(kind)] = Link(kind=str(kind), gb_per_s=float(speed), per=LINK_SCOPES[kind], source=source.strip())
    return links


def _parse_partition(name: str, data: Any, where: str) -> Partition:
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping of partition fields")
    check_keys(data, _PARTITION_KEYS, where)
    if "cpus_per_node" not in data:
        raise UserError(f"{where}: cpus_per_node is required")
    gpus = whole_number(data.get("gpus_per_node", 0), f"{where}.gpus_per_node")
    mem = text_or_none(data.get("mem_per_node"), f"{where}.mem_per_node")
    if mem is not None:
        try:
            memory_to_mb(mem)
        except ValueError as err:
            raise UserError(f"{where}.mem_per_node: {err}") from None
    cpus_per_node = whole_number(data["cpus_per_node"], f"{where}.cpus_per_node", 1)
    cpus_per_gpu = data.get("cpus_per_gpu")
    if gpus and cpus_per_gpu is None:
        raise UserError(f"{where}: a partition with GPUs needs cpus_per_gpu")
    if cpus_per_gpu is not None:
        cpus_per_gpu = whole_number(cpus_per_gpu, f"{where}.cpus_per_gpu", 1)
        if cpus_per_gpu * gpus > cpus_per_node:
            raise UserError(f"{where}: cpus_per_gpu {cpus_per_gpu} x gpus_per_node {gpus} is "
                            f"{cpus_per_gpu * gpus} cores, more than cpus_per_node {cpus_per_node}")
    max_time = data.get("max_time")
    links = _parse_links(data.get("links"), f"{where}.links")
    if not gpus and any(link.per == "gpu" for link in links.values()):
        raise UserError(f"{where}.links: GPU links ({', '.join(links)}) on a partition without GPUs")
    return Partition(
        name=name,
        description=text_or_none(data.get("description"), f"{where}.description") or name,
        cpus_per_node=cpus_per_node,
        mem_per_node=mem,
        gpus_per_node=gpus,
        gpu_types=_string_list(data.get("gpu_types"), f"{where}.gpu_types"),
        gpu_memory=text_or_none(data.get("gpu_memory"), f"{where}.gpu_memory"),
        typed_gres=flag(data.get("typed_gres"), f"{where}.typed_gres"),
        cpus_per_gpu=cpus_per_gpu,
        features=_string_list(data.get("features"), f"{where}.features"),
        max_time=None if max_time is None else _checked_time(max_time, f"{where}.max_time"),
        links=links,
    )


def _node_local(value: Any, where: str) -> str | None:
    """A node's own storage, as Lab-08's job reads it: ``NODE_LOCAL="${NODE_LOCAL:-<value>}"``. Inside those quotes
    ``~`` is not the home folder but a folder named ``~``, and a quote, a backslash or an unmatched brace is a syntax
    error only when the job runs: each is one line naming ``where`` here."""
    text = text_or_none(value, where)
    if text is None:
        return None
    if not text.startswith(("/", "$")):
        raise UserError(f"{where} must be an absolute path or start with a variable, e.g. /local/scratch or "
                        f"'${{TMPDIR:-/tmp}}', got {text!r}")
    if any(char in text for char in "\"`\\") or text.count("{") != text.count("}"):
        raise UserError(f"{where} must not hold quotes, backslashes or unmatched braces (it goes inside a double-quoted"
                        f" ${{NODE_LOCAL:-...}} of the job script), got {text!r}")
    return text


@functools.lru_cache(maxsize=None)  # a process reads the same profiles again and again (each rendering loads them)
def _bash_syntax_error(text: str) -> str | None:
    """What ``bash -n`` says about ``text`` (its first line), or None when bash reads it without a word. A here-document
    left open is only a warning to bash, yet it swallows the rest of the job script: any word counts."""
    bash = shutil.which("bash")
    if bash is None:  # no bash to ask (a Windows laptop): the job's own bash says it
        return None
    done = subprocess.run([bash, "--norc", "--noprofile", "-n"], input=text.encode(), capture_output=True,
                          env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}, check=False)
    said = done.stderr.decode(errors="replace").strip()
    if done.returncode == 0 and not said:
        return None
    return re.sub(r"^.*?line \d+: ", "", said.splitlines()[0] if said else f"exit status {done.returncode}")


def _setup_lines(value: Any, where: str) -> tuple[str, ...]:
    """The shell lines of ``setup``, each one whole command bash can read: a quote left open, or ``module load
    cuda/12.4 (D)`` copied from ``module avail``, would otherwise stop every job with a syntax error only once it runs,
    after its wait in the queue."""
    if not value:
        return ()
    if not isinstance(value, list) or not all(isinstance(line, str) for line in value):
        raise UserError(f"{where} must be a list of shell lines")
    for index, line in enumerate(value):
        if (problem := _bash_syntax_error(line)) is not None:
            raise UserError(f"{where}[{index}] must be one whole command bash can read, got {line!r} "
                            f"(bash: {problem}); every job would fail at this line")
    return tuple(value)


def load_site(path: Path) -> Site:
    """Read and check one site profile; every problem is one line naming the file and the field."""
    where = display_path(path)
    data = load_yaml(read_text(path, where), where)
    if not isinstance(data, dict):
        raise UserError(f"{where}: a site profile is a mapping (name:, partitions: ...)")
    check_keys(data, _SITE_KEYS, where)
    for key in ("name", "partitions", "default_partitions", "max_time"):
        if key not in data:
            raise UserError(f"{where}: '{key}' is required")
    if data["name"] != path.stem:
        raise UserError(f"{where}: name is {data['name']!r} but must match the file name {path.stem!r}")
    slurm_name(data["name"], f"{where}: name")
    if not isinstance(data["partitions"], dict) or not data["partitions"]:
        raise UserError(f"{where}: partitions must map partition names to their sizes")
    partitions = {slurm_name(name, f"{where}: partitions.{name}"):
                  _parse_partition(str(name), part, f"{where}: partitions.{name}")
                  for name, part in data["partitions"].items()}
    defaults = data["default_partitions"]
    if not isinstance(defaults, dict) or set(defaults) != {"cpu", "gpu"}:
        said = (f"missing: {', '.join(sorted({'cpu', 'gpu'} - set(defaults)))}" if isinstance(defaults, dict)
                and set(defaults) <= {"cpu", "gpu"} else f"got {defaults!r}")
        raise UserError(f"{where}: default_partitions must name a partition for cpu and for gpu jobs, e.g. "
                        f"{{cpu: cpu, gpu: gpu}} ({said}; a cluster without CPU nodes names its GPU partition for cpu)")
    for kind, name in defaults.items():
        if name is None or name == "":  # `cpu:` with nothing after it: YAML reads null
            raise UserError(f"{where}: default_partitions.{kind} is empty: name the partition {kind} jobs get "
                            f"(partitions: {', '.join(partitions)}; a cluster without CPU nodes names its GPU "
                            "partition)")
        if name not in partitions:
            raise UserError(f"{where}: default_partitions.{kind} is {name!r}, which is not in partitions "
                            f"({', '.join(partitions)})")
    if partitions[defaults["gpu"]].gpus_per_node == 0:
        raise UserError(f"{where}: default_partitions.gpu names {defaults['gpu']!r}, which has no GPUs")
    setup = _setup_lines(data.get("setup"), f"{where}: setup")
    account, reservation = (data.get(key) for key in ("account", "reservation"))
    return Site(
        name=data["name"],
        title=text_or_none(data.get("title"), f"{where}: title") or data["name"],
        source=text_or_none(data.get("source"), f"{where}: source") or "",
        account=None if account is None else slurm_name(text_or_none(account, f"{where}: account"),
                                                         f"{where}: account"),
        account_required=flag(data.get("account_required"), f"{where}: account_required"),
        reservation=None if reservation is None else slurm_name(text_or_none(reservation, f"{where}: reservation"),
                                                                 f"{where}: reservation"),
        max_time=_checked_time(data["max_time"], f"{where}: max_time"),
        default_partitions=dict(defaults),
        partitions=partitions,
        setup=setup,
        path=path,
        node_local=_node_local(data.get("node_local"), f"{where}: node_local"),
    )


def site_names(sites_dir: Path = SITES_DIR) -> list[str]:
    """The names of the profiles in ``sites_dir`` (their file names without .yaml), sorted. A ``NAME.yml`` there is
    one line asking for ``NAME.yaml``: left out, it would be missing from --list-sites, --all-sites and CI unnoticed.
    A name starting with ``.`` is an editor's, not a profile: Emacs links ``.#NAME.yaml`` to nowhere while a change to
    NAME.yaml is unsaved, and every site list failed on it meanwhile. A folder is not a profile either, whatever its
    name (a link to nowhere stays in: its profile is missing, and loading it says so)."""
    def profiles(pattern: str) -> list[Path]:
        return sorted(path for path in sites_dir.glob(pattern) if not path.name.startswith(".") and not path.is_dir())

    misnamed = profiles("*.yml")
    if misnamed:
        raise UserError(f"{display_path(misnamed[0])}: a site profile's file name ends in .yaml: rename it to "
                        f"{misnamed[0].stem}.yaml")
    return sorted(path.stem for path in profiles("*.yaml"))


def load_sites(sites_dir: Path = SITES_DIR) -> dict[str, Site]:
    """Every profile in ``sites_dir``, by name; the first invalid one raises its one-line error."""
    return {name: load_site(sites_dir / f"{name}.yaml") for name in site_names(sites_dir)}


def find_site(name: str, sites_dir: Path = SITES_DIR) -> Site:
    """The profile called ``name``; an unknown name is one line listing the known ones."""
    known = site_names(sites_dir)
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    if stem != name and stem in known:  # `--site aurora.yaml` or `--site slurm/sites/aurora.yaml`
        raise UserError(f"site {name!r}: give the profile's name, {stem!r}, not its file")
    path = sites_dir / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown site {name!r} (known sites: {', '.join(known) or 'none'}; "
                        f"add slurm/sites/{stem}.yaml)")
    return load_site(path)
