"""The package's shape: one import direction (no cycles between modules or folders, function-level
imports included), a small top level, and every stage name spelled in the stage table only. File lengths and
folder sizes are reported, not enforced (a file past ~500 lines or a folder past 16 modules is worth a second
look, never a reason to move code elsewhere: DESIGN.md's conventions)."""

import ast
import warnings
from pathlib import Path

import networkx as nx

from saguaro.core.stages import STAGES

PACKAGE = Path(__file__).resolve().parents[1] / "saguaro"
REVIEW_LINES = 500  # past this, a file is reported for a second look
REVIEW_MODULES_PER_FOLDER = 16
MAX_TOP_LEVEL = 6  # __init__ included


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set) -> set:
    """Saguaro modules ``path`` imports anywhere in its body (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from saguaro.x import y`` imports saguaro.x, or the submodule saguaro.x.y
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def import_graph() -> nx.DiGraph:
    mods = modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for target in imports_of(path, set(mods)):
            if (
                target != name and target != "saguaro"
            ):  # the package __init__ is the public entry, not a layer
                g.add_edge(name, target)
    return g


def folder(module: str) -> str:
    """The package a module lives in: ``saguaro.runtime.decode.ssd`` → ``saguaro.runtime.decode``; a
    package's ``__init__`` belongs to the package; modules directly in ``saguaro/`` form one folder."""
    parts = module.split(".")
    is_package = (PACKAGE.parent.joinpath(*parts) / "__init__.py").exists()
    name = module if is_package else ".".join(parts[:-1])
    return "saguaro (top level)" if name == "saguaro" else name


TOP = "saguaro (top level)"
# What each folder may import (besides itself): the direction its __init__ docstring states.
ALLOWED = {
    "saguaro.core": set(),
    "saguaro.tensor_math": set(),
    "saguaro.capture": {"saguaro.core"},
    "saguaro.lower": {"saguaro.core"},
    "saguaro.passes.base": {"saguaro.core"},
    "saguaro.passes": {"saguaro.passes.base", "saguaro.core", "saguaro.capture", "saguaro.tensor_math"},
    "saguaro.runtime.base": {"saguaro.core", "saguaro.capture", "saguaro.tensor_math"},
    "saguaro.runtime.draft": {"saguaro.runtime.base", "saguaro.core", "saguaro.tensor_math"},
    "saguaro.runtime.lanes": {"saguaro.runtime.draft", "saguaro.runtime.base", "saguaro.core"},
    "saguaro.runtime.decode": {
        "saguaro.runtime.lanes",
        "saguaro.runtime.draft",
        "saguaro.runtime.base",
        "saguaro.core",
        "saguaro.tensor_math",
    },
    "saguaro.runtime": {
        "saguaro.runtime.decode",
        "saguaro.runtime.lanes",
        "saguaro.runtime.draft",
        "saguaro.runtime.base",
        "saguaro.core",
        "saguaro.capture",
        "saguaro.tensor_math",
    },
    "saguaro.artifact": {
        "saguaro.core",
        "saguaro.capture",
        "saguaro.passes",
        "saguaro.lower",
        "saguaro.runtime",
        "saguaro.runtime.base",
        "saguaro.runtime.draft",
        "saguaro.runtime.lanes",
        "saguaro.tensor_math",
    },
    "saguaro.inspection": {"saguaro.core", "saguaro.passes", "saguaro.lower", "saguaro.runtime.base", TOP},
    "saguaro.bench": {"saguaro.runtime.base", "saguaro.core", "saguaro.tensor_math", TOP},
    "saguaro.serve": {"saguaro.core", "saguaro.runtime", "saguaro.runtime.base", TOP},
    TOP: {
        "saguaro.core",
        "saguaro.capture",
        "saguaro.passes",
        "saguaro.lower",
        "saguaro.tensor_math",
        "saguaro.artifact",
        "saguaro.runtime",
        "saguaro.runtime.base",
        "saguaro.runtime.draft",
        "saguaro.runtime.lanes",
    },
}
FOLDERS_ANYWHERE = {"saguaro.cli"}  # the command line may import any folder; nothing imports it


def folder_graph() -> nx.DiGraph:
    g = import_graph()
    folders = nx.DiGraph()
    folders.add_nodes_from(folder(m) for m in g if m != "saguaro")
    folders.add_edges_from(
        (folder(a), folder(b)) for a, b in g.edges if folder(a) != folder(b) and a != "saguaro"
    )
    return folders


def test_the_import_graph_sees_function_level_imports():
    g = import_graph()
    assert g.has_edge(
        "saguaro.runtime.lanes.owner", "saguaro.runtime.lanes.process"
    )  # imported inside a function
    assert g.has_edge("saguaro.compile", "saguaro.passes.pipeline")


def test_no_cycle_between_modules():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"module import cycles: {cycles}"


def test_no_cycle_between_folders():
    cycles = list(nx.simple_cycles(folder_graph()))
    assert not cycles, f"folder import cycles: {cycles}; edges: {sorted(folder_graph().edges)}"


def test_every_folder_imports_only_what_it_may():
    folders = folder_graph()
    unknown = set(folders) - set(ALLOWED) - FOLDERS_ANYWHERE
    assert not unknown, (
        f"folders without a declared direction (add them to ALLOWED and their __init__): {unknown}"
    )
    wrong = {(a, b) for a, b in folders.edges if a not in FOLDERS_ANYWHERE and b not in ALLOWED[a]}
    assert not wrong, f"imports against the declared direction: {sorted(wrong)}"
    assert not [a for a, b in folders.edges if b in FOLDERS_ANYWHERE], "the library imports the CLI"


def test_every_folder_says_what_lives_there_and_what_it_may_import():
    for package in sorted(PACKAGE.rglob("__init__.py")):
        if package.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(package.read_text())) or ""
        assert "import" in doc.lower() and len(doc.splitlines()) <= 4, (
            f"{package.relative_to(PACKAGE.parent)}: {doc!r}"
        )


def test_the_top_level_stays_small_and_big_folders_are_reported():
    counts = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    big = {str(d.relative_to(PACKAGE.parent)): n for d, n in counts.items() if n > REVIEW_MODULES_PER_FOLDER}
    if big:
        warnings.warn(
            f"folders with more than {REVIEW_MODULES_PER_FOLDER} modules, worth a second look: {big}",
            stacklevel=2,
        )
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules directly in saguaro/: {top}"


def test_only_the_lanes_name_server_methods():
    """Outside ``runtime/lanes/``, nothing posts or calls a lane with a method given as a string."""
    offenders = []
    for module, path in modules().items():
        if module.startswith("saguaro.runtime.lanes"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"post", "call"}
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                offenders.append(f"{module}:{node.lineno} {node.func.attr}({node.args[0].value!r})")
    assert not offenders, offenders


def test_runtime_imports_neither_passes_nor_lowering_nor_compile():
    g = import_graph()
    runtime = [m for m in g if m.startswith("saguaro.runtime")]
    forbidden = {m for m in g if m.startswith("saguaro.passes")} | {
        "saguaro.lower.lowering",
        "saguaro.compile",
    }
    reached = {t for m in runtime for t in nx.descendants(g, m)} & forbidden
    assert not reached, f"the runtime reaches {sorted(reached)}"


def test_long_files_are_reported():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in modules().values()
        if (n := len(p.read_text().splitlines())) > REVIEW_LINES
    }
    if long:
        warnings.warn(f"files over {REVIEW_LINES} lines, worth a second look: {long}", stacklevel=2)
    assert modules(), "no modules found: the report would say nothing"


def test_every_stage_name_is_spelled_in_one_module():
    names = {s.name for s in STAGES} | {s.qualified for s in STAGES}
    where: dict = {}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                where.setdefault(node.value, set()).add(module)
    spread = {name: sorted(mods) for name, mods in where.items() if len(mods) > 1}
    assert not spread, f"stage names spelled in several modules: {spread}"
    assert set().union(*where.values()) <= {"saguaro.core.stages"}, where
