"""The code's own rules (docs/ARCHITECTURE.md, "Rules the tree keeps"), read from the source in about a second:

- a run directory's names are made in job/layout.py only;
- no module imports another module's underscore name;
- no file of job/ over 500 lines, no function over 100;
- no module imports one of a higher layer (the layers below, as ARCHITECTURE draws them); the trainers' side
  imports nothing above the target's config and weights (it runs in its own environment);
- a stage changes its run directory only through its fence: storage's writing functions are called by the fence
  (job/lock.py) and by the modules that write outside any run (the exports, the tiny models);
- no private Ray API in job/ (it breaks on a Ray upgrade);
- no issue number in the product (docs, code, benches, configs, README): a reader cannot look one up.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

JOB = REPO / "job"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 100

# Bottom to top. A module may import modules of its own layer or of a lower one, never of a higher one. Each
# entry is job/'s first-level module or package.
LAYERS = [
    ("names", {"errors", "formatting", "layout", "rowranges", "schema", "drafters", "redaction"}),
    ("io and config", {"storage", "shard_reads", "conditional", "config", "trust_cache", "rows_cache", "runs",
                       "target", "target_weights"}),
    ("the trainers' side", {"trainers"}),
    ("runner", {"lock", "run_record", "scan", "cluster", "progress", "pipeline", "stage"}),
    ("stages", {"generate", "hidden_states"}),
    ("commands", {"export", "runview", "train", "worth", "builtin"}),
    ("entry", {"cli", "__main__"}),
]
LAYER_OF = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}

# Modules that call storage's writing functions themselves: the fence (every stage's writes go through it) and the
# writers of files outside any run directory, which no stage lock covers.
DIRECT_WRITERS = {
    "job/storage.py": "the functions themselves",
    "job/lock.py": "the fence: Fence.write_bytes/write_ipc/write_json/write_shard/delete/move",
    "job/export/files.py": "an export writes the trainer's files into the user's export directory",
    "job/export/trainer_format.py": "an export's samples list and export.json",
    "job/export/conversations.py": "the conversations export",
}
WRITING_FUNCTIONS = {"write_bytes_atomic", "write_ipc_atomic", "write_json", "write_shard", "write_lines", "delete",
                     "move", "remove_temp_files"}
RUN_DIRECTORY_NAMES = re.compile(r"(^|/)(completions|hidden_states|_done|reports|locks|quarantine|attempts|cache|"
                                 r"drafts)/|^run\.json$")


def sources(root: Path = JOB) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def module_key(path: Path) -> str:
    return path.relative_to(JOB).parts[0].removesuffix(".py")


def job_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of job's modules, at any depth (imports on use included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "job":
            names = [f"job.{a.name}" for a in node.names] if node.module == "job" else [node.module]
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "job"]
    return found


def docstring_ids(tree: ast.AST) -> set[int]:
    """The string constants that are docstrings (a module's, a class's, a function's, a field's)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    out.add(id(stmt.value))
    return out


def test_files_and_functions_stay_short():
    long_files = [f"{rel(p)}: {n} lines" for p in sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel(p)}:{node.lineno} {node.name}: {n} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines (split them by what they own): {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_no_module_imports_another_modules_underscore_name():
    found = []
    for p in [*sources(), *sources(REPO / "bench")]:
        tree = ast.parse(p.read_text())
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "job":
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{rel(p)}:{node.lineno} from {node.module} import {a.name}")
                    modules[a.asname or a.name] = node.module
            elif isinstance(node, ast.Import):
                modules.update({(a.asname or a.name.split(".")[0]): a.name for a in node.names
                                if a.name.split(".")[0] == "job"})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{rel(p)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, f"another module's underscore names (make the name public, or move the code): {found}"


def test_no_module_imports_a_higher_layer():
    assert set(LAYER_OF) >= {module_key(p) for p in sources() if p.name != "__init__.py" or p.parent != JOB}, \
        f"a module of job/ that no layer names: give it its layer in {__name__}.LAYERS and docs/ARCHITECTURE.md"
    upward = []
    for p in sources():
        if p.parent == JOB and p.name == "__init__.py":
            continue
        mine = LAYER_OF[module_key(p)]
        for line, name in job_imports(ast.parse(p.read_text())):
            theirs = LAYER_OF[name.split(".")[1]]
            if theirs > mine:
                upward.append(f"{rel(p)}:{line} imports {name} ({LAYERS[mine][0]} → {LAYERS[theirs][0]})")
    assert not upward, f"imports that run back up the layers: {upward}"


def test_run_directory_names_are_made_in_layout_only():
    found = []
    for p in sources():
        if rel(p) == "job/layout.py" or module_key(p) in ("export", "trainers"):  # their own formats' names
            continue
        tree = ast.parse(p.read_text())
        docs = docstring_ids(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and " " not in node.value and RUN_DIRECTORY_NAMES.search(node.value)):
                found.append(f"{rel(p)}:{node.lineno} {node.value!r}")
    assert not found, f"run-directory names written outside job/layout.py (use its constants and functions): {found}"


def test_a_stage_writes_only_through_its_fence():
    found = []
    for p in sources():
        if rel(p) in DIRECT_WRITERS:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in WRITING_FUNCTIONS
                    and isinstance(node.value, ast.Name) and node.value.id == "storage"):
                found.append(f"{rel(p)}:{node.lineno} storage.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "job.storage":
                found += [f"{rel(p)}:{node.lineno} from job.storage import {a.name}" for a in node.names
                          if a.name in WRITING_FUNCTIONS]
    assert not found, ("writes and deletes past the fence (call fence.write_bytes / write_json / write_shard / "
                       f"delete / move, job/lock.py): {found}")


def test_no_private_ray_api():
    found = [f"{rel(p)}:{i}" for p in sources() for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bray\._private\b|from ray\._|\bray\._raylet\b", line)]
    assert not found, f"private Ray APIs in job/ (use ray.* and ray.util.* only): {found}"


def test_no_issue_numbers_in_the_product():
    """Docs, code, benches, configs and the README speak to users: no "issue N" a reader cannot look up (a result
    file of bench/results/ is a record as it was made, and stays)."""
    roots = [JOB, REPO / "bench", REPO / "docs", REPO / "configs", REPO / "deploy"]
    paths = [p for root in roots for p in sorted(root.rglob("*")) if p.is_file()
             and p.suffix in (".py", ".md", ".sh", ".yaml")
             and "__pycache__" not in p.parts and "results" not in p.parts]
    paths += [REPO / "README.md", REPO / "Makefile", REPO / "cluster.yaml"]
    found = [f"{rel(p)}:{i}" for p in paths for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bissues? \d+\b|\bissues? #\d+\b|\bissue-\d+\b", line, re.IGNORECASE)]
    named = [rel(p) for p in paths if re.search(r"issue\d+", p.name)]
    assert not found and not named, f"issue numbers a reader cannot look up: {found[:20]} {named}"
