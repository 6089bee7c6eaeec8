"""A template rendered for a site: one script, every template for every site, the committed ones.

A template gets ``job.*`` (the resolved request, :mod:`.jobs`), ``site.*`` (the profile,
:mod:`common.slurm.sites`) and ``preamble``: what every job does after its ``#SBATCH`` lines (strict
mode, the repository root, the site's setup lines, the shared job header). Jinja errors become one
line naming the template line. The template contract: ``slurm/sites/README.md``.
"""

from __future__ import annotations

import json
import shlex
import traceback
from pathlib import Path
from typing import Any, Sequence

import jinja2

from common.atomic import write_text_atomic
from common.errors import UserError
from common.slurm.sites import REPO_ROOT, Site, display_path, find_site

from .jobs import TEMPLATE_SUFFIX, SiteLacks, Template, read_template, resolve_job, template_stem

__all__ = ["COMMITTED_RENDERINGS", "FOLDER_PATTERN", "committed_path", "committed_text", "find_templates",
           "preamble", "render", "render_all", "renderings", "write_committed", "write_script"]

FOLDER_PATTERN = ".sbatch.j2"  # what --all-sites picks up in a folder (not, e.g., report.html.j2)
#: Templates whose rendering for a site is also committed next to them, for READMEs that say
#: `sbatch sbatch/single_gpu.sbatch`: template -> site. `--write-committed` refreshes them and
#: tests/test_render_sbatch.py fails when one differs from a fresh rendering.
COMMITTED_RENDERINGS = {
    "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch.j2": "generic",
    "chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch.j2": "generic",
}


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
# NUM_WORKERS, NPROC_PER_NODE, DEVICE (cuda when the job has GPUs, else cpu), TINY_ARGS and
# RESULTS_DIR (see the header of that file).
# shellcheck source=slurm/lib/job_header.sh
source slurm/lib/job_header.sh"""


def _environment(template_path: Path) -> jinja2.Environment:
    return jinja2.Environment(
        # utf-8-sig: a template saved with a BOM (older Windows editors) renders a script that starts with #!
        loader=jinja2.FileSystemLoader([str(template_path.parent), str(REPO_ROOT)], encoding="utf-8-sig"),
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
    where = display_path(template.path)
    request = {**template.request, **(settings or {})}
    try:
        job = resolve_job(site, request, template_stem(template.path))
    except UserError as err:  # SiteLacks stays SiteLacks: --all-sites skips that site
        raise type(err)(f"{where} for site {site.name}: {err}") from None
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
    except (ArithmeticError, LookupError, TypeError, ValueError) as err:  # an expression of the template: its line
        raise UserError(f"{where}{_template_line(err, template.path)}: {type(err).__name__}: {err}") from None
    if not text.startswith("#!"):
        raise UserError(f"{where}: the rendered script must start with '#!/bin/bash' right after the job block")
    if settings:  # the header's render command is the template's: say what this script was rendered with beyond it
        shebang, rest = text.split("\n", 1)
        given = " ".join(f"--set {shlex.quote(key + '=' + _as_typed(value))}" for key, value in settings.items())
        text = f"{shebang}\n# Rendered with {given} (the #SBATCH lines follow it where the comments differ)\n{rest}"
    return text, job


def _as_typed(value: Any) -> str:
    """A --set value as typed: ``key=`` clears (None), a list is YAML's ``[a, b]`` (not ``['a', 'b']``)."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "[" + ", ".join(map(_as_typed, value)) + "]"
    return str(value)


def write_script(path: Path, text: str) -> Path:
    """Write an executable script whole (never a half-written job script; see ``common.atomic``)."""
    return write_text_atomic(text, path, executable=True)


# ---------------------------------------------------------------------------------------------
# Many templates for every site (what CI submits)

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


def renderings(template: Template, sites: dict[str, Site], settings: dict[str, Any] | None = None
               ) -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, str]]:
    """``template`` rendered for every site that can run it, ``{site: (script, job)}``, and the sites skipped,
    ``{site: why}``: not among the job block's ``sites``, or lacking what the job asks for (:class:`SiteLacks`:
    4 GPUs per node on a site whose nodes have 2). Any other problem raises its one line."""
    only = {**template.request, **(settings or {})}.get("sites")  # --set sites=[...] chooses too
    if only is not None and not (isinstance(only, list) and all(isinstance(name, str) for name in only)):
        raise UserError(f"{display_path(template.path)}: 'sites' must be a list of site names, e.g. [generic, lanta]")
    rendered, skipped = {}, {}
    for site in sites.values():
        if only is not None and site.name not in only:
            skipped[site.name] = f"its job block names only the sites {', '.join(only)}"
            continue
        try:
            rendered[site.name] = render(template, site, settings)
        except SiteLacks as err:
            skipped[site.name] = str(err).rpartition(f"for site {site.name}: ")[2]
    return rendered, skipped


def _blocked(target: Path, root: Path) -> Path | None:
    """A path that would stop ``target`` from being written: a file where a folder of it goes, or a folder at it."""
    if target.is_dir():
        return target
    return next((folder for folder in target.parents if folder.exists() and not folder.is_dir()
                 and (folder == root or root in folder.parents)), None)


def render_all(paths: Sequence[Path], out_dir: Path, settings: dict[str, Any],
               sites: dict[str, Site]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Render every template under ``paths`` for every site that can run it into ``out_dir/<site>/...``.

    Returns the manifest entries, the errors and the skipped pairs (``site/path: why``), one line each;
    nothing is written when any template fails or a file stands where a script or folder goes, so a
    half-rendered folder is never submitted.
    """
    templates = [(read_template(path), relative) for path, relative in find_templates(paths)]
    if not templates:
        raise UserError(f"no *{FOLDER_PATTERN} templates under {', '.join(map(str, paths))}")
    entries, errors, skipped, outputs = [], [], [], []
    for template, relative in templates:
        try:
            rendered, passed_over = renderings(template, sites, settings)
        except UserError as err:
            errors.append(str(err))
            continue
        skipped += [f"{name}/{relative}: {why}" for name, why in passed_over.items()]
        for name, (text, job) in rendered.items():
            outputs.append((out_dir / name / relative, text))
            entries.append({"site": name, "template": display_path(template.path), "script": str(Path(name) / relative),
                            "job": {key: value for key, value in job.items() if key != "sbatch"}})
    if errors or not entries:  # nothing to write: not even an empty list
        return entries, errors, skipped
    manifest = out_dir / "manifest.json"
    for target in [target for target, _ in outputs] + [manifest]:
        if (blocked := _blocked(target, out_dir)) is not None:
            what = "the script" if blocked == target and target != manifest else "a folder"
            raise UserError(f"{blocked}: is a {'folder' if blocked.is_dir() else 'file'}, where "
                            f"{'the list' if blocked == manifest else what} {target.relative_to(out_dir)} goes; "
                            "move it away or choose another OUT_DIR (nothing written)")
    try:  # a script of an earlier rendering into out_dir that this one skips would still look submittable
        before = json.loads(manifest.read_text()) if manifest.is_file() else []
        stale = {entry["script"] for entry in before if isinstance(entry, dict) and "script" in entry}
        for script in stale - {entry["script"] for entry in entries}:
            if (out_dir / script).resolve().is_relative_to(out_dir.resolve()):  # only what it wrote there
                (out_dir / script).unlink(missing_ok=True)
    except (OSError, ValueError):
        pass  # not a manifest this renderer wrote: leave what is there alone
    try:
        for target, text in outputs:
            write_script(target, text)
        write_text_atomic(json.dumps(entries, indent=2) + "\n", manifest)
    except OSError as err:
        raise UserError(f"cannot write into {out_dir}: {err}") from None
    return entries, errors, skipped


# ---------------------------------------------------------------------------------------------
# Renderings committed beside their templates

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
