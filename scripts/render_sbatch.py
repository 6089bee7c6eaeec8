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

This file is the command line only: the profiles are read by common/slurm/sites.py, a job is resolved
against a site by common/slurm/jobs.py and rendered by common/slurm/rendering.py.
It must not import torch (tests call ``main(argv)`` in-process).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from common.cli import input_path, one_line_errors, output_dir, output_file
from common.errors import UserError, run_main
from common.slurm.jobs import JOB_KEYS, PLACEHOLDER, TEMPLATE_SUFFIX, parse_settings, read_template
from common.slurm.rendering import COMMITTED_RENDERINGS, render, render_all, write_committed, write_script
from common.slurm.sites import display_path, find_site, load_sites


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Render a course sbatch template (Jinja2) for one cluster's site profile.",
        epilog="Template contract and site profile format: slurm/sites/README.md",
    )
    parser.add_argument("templates", nargs="*", type=input_path, metavar="TEMPLATE",
                        help="a *.sbatch.j2 template; with --all-sites, templates or folders (default: none)")
    parser.add_argument("--site", help="site profile name, see --list-sites (default: none)")
    parser.add_argument("-o", "--output", type=output_file,
                        help="write the script here instead of printing it (default: standard output)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job block value, e.g. --set nodes=2 --set account=lt200123 "
                             f"(keys: {', '.join(JOB_KEYS)}) (default: none)")
    parser.add_argument("--list-sites", action="store_true", help="list the site profiles and exit (default: off)")
    parser.add_argument("--all-sites", type=output_dir, metavar="OUT_DIR",
                        help="render every *.sbatch.j2 under TEMPLATE folders (and TEMPLATE files) for every site into "
                             "OUT_DIR/<site>/<path> plus OUT_DIR/manifest.json (default: off)")
    parser.add_argument("--write-committed", action="store_true",
                        help="refresh the committed renderings (" + ", ".join(
                            f"{t.removesuffix(TEMPLATE_SUFFIX)} for {s}" for t, s in COMMITTED_RENDERINGS.items())
                        + ") (default: off)")
    return one_line_errors(parser)


def list_sites() -> None:
    for site in load_sites().values():
        parts = ", ".join(
            f"{p.name} ({p.gpus_per_node}x {'/'.join(p.gpu_types) or 'GPU'})" if p.gpus_per_node else p.name
            for p in site.partitions.values())
        print(f"{site.name:16s} {site.title}\n{'':16s} partitions: {parts}")


def render_every_site(templates: Sequence[Path], out_dir: Path, settings: dict[str, Any]) -> None:
    sites = load_sites()
    entries, errors, skipped = render_all(templates, out_dir, settings, sites)
    if errors:
        lines = once_per_message(errors)
        for line in lines[:-1]:
            print(f"error: {line}", file=sys.stderr)
        raise UserError(f"{lines[-1]} ({len(errors)} template(s) failed; nothing written)")
    for line in skipped:
        print(f"skipped {line}")
    if not entries:
        raise UserError(f"nothing rendered: every site skipped every template ({len(skipped)} pair(s), listed above; "
                        "nothing written)")
    for name in sorted({entry["site"] for entry in entries}):  # as one rendering warns, once per site here
        keys = sorted({key for entry in entries if entry["site"] == name for key in placeholders(entry["job"])})
        if keys:
            print(f"warning: {name}: {' and '.join(keys)} in its scripts is a placeholder: pass "
                  f"{' '.join(f'--set {key}=...' for key in keys)} or edit {display_path(sites[name].path)} before "
                  "submitting", file=sys.stderr)
    print(f"rendered {len(entries)} script(s) for {len(sites)} site(s) into {out_dir} (list: "
          f"{out_dir / 'manifest.json'})" + (f"; skipped {len(skipped)} pair(s) a site cannot run, listed above "
                                            "(render one with --site NAME --set ..., e.g. --set gpus_per_node=2)"
                                            if skipped else ""))


def once_per_message(errors: Sequence[str]) -> list[str]:
    """The errors, a site's message that several templates meet (no account given) said once: "24 templates for
    site zz: ..." instead of 24 lines that differ only in the template."""
    templates: dict[str, list[str]] = {}
    for line in errors:  # "TEMPLATE for site NAME: message", or a template's own error
        template, found, message = line.partition(" for site ")
        templates.setdefault(found + message if found else line, []).append(template)
    lines = []
    for key, names in templates.items():
        if key.startswith(" for site "):
            key = (names[0] if len(names) == 1 else f"{len(names)} templates") + key
        lines.append(key)
    return lines


def placeholders(job: dict[str, Any]) -> list[str]:
    """The job's account and reservation that are still a site profile's placeholder (``edit-me``)."""
    return [key for key in ("account", "reservation") if str(job[key] or "").startswith(PLACEHOLDER)]


def render_one(template: Path, site_name: str, settings: dict[str, Any], output: Path | None) -> None:
    site = find_site(site_name)
    text, job = render(read_template(template), site, settings)
    for key in placeholders(job):
        print(f"warning: {key} is the placeholder {job[key]!r}: pass --set {key}=... or edit "
              f"{display_path(site.path)} before submitting", file=sys.stderr)
    folder = PurePosixPath(job["output"]).parent
    if str(folder) != ".":  # a job whose log folder is missing fails at once and leaves no log to say why
        print(f"warning: output {job['output']}: Slurm does not create the folder {folder}; make it before sbatch "
              f"(mkdir -p {folder} where you submit), or the job fails without a log", file=sys.stderr)
    if output is None:
        sys.stdout.write(text)
        return
    if output.is_dir():
        raise UserError(f"-o {output}: is a folder; give a file name")
    write_script(output, text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_sites:
        list_sites()
        return 0
    if args.write_committed:
        for path in write_committed():
            print(f"wrote {display_path(path)}")
        return 0
    settings = parse_settings(args.settings)
    if args.all_sites is not None:
        if args.site or args.output:
            raise UserError("--all-sites renders for every site into OUT_DIR: drop --site and --output")
        if not args.templates:
            raise UserError("--all-sites needs template files or folders after it")
        render_every_site(args.templates, args.all_sites, settings)
        return 0
    if not args.site:
        raise UserError("choose a site with --site NAME (see --list-sites)")
    if "sites" in settings:  # it would be ignored, and stamped into the script's second line as if it did something
        raise UserError(f"--set sites: chooses the sites of --all-sites only; --site {args.site} renders for that site")
    if len(args.templates) != 1:
        raise UserError("give exactly one TEMPLATE (or use --all-sites OUT_DIR with folders)")
    if args.templates[0].is_dir():
        raise UserError(f"{args.templates[0]} is a folder: give one template file (folders: --all-sites OUT_DIR)")
    if args.output is not None and args.output.resolve() == args.templates[0].resolve():  # tab completion's slip
        raise UserError(f"-o {args.output}: is the template itself, which the script would replace; give the script's "
                        f"name, e.g. -o {args.templates[0].name.removesuffix(TEMPLATE_SUFFIX)}")
    render_one(args.templates[0], args.site, settings, args.output)
    return 0


if __name__ == "__main__":
    run_main(main)
