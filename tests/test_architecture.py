"""The package's shape: one import direction (no cycles between modules or folders, function-level
imports included), small files, and every stage name spelled in the stage table only."""

import ast
from pathlib import Path

import networkx as nx
import pytest

from saguaro.core.stages import STAGES

PACKAGE = Path(__file__).resolve().parents[1] / "saguaro"
MAX_LINES = 300


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
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
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
            if target != name and target != "saguaro":  # the package __init__ is the public entry, not a layer
                g.add_edge(name, target)
    return g


def folder(module: str) -> str:
    """``saguaro.runtime.program`` → ``saguaro.runtime``; top-level modules form one folder."""
    parts = module.split(".")
    is_package = (PACKAGE.parent.joinpath(*parts) / "__init__.py").exists()
    if len(parts) >= 3 or (len(parts) == 2 and is_package):
        return ".".join(parts[:2])
    return "saguaro (top level)"


def test_the_import_graph_sees_function_level_imports():
    g = import_graph()
    assert g.has_edge("saguaro.runtime.lane_owner", "saguaro.runtime.process_lane")  # imported inside a method
    assert g.has_edge("saguaro.compile", "saguaro.passes.pipeline")


def test_no_cycle_between_modules():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"module import cycles: {cycles}"


def test_no_cycle_between_folders():
    g = import_graph()
    folders = nx.DiGraph()
    folders.add_edges_from((folder(a), folder(b)) for a, b in g.edges if folder(a) != folder(b))
    cycles = list(nx.simple_cycles(folders))
    assert not cycles, f"folder import cycles: {cycles}; edges: {sorted(folders.edges)}"


def test_runtime_imports_neither_passes_nor_lowering_nor_compile():
    g = import_graph()
    runtime = [m for m in g if m.startswith("saguaro.runtime")]
    forbidden = {m for m in g if m.startswith("saguaro.passes")} | {"saguaro.lower", "saguaro.compile"}
    reached = {t for m in runtime for t in nx.descendants(g, m)} & forbidden
    assert not reached, f"the runtime reaches {sorted(reached)}"


@pytest.mark.parametrize("name,path", sorted(modules().items()))
def test_every_file_is_under_the_line_limit(name, path):
    lines = len(path.read_text().splitlines())
    assert lines < MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"


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
