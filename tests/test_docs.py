"""The docs match the code and the records: generated tables current, the README's commands real."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from pathlib import Path

from helpers import REPO, run_main


def test_results_tables_in_the_docs_match_the_committed_records(capsys):
    # Every table between <!-- results-table:LAB --> markers is what the reference records give.
    status = run_main("scripts/update_results_tables.py", ["--check"])
    assert status == 0, capsys.readouterr()


def test_every_lab_and_chapter_readme_with_a_table_has_reference_records():
    readmes = [p for p in REPO.glob("*/*/README.md") if "<!-- results-table:" in p.read_text()]
    assert len(readmes) >= 5
    for readme in readmes:
        assert "_No reference records" not in readme.read_text(), readme


def test_readme_two_commands_exist_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^bash (scripts/\S+\.sh)", readme, re.M)
    assert commands[:2] == ["scripts/main_job.sh", "scripts/test.sh"]
    for command in commands:
        assert (REPO / command).is_file()
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh" in ci


def test_readme_links_point_at_files_that_exist():
    for readme in [REPO / "README.md", *REPO.glob("*/*/README.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme.read_text()):
            assert (readme.parent / target).exists(), f"{readme.relative_to(REPO)} links to missing {target}"


def test_the_course_map_has_a_row_for_every_chapter_and_lab():
    readme = (REPO / "README.md").read_text()
    course_map = readme.split("## Course map", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| .*?\]\(((?:chapters|labs)/[^/)]+)/README\.md\)", course_map, re.M)
    folders = sorted(str(path.parent.relative_to(REPO)) for part in ("chapters", "labs")
                     for path in (REPO / part).glob("*/README.md"))
    assert len(folders) >= 11
    assert sorted(rows) == folders, (
        f"README.md's '## Course map' table lacks a row for {sorted(set(folders) - set(rows))} (a row links "
        f"[..](labs/<folder>/README.md) in its first cell) or has one for a folder that is gone: "
        f"{sorted(set(rows) - set(folders))}")


def test_reference_runs_help_and_a_wrong_first_argument_run_nothing(tmp_path):
    """``--help`` prints the script's header; a part given where the machine's folder goes (``lab01``), an option or
    a path is one line, exit 2, before a part runs: none re-measures every part into a folder named lab01 or --help."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REPO / "scripts" / "reference_runs.sh"), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                               "PYTHON": "no-such-python"})
    shown = run("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("Re-measure the reference records") and "Parts: " in \
        shown.stdout and shown.stderr == "", shown
    for args, said in ((["lab01"], "error: 'lab01' is a part: give the machine's folder first, e.g. bash "
                                   "scripts/reference_runs.sh cpu-2core lab01\n"),
                       (["-n"], "error: unknown option '-n' "), (["../x"], "error: MACHINE '../x' must be a folder"),
                       (["cpu-2core", "lab10"], "error: unknown part 'lab10' ")):
        done = run(*args)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.startswith(said), (args, done)
        assert done.stderr.count("\n") == 1, done.stderr
    assert not (REPO / "reference-results" / "lab01").exists() and list(tmp_path.iterdir()) == []


def test_every_reference_record_reads_and_says_where_its_energy_is():
    """The docs quote these records: each one reads, has an energy entry (version 2 on: a measured
    number or why none could be read), and the docs name the machine each came from. Records of
    version 2 predate provenance.machine: their heading says the capabilities were not recorded
    until scripts/reference_runs.sh re-measures them."""
    from common.results import load_records

    loaded = load_records(REPO / "reference-results")
    assert not loaded.errors, loaded.errors
    assert len(loaded.records) >= 30
    old = sorted({Path(r["_path"]).parent.name for r in loaded.records if r["schema_version"] < 2})
    assert not old, f"reference records without an energy entry in {old}: run scripts/reference_runs.sh"
    assert all(r["energy"]["status"] in ("ok", "unavailable") for r in loaded.records)


def test_every_results_table_in_the_docs_is_headed_by_the_machine_its_records_came_from():
    """A student compares their numbers with these: the heading says which machine made them (CPU,
    its CPUs, bf16 native or emulated), from the records, so a 10x gap on another CPU is explained."""
    from common.runtime.machine import machine_label
    from common.results import load_records

    labels: dict[str, set[str]] = {}
    for record in load_records(REPO / "reference-results").records:
        labels.setdefault(record["lab"], set()).add(machine_label(record["provenance"]))
    docs = [p for p in [REPO / "README.md", *REPO.glob("*/*/README.md")] if "<!-- results-table:" in p.read_text()]
    checked = 0
    for doc in docs:
        for lab, block in re.findall(r"<!-- results-table:([\w.-]+) -->\n(.*?)<!-- /results-table:\1 -->",
                                     doc.read_text(), re.S):
            headings = re.findall(r"^Measured on \*\*(.+?)\*\*: ", block, re.M)
            assert sorted(headings) == sorted(labels[lab]), f"{doc.relative_to(REPO)} ({lab})"
            checked += 1
    assert checked >= 5


# --- every repository path, module name and script flag the docs quote exists -------------------------

#: Top-level folders of this repository: a quoted path that starts with one is a path of this repository.
REPO_FOLDERS = ("chapters", "labs", "common", "scripts", "docs", "slurm", "tests", "bench", "environments",
                "reference-results", ".ci")
#: A name in a path that stands for any name (``labs/labNN.py``, ``slurm/sites/NAME.yaml``, ``<lab>``).
PLACEHOLDER = re.compile(r"NN|XX|[<>{}$…]|\.\.\.|(?:^|/)[A-Z][A-Z0-9_]*(?:[./]|$)")
PATH = re.compile(r"(?<![\w./$-])((?:%s)/[\w./*-]*[\w*/])" % "|".join(re.escape(f) for f in REPO_FOLDERS))
RELATIVE = re.compile(r"(?<![\w./$-])((?:[\w-]+/)+[\w.-]+\.(?:py|sh|j2))(?![\w/])")
MODULE = re.compile(r"(?<![\w.])(common(?:\.\w+)+)")
#: One of this repository's scripts (its path, or in its own folder its name) and its arguments up to
#: the end of the command (a comment, a pipe, ``&&``, ``;``, ``&``, a redirection).
COMMAND = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh))((?:[ \t]+(?![#|&;>])\S+)*)")


@functools.lru_cache(maxsize=None)
def tracked() -> tuple[str, ...]:
    """The repository's files (committed, or new and not ignored), relative to its root."""
    return tuple(subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.split())


@functools.lru_cache(maxsize=None)
def documents() -> tuple[tuple[Path, str, bool], ...]:
    """Every Markdown file and every docstring of a Python file: ``(file, text, is Markdown)``."""
    found = []
    for name in tracked():
        path = REPO / name
        if not path.is_file():
            continue
        if name.endswith(".md"):
            found.append((path, path.read_text(), True))
        elif name.endswith(".py"):
            tree = ast.parse(path.read_text())
            nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                            ast.ClassDef)))]
            found += [(path, doc, False) for doc in map(ast.get_docstring, nodes) if doc]
    return tuple(found)


@functools.lru_cache(maxsize=None)
def tracked_kinds() -> tuple[frozenset[str], frozenset[str]]:
    """The suffixes of the repository's files, and the names of its folders."""
    return (frozenset(Path(f).suffix for f in tracked()),
            frozenset(part for f in tracked() for part in Path(f).parts[:-1]))


def missing_path(token: str, where: Path) -> bool:
    """A path the docs quote that is neither in the repository nor something a run makes: a path of a
    top-level folder of the repository, or one relative to the document's folder (or to any folder:
    ``sbatch/inject.sbatch.j2`` in a lab's README)."""
    files, (suffixes, folders) = tracked(), tracked_kinds()
    token = token.rstrip(".")
    suffix = Path(token).suffix
    if PLACEHOLDER.search(token) or (suffix and suffix not in suffixes):
        return False  # a placeholder, or a kind of file only a run makes (a .sif image, a .out log)
    if "*" in token:
        return not any(REPO.glob(token))
    if (REPO / token).exists() or (where.parent / token).exists():
        return False
    if token.split("/")[0] not in folders:
        return False  # another project's path (pytorch/examples' mnist/main.py)
    return not any(f.endswith("/" + token) for f in files)


def module_defines(path: Path, names: list[str]) -> bool:
    """``path`` (a module of ``common``) defines ``names[0]`` at the top, and ``names[1]`` in it, if any."""
    body = ast.parse(path.read_text()).body
    for name in names:
        defined = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined[node.name] = getattr(node, "body", [])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    defined.update({n.id: [] for n in ast.walk(target) if isinstance(n, ast.Name)})
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update({(alias.asname or alias.name).split(".")[0]: [] for alias in node.names})
        if name not in defined:
            return False
        body = defined[name]
        if not body:  # a variable or an import: what it holds is not read here
            return True
    return True


def missing_module_name(dotted: str) -> bool:
    """``common.a.b.name.attr``: the longest prefix that is a module or package of ``common`` must define
    what follows it (a function, class, constant; a class's method)."""
    parts = dotted.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            return bool(rest) and not module_defines(module, rest[:2])
    return True


def test_every_repository_path_and_module_name_in_the_docs_exists():
    """Checked against the files, and for ``common.*`` names against the modules' own definitions. Test
    files' docstrings may name what must not exist (the checks' own examples): only their paths count."""
    stale = set()
    for where, text, _ in documents():
        stale.update(f"{where.relative_to(REPO)}: {token}" for token in PATH.findall(text) + RELATIVE.findall(text)
                     if missing_path(token, where))
        if "tests" not in where.relative_to(REPO).parts:
            stale.update(f"{where.relative_to(REPO)}: {dotted}" for dotted in MODULE.findall(text)
                         if missing_module_name(dotted))
    assert not stale, "the docs name what is not in the repository:\n" + "\n".join(sorted(stale))


@functools.lru_cache(maxsize=None)
def script_flags() -> dict[str, frozenset[str]]:
    """Every script's flags, by its path, from the parser its ``main`` parses with; ``gpu_proof.sh``
    passes its arguments to ``gpu_proof.py``."""
    from common.cli import _FormerName
    from test_script_paths import SCRIPTS, parsers, script_parser_of

    # A flag's former name still parses, but the docs teach the current one.
    flags = {relpath: frozenset(option for _, parser in parsers(script_parser_of(relpath))
                                for action in parser._actions if not isinstance(action, _FormerName)
                                for option in action.option_strings)
             for relpath in SCRIPTS}
    flags["scripts/gpu_proof.sh"] = flags["scripts/gpu_proof.py"]
    return flags


def code(text: str, markdown: bool) -> list[str]:
    """The code in ``text``: fenced blocks and `spans` of Markdown; indented lines and ``spans`` of a
    docstring. A line that ends in a backslash goes on in the next."""
    text = re.sub(r"\\\\?\n[ \t]*", " ", text)  # "\" (written "\\" in a docstring) at the end of a line
    if markdown:
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    else:
        blocks = re.findall(r"^(?: {4}|\t).*$", text, re.M)
        spans = re.findall(r"``([^`]+)``", text)
    return [line for block in blocks for line in block.splitlines()] + spans


def commands(text: str, markdown: bool = True):
    """``(script token, the flags given to it)`` for each command line in the code of ``text``."""
    for line in code(text, markdown):
        for script, rest in COMMAND.findall(line):
            arguments = rest.split()
            if "--" in arguments:  # what follows "--" goes to another program (Lab-05's training)
                arguments = arguments[:arguments.index("--")]
            yield script, {arg.split("=")[0] for arg in arguments if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", arg)}


def script_of(token: str, where: Path) -> str | None:
    """The script a command names: a path from the root, from the document's folder, or a name that
    only one script has."""
    flags = script_flags()
    for candidate in (REPO / token, where.parent / token):
        relative = str(candidate.resolve().relative_to(REPO)) if candidate.resolve().is_relative_to(REPO) else None
        if relative in flags:
            return relative
    named = [relpath for relpath in flags if Path(relpath).name == token]
    return named[0] if len(named) == 1 else None


def test_every_flag_the_docs_give_a_script_of_this_repository_exists():
    """Each command line in the docs' code that runs one of this repository's scripts passes only flags
    its parser has (the parser itself, so a renamed flag fails here, not in a student's terminal).
    torchrun's, srun's and sbatch's own flags, before the script's path, are not checked."""
    unknown, checked = set(), 0
    for where, text, markdown in documents():
        for token, given in commands(text, markdown):
            script = script_of(token, where)
            if script is not None:
                checked += len(given)
                unknown.update(f"{where.relative_to(REPO)}: {token} {flag}" for flag in given - script_flags()[script])
    assert not unknown, "flags the docs give scripts that their parsers do not have:\n" + "\n".join(sorted(unknown))
    assert checked > 200, checked


def test_the_doc_checks_find_what_they_forbid():
    """The negative control: a stale path, module name and flag, each in the shape the docs quote them."""
    readme = REPO / "labs" / "lab06_failures" / "README.md"
    assert missing_path("labs/lab06_failures/sbatch/inject_2node.sbatch.j2", readme)
    assert missing_path("sbatch/overlap.sbatch.j2", REPO / "labs" / "lab05_scaling" / "03_overlap.py")
    assert not missing_path("sbatch/inject.sbatch.j2", readme)
    assert missing_module_name("common.precision_names") and missing_module_name("common.cli.no_such_type")
    assert not missing_module_name("common.train.run.TrainingRun.finish")
    assert missing_module_name("common.train.run.TrainingRun.no_such_method")
    block = ("```bash\ntorchrun --nproc_per_node=2 labs/lab06_failures/01_inject.py --device cpu \\\n"
             "    --fault skip-collective --collective-timout 5   # a typo\n```\n")
    assert list(commands(block)) == [("labs/lab06_failures/01_inject.py",
                                      {"--device", "--fault", "--collective-timout"})]
    assert "--collective-timout" not in script_flags()["labs/lab06_failures/01_inject.py"]
    overlap = script_flags()["labs/lab05_scaling/03_overlap.py"]  # --steps: a former name of --repeats
    assert "--repeats" in overlap and "--steps" not in overlap


#: docs/conventions.md, item 3: what each count and rate flag means, in every script that takes it (its help's start).
VOCABULARY = {"--steps": "optimiser steps", "--max-steps": "stop each epoch after", "--repeats": "timed ",
              "--epochs": "number of epochs", "--lr": r"\w+( \(momentum [\d.]+\))? learning rate",
              "--log-interval": "(steps|batches) between loss lines"}


def test_a_count_flag_means_the_same_in_every_script_that_takes_it():
    """One step vocabulary: ``--steps`` is a run's total optimiser steps wherever it is offered (not a list of
    stages, not a benchmark's repeats: those have their own names), ``--lr`` a learning rate, and so on."""
    from common.cli import _FormerName
    from test_script_paths import SCRIPTS, parsers, script_parser_of

    seen: dict[str, list[str]] = {flag: [] for flag in VOCABULARY}
    wrong = []
    for relpath in SCRIPTS:
        for _, parser in parsers(script_parser_of(relpath)):
            for action in parser._actions:
                for flag in set(action.option_strings) & set(VOCABULARY):
                    if isinstance(action, _FormerName):
                        continue
                    seen[flag].append(relpath)
                    if not re.match(VOCABULARY[flag], action.help or ""):
                        wrong.append(f"{relpath} {flag}: {action.help}")
    assert not wrong, "\n".join(wrong)
    assert all(seen.values()), seen  # every word of the vocabulary is in use
    assert {"labs/lab06_failures/01_inject.py", "labs/lab07_model_parallel/01_tensor_parallel.py"} \
        <= set(seen["--steps"])


def test_the_results_schema_doc_states_the_version_records_are_written_with():
    from common.results import SCHEMA_VERSION

    doc = (REPO / "docs" / "results-schema.md").read_text()
    heading = re.match(r"# Result records \(schema `hpc-dl-labs/result`, version (\d+)\)", doc)
    row = re.search(r"^\| `schema_version` \| int \| `(\d+)`", doc, re.M)
    assert heading and row, "docs/results-schema.md lost its heading or its schema_version row"
    assert int(heading[1]) == int(row[1]) == SCHEMA_VERSION, (
        f"docs/results-schema.md says version {heading[1]} (heading) and {row[1]} (schema_version row); "
        f"common.results writes version {SCHEMA_VERSION}")


def test_a_doc_that_names_the_course_s_pytorch_floor_names_the_one_the_code_checks():
    """Lab-08's README said torchdata was 'not tested on the course's floor of 2.4'; the floor is 2.8, and
    scripts/torch_floor.sh runs Lab-08's lessons there."""
    from common import MINIMUM_VERSIONS

    floor = ".".join(map(str, MINIMUM_VERSIONS["torch"]))
    docs = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("labs/*/README.md"),
            *REPO.glob("chapters/*/README.md")]
    named = [(path.relative_to(REPO), found) for path in docs
             for found in re.findall(r"course's floor of (\d+\.\d+)", " ".join(path.read_text().split()))]
    assert named and all(version == floor for _, version in named), named

