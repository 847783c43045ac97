"""The package layout: no import cycles, the layers in order, modules of a readable size.

Imports are read with ``ast`` from every module of ``attnquant_core`` (module level, inside
functions and under ``TYPE_CHECKING`` alike: a cycle hidden behind a lazy import is still a
cycle), resolved to the modules they name, and the graph is checked to be acyclic.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import attnquant_core

ROOT = Path(attnquant_core.__file__).parent
PACKAGE = "attnquant_core"
#: Subpackages in dependency order: ``forms`` and ``io`` may import only those before them (and
#: the top-level private helpers ``_errors`` and ``_version``); ``fit`` builds on both.
LAYERS = ("forms", "io", "fit")
BASE_LAYERS = LAYERS[:2]
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The ``attnquant_core`` modules ``name`` imports (a package stands for its ``__init__``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # ``import a.b.c`` -> the deepest module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
                # importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first
                parent = target.rpartition(".")[0]
                while parent not in ("", PACKAGE, name) and not name.startswith(parent + "."):
                    found.add(parent)
                    parent = parent.rpartition(".")[0]
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = _cycle(GRAPH)
    assert cycle is None, (
        "import cycle (imports inside functions count too; import from the subpackage that "
        "defines a name, not from attnquant_core): " + " -> ".join(cycle or [])
    )


def test_the_import_graph_sees_the_layers():
    assert f"{PACKAGE}.forms._identity" in GRAPH[f"{PACKAGE}.fit._svd"]
    assert f"{PACKAGE}.io._manifest" in GRAPH[f"{PACKAGE}.fit._budget"]
    assert {f"{PACKAGE}.forms", f"{PACKAGE}.io", f"{PACKAGE}.fit"} <= GRAPH[PACKAGE]


@pytest.mark.parametrize("layer", BASE_LAYERS)
def test_base_layers_import_only_layers_below(layer):
    allowed = {f"{PACKAGE}.{below}" for below in LAYERS[: LAYERS.index(layer) + 1]}
    allowed |= {f"{PACKAGE}._errors", f"{PACKAGE}._version"}
    bad = {
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name == f"{PACKAGE}.{layer}" or name.startswith(f"{PACKAGE}.{layer}.")
        for target in targets
        if not any(target == a or target.startswith(a + ".") for a in allowed)
    }
    assert not bad, sorted(bad)


def test_serving_builds_on_the_layers_not_on_calib():
    """``serving`` (the options, the in-graph state prepared in numpy) uses forms, io and fit."""
    allowed = {f"{PACKAGE}.{layer}" for layer in LAYERS} | {f"{PACKAGE}.serving"}
    allowed |= {f"{PACKAGE}._errors", f"{PACKAGE}._version"}
    bad = {
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.startswith(f"{PACKAGE}.serving")
        for target in targets
        if not any(target == a or target.startswith(a + ".") for a in allowed)
    }
    assert not bad, sorted(bad)


#: What attnquant-core never imports: MAX and the packages built on it.
FORBIDDEN = ("max", "attnquant_max", "attnquant_kernels", "attnquant_cli")


def test_core_imports_neither_max_nor_the_other_packages():
    """Every import of every module (lazy ones too) stays out of MAX, kernels, max and cli."""
    found = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            found |= {f"{name}: {m}" for m in modules if m.partition(".")[0] in FORBIDDEN}
    assert not found, sorted(found)


@pytest.mark.parametrize("layer", LAYERS)
def test_modules_are_of_a_readable_size(layer):
    long = {
        name: n
        for name, path in MODULES.items()
        if name.startswith(f"{PACKAGE}.{layer}")
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_subpackages_export_what_the_top_level_does():
    """Every public name of ``attnquant_core`` is the very object its subpackage exports."""
    homes = [importlib.import_module(f"{PACKAGE}.{layer}") for layer in LAYERS]
    for name in attnquant_core.__all__:
        obj = getattr(attnquant_core, name)
        owners = [m for m in homes if name in m.__all__]
        if owners:
            assert all(getattr(m, name) is obj for m in owners), name


#: Outside core, the one deliberate use of a private module: the benchmark times the SVD inside
#: the real pipeline by replacing the module global the per-layer fit calls.
PRIVATE_ALLOWED = {"benchmarks/bench_decompose.py": {"attnquant_core.fit._decompose"}}
PRIVATE = re.compile(r"attnquant_core(\.[A-Za-z]\w*)*\._(?!_)\w*")


def test_nothing_outside_core_imports_a_private_module():
    """Other packages, the root tests and the benchmarks use the subpackages' public names."""
    repo = Path(__file__).resolve().parents[3]
    if not (repo / "packages" / "attnquant-core").is_dir():  # pragma: no cover - installed alone
        pytest.skip("not in the attnquant repository")
    files = [
        *(repo / "packages").glob("*/src/**/*.py"),
        *(repo / "packages").glob("*/tests/**/*.py"),
        *(repo / "tests").glob("**/*.py"),
        *(repo / "benchmarks").glob("*.py"),
    ]
    found = {}
    for path in files:
        rel = path.relative_to(repo).as_posix()
        if rel.startswith("packages/attnquant-core/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            bad = {
                n
                for n in names
                if PRIVATE.fullmatch(n) and n not in PRIVATE_ALLOWED.get(rel, set())
            }
            if bad:
                found.setdefault(rel, set()).update(bad)
    assert not found, found
