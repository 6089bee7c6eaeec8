"""The shape of the tree (docs/conventions.md, convention 2): every folder stands on ``common``.

These read source files only (``ast`` and text), so they take well under a second.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from helpers import REPO

#: Folders whose files must not import one another (nor bench/).
LESSON_FOLDERS = ("chapters", "labs", "scripts")
TOP_LEVEL = (*LESSON_FOLDERS, "bench", "common")


def python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (REPO / folder).rglob("*.py"))


def imported_modules(path: Path, root: Path = REPO) -> list[str]:
    """Every module ``path`` imports, as absolute names (a relative import resolved against its folder)."""
    package = path.relative_to(root).parent.parts
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            names.append(".".join([*base, *([node.module] if node.module else [])]))
    return names


def sideways_imports(path: Path, root: Path = REPO) -> list[str]:
    """The imports of ``path`` that reach outside ``common`` and its own folder.

    A chapter's or a lab's own folder is ``chapters/<chapter>`` or ``labs/<lab>``; for ``scripts``
    and ``bench`` it is the whole folder.
    """
    parts = path.relative_to(root).parts
    own = ".".join(parts[:2] if parts[0] in ("chapters", "labs") else parts[:1])
    return [name for name in imported_modules(path, root)
            if name.split(".")[0] in TOP_LEVEL and name.split(".")[0] != "common"
            and name != own and not name.startswith(own + ".")]


def test_chapters_labs_and_scripts_import_only_common_and_their_own_folder():
    found = {str(path.relative_to(REPO)): bad for path in python_files(*LESSON_FOLDERS) if (bad := sideways_imports(path))}
    assert found == {}


def test_bench_imports_only_common():
    found = {str(path.relative_to(REPO)): bad for path in python_files("bench") if (bad := sideways_imports(path))}
    assert found == {}


def test_common_imports_none_of_the_folders_that_stand_on_it():
    found = {str(path.relative_to(REPO)): [name for name in imported_modules(path)
                                           if name.split(".")[0] in (*LESSON_FOLDERS, "bench", "tests")]
             for path in python_files("common")}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_sideways_check_finds_what_it_forbids(tmp_path):
    # The checks above pass on an empty list; this shows the same detector reporting a sideways import.
    script = tmp_path / "chapters" / "ch16_gpu_distributed" / "example.py"
    script.parent.mkdir(parents=True)
    script.write_text("from labs.lab02_profiling import mnist_classify\nimport scripts.compare_results\n"
                      "from common import data\nfrom chapters.ch16_gpu_distributed import profiling\n"
                      "from . import memory_management\nfrom chapters.ch04_deep_learning import mnist_training\n",
                      encoding="utf-8")
    assert sideways_imports(script, root=tmp_path) == ["labs.lab02_profiling", "scripts.compare_results",
                                                       "chapters.ch04_deep_learning"]


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str], list[str] | None]:
    """(names bound at the top level, public names defined there, ``__all__`` or ``None``)."""
    bound, defined, declared = set(), set(), None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    if target.id == "__all__":
                        declared = list(ast.literal_eval(node.value))
                    else:
                        bound.add(target.id)
                        defined.add(target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return bound, {name for name in defined if not name.startswith("_")}, declared


def test_every_all_in_common_names_what_the_module_offers():
    # True both ways: each name in __all__ exists, and each public name the module defines is listed.
    checked = 0
    for path in python_files("common"):
        bound, public, declared = _top_level_names(ast.parse(path.read_text(encoding="utf-8")))
        if declared is None:
            continue
        checked += 1
        where = path.relative_to(REPO)
        assert sorted(set(declared) - bound) == [], f"{where}: __all__ names what it does not define"
        assert sorted(public - set(declared)) == [], f"{where}: public names missing from __all__"
        assert len(declared) == len(set(declared)), f"{where}: __all__ lists a name twice"
    assert checked >= 5


def test_no_public_function_or_class_in_common_is_dead():
    # A name defined in common and written nowhere else in the tree (scripts, tests, common) is dead.
    # Builders registered by a decorator are used through the registry, so decorated ones count as used.
    sources = {path: path.read_text(encoding="utf-8") for path in python_files(*TOP_LEVEL, "tests")}
    words = Counter(word for text in sources.values() for word in re.findall(r"\w+", text))
    dead = []
    for path in python_files("common"):
        for node in ast.parse(sources[path]).body:
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
                    and not node.decorator_list and words[node.name] < 2):
                dead.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert dead == []


def test_code_cites_only_documents_in_this_repository():
    # A docstring that says "see X.md" must point at a document a reader of this repository has
    # (a style guide kept elsewhere is no help to a student on a login node).
    folders = [folder for folder in REPO.iterdir() if folder.is_dir() and not folder.name.startswith(".")]
    documents = {path.relative_to(REPO) for path in [*REPO.glob("*.md"), *(p for f in folders for p in f.rglob("*.md"))]}
    cited = re.compile(r"[\w./*-]*\b[\w-]+\.md\b")
    missing = []
    for path in python_files(*TOP_LEVEL):
        for name in set(cited.findall(path.read_text(encoding="utf-8"))):
            if "*" in name:  # a glob pattern, not a citation
                continue
            if "/" not in name:
                found = any(document.name == name for document in documents)
            else:
                found = any(Path(name) == document or (path.parent / name).resolve() == (REPO / document).resolve()
                            for document in documents)
            if not found:
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert sorted(missing) == []


#: The lesson scripts a student reads first, and the most code (docstring and blank lines not
#: counted) each may have: the rest of a run's plumbing lives in ``common.train.run.TrainingRun``.
LINE_BUDGETS = {
    "chapters/ch04_deep_learning/mnist_training.py": 120,
    "chapters/ch04_deep_learning/multi_gpu_ddp.py": 135,
    "labs/lab01_dp_vs_ddp/04_ddp_training.py": 160,
    "labs/lab03_precision_benchmark/benchmark_models.py": 260,
    "labs/lab07_model_parallel/01_tensor_parallel.py": 100,
    "labs/lab07_model_parallel/02_pipeline_parallel.py": 140,
    "labs/lab07_model_parallel/03_2d_parallel.py": 120,
}


def code_lines(source: str) -> int:
    """Lines of code: not blank, not part of the module's docstring."""
    body = ast.parse(source).body
    docstring = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        docstring = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1) if line.strip() and number not in docstring)


def test_code_lines_leave_out_the_docstring_and_blank_lines():
    assert code_lines('"""One.\n\nTwo.\n"""\n\nimport os\n\n\ndef f():\n    return os.sep\n') == 3


def test_lesson_scripts_stay_within_their_line_budgets():
    counted = {script: code_lines((REPO / script).read_text(encoding="utf-8")) for script in LINE_BUDGETS}
    over = {script: lines for script, lines in counted.items() if lines > LINE_BUDGETS[script]}
    assert not over, f"lines of code over budget (budget in LINE_BUDGETS): {over}"
