"""The import graph of kvtide/: no module imports another that imports it back, and the policy floors
(engine/, scheduler/, kv_cache/) load no torch.

Every import counts, wherever it is written: at module level, inside a function (a lazy import is
still a dependency: it only moves the circle from import time to run time), under TYPE_CHECKING, and
`importlib.import_module("...")` / `__import__("...")` with a literal name. Relative imports are
resolved; `from pkg import name` is an import of the submodule pkg.name when there is one, else of
pkg. A module's parent packages are not edges of the cycle graph (importing a.b.c runs a/__init__
and a/b/__init__ first, but every submodule would then form a circle with a package __init__ that
imports it); the torch rule, which asks what actually runs, does follow them.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import textwrap

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "kvtide"

ALLOWED_CYCLES: list[frozenset[str]] = [
    # Each entry: the modules of one circle tolerated for now, with a comment saying why and what
    # unties it. Empty: kvtide/ has no circle.
]
"""Circles tolerated for now; this list is meant to stay empty. A circle passes only if all its
modules lie in one entry."""

POLICY_FLOORS = ("kvtide.engine", "kvtide.scheduler", "kvtide.kv_cache")
"""Request lifecycle, scheduling and block accounting: plain Python, no device code (DESIGN.md)."""

ALLOWED_TORCH_IN_FLOORS: set[str] = set()
"""Floor modules that still load torch, each with the reason (an importer that reaches torch only
through one of them passes too); this set is meant to be empty."""


# ---- the parser -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Import:
    target: str
    """Absolute dotted name: a module of the package when the import names one, else as written
    (`from torch import nn` -> "torch")."""
    line: int
    in_function: bool
    type_checking: bool
    """Under `if TYPE_CHECKING:` (never runs)."""

    @property
    def at_import_time(self) -> bool:
        """Runs when the importing module is imported."""
        return not self.in_function and not self.type_checking


def find_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under `root` (a package directory)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: dict[str, pathlib.Path]) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.found: list[Import] = []
        self._function_depth = 0
        self._type_checking_depth = 0

    def _add(self, target: str, node: ast.AST) -> None:
        self.found.append(Import(target, node.lineno, self._function_depth > 0, self._type_checking_depth > 0))

    def _absolute(self, name: str, level: int) -> str:
        if not level:
            return name
        parts = self.package.split(".")
        base = parts[: len(parts) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def _function(self, node: ast.AST) -> None:
        self._function_depth += 1
        self.generic_visit(node)
        self._function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_checking_depth += 1
        for child in node.body:
            self.visit(child)
        self._type_checking_depth -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module or "", node.level)
        for alias in node.names:
            submodule = f"{base}.{alias.name}" if base else alias.name
            self._add(submodule if submodule in self.known else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        target = _literal(node.args[0]) if name in ("import_module", "__import__") and node.args else None
        if target is not None and not target.startswith("."):
            self._add(target, node)
        elif target is not None and name == "import_module":  # relative to the `package` argument
            package = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "package"), None)
            anchor = _literal(package)
            if anchor is not None:
                level = len(target) - len(target.lstrip("."))
                parts = anchor.split(".")
                self._add(".".join(parts[: len(parts) - (level - 1)] + [target[level:]]), node)
        self.generic_visit(node)


def parse_imports(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[Import]:
    """Every import `module` (at `path`) makes, with targets resolved to the package's modules."""
    collector = _ImportCollector(module, path.name == "__init__.py", known)
    collector.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return [dataclasses.replace(i, target=_owning_module(i.target, known) or i.target) for i in collector.found]


def _owning_module(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The longest module of the package that `name` starts with ("kvtide.a.B" -> "kvtide.a")."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path) -> tuple[dict[str, pathlib.Path], dict[str, list[Import]]]:
    known = find_modules(root)
    return known, {m: parse_imports(m, p, known) for m, p in known.items()}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more nodes, each sorted (iterative: the
    graph's depth is not Python's recursion limit's business)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def import_cycles(root: pathlib.Path) -> tuple[list[list[str]], dict[str, list[Import]]]:
    known, imports = import_graph(root)
    edges = {m: {i.target for i in found if i.target in known and i.target != m} for m, found in imports.items()}
    return strongly_connected(edges), imports


def describe_cycle(cycle: list[str], imports: dict[str, list[Import]]) -> str:
    """The circle's modules and the imports that tie them, one a line."""
    members = set(cycle)
    lines = [f"circle of {len(cycle)}: {', '.join(cycle)}"]
    for module in cycle:
        for i in imports[module]:
            if i.target in members and i.target != module:
                where = "in a function" if i.in_function else "under TYPE_CHECKING" if i.type_checking else "module level"
                lines.append(f"    {module}:{i.line} -> {i.target} ({where})")
    return "\n".join(dict.fromkeys(lines))  # one line per import statement, not per name it imports


def is_torch(target: str) -> bool:
    return target == "torch" or target.startswith("torch.")


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def torch_importers(root: pathlib.Path, floors: tuple[str, ...], tolerated: frozenset[str] = frozenset()
                    ) -> dict[str, str]:
    """Floor module -> why it loads torch: it imports torch itself (anywhere but under
    TYPE_CHECKING), or imports (anywhere) a module of the package whose import-time imports,
    followed transitively with the parent packages Python runs first, reach torch. The `tolerated`
    modules are neither reported nor followed (every chain through them is theirs)."""
    known, imports = import_graph(root)
    imports = {m: [] if m in tolerated else found for m, found in imports.items()}

    def loads_torch(start: str) -> list[str] | None:
        """The chain of import-time imports from `start` to a module that imports torch, or None."""
        came_from: dict[str, str | None] = {start: None}
        queue = [start]
        while queue:
            module = queue.pop(0)
            runtime = [i for i in imports[module] if i.at_import_time]
            if any(is_torch(i.target) for i in runtime):
                chain = [module]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            for nxt in [i.target for i in runtime if i.target in known] + _parents(module):
                if nxt in known and nxt not in came_from:
                    came_from[nxt] = module
                    queue.append(nxt)
        return None

    offenders = {}
    for module in sorted(known):
        if not module.startswith(tuple(f"{f}." for f in floors)) and module not in floors:
            continue
        runs = [i for i in imports[module] if not i.type_checking]
        direct = [i for i in runs if is_torch(i.target)]
        if direct:
            offenders[module] = f"imports torch at line {direct[0].line}"
            continue
        reached = [(f"line {i.line} imports", i.target) for i in runs if i.target in known and i.target != module]
        reached += [("its package", parent) for parent in _parents(module) if parent in known]
        for how, target in reached:
            chain = loads_torch(target)
            if chain is not None:
                offenders[module] = f"{how} {' -> '.join(chain)} -> torch"
                break
    return offenders


# ---- kvtide ---------------------------------------------------------------------------------------
def test_no_import_cycles():
    cycles, imports = import_cycles(PKG)
    unexpected = [c for c in cycles if not any(set(c) <= allowed for allowed in ALLOWED_CYCLES)]
    assert not unexpected, "import circles (imports inside functions count):\n" + "\n".join(
        describe_cycle(c, imports) for c in unexpected)


def test_every_allowed_cycle_still_exists():
    """An allow-list entry whose circle is gone must go too, so the list only shrinks."""
    cycles, _ = import_cycles(PKG)
    stale = [sorted(allowed) for allowed in ALLOWED_CYCLES if not any(set(c) <= allowed for c in cycles)]
    assert not stale, f"these circles are gone: remove them from ALLOWED_CYCLES: {stale}"


def test_policy_floors_load_no_torch():
    offenders = torch_importers(PKG, POLICY_FLOORS, frozenset(ALLOWED_TORCH_IN_FLOORS))
    assert not offenders, "\n".join(f"{m}: {why}" for m, why in sorted(offenders.items()))


def test_every_module_allowed_torch_still_loads_it():
    """An allow-list entry whose module no longer loads torch must go too, so the list only shrinks."""
    stale = sorted(ALLOWED_TORCH_IN_FLOORS - set(torch_importers(PKG, POLICY_FLOORS)))
    assert not stale, f"these modules no longer load torch: remove them from ALLOWED_TORCH_IN_FLOORS: {stale}"


# ---- the parser on a package built to trip it -----------------------------------------------------
@pytest.fixture()
def trap_package(tmp_path):
    """pkg/: a <-> b through an import inside a function; c <-> d through an import_module string
    and a relative import; e and the package imports a one way only; floor/ with torch at every
    distance."""
    files = {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "import os\n\n\ndef later():\n    from pkg import b\n    return b\n",
        "pkg/b.py": "import pkg.a\n",
        "pkg/c.py": "import importlib\n\nMOD = importlib.import_module('pkg.d')\n",
        "pkg/d.py": "from . import c\n",
        "pkg/e.py": "from pkg.a import later\nfrom .sub import leaf\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "from ..a import later\n",
        "pkg/heavy.py": "import torch\n",
        "pkg/lazy.py": "def f():\n    import torch\n",
        "pkg/device/__init__.py": "from pkg import heavy\n",
        "pkg/device/light.py": "X = 1\n",
        "pkg/floor/__init__.py": "",
        "pkg/floor/clean.py": "from typing import TYPE_CHECKING\n\nfrom pkg import lazy\n\n"
                              "if TYPE_CHECKING:\n    import torch\n",
        "pkg/floor/direct.py": "def f():\n    from torch import nn\n",
        "pkg/floor/transitive.py": "def f():\n    from pkg.device import light\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_the_parser_finds_cycles_hidden_in_functions_and_import_module_strings(trap_package):
    cycles, imports = import_cycles(trap_package)
    assert cycles == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert {i.target for i in imports["pkg.e"]} == {"pkg.a", "pkg.sub.leaf"}
    assert [(i.target, i.in_function) for i in imports["pkg.a"]] == [("os", False), ("pkg.b", True)]
    assert "pkg.a:5 -> pkg.b (in a function)" in describe_cycle(cycles[0], imports)


def test_the_torch_rule_follows_functions_and_module_level_chains(trap_package):
    offenders = torch_importers(trap_package, ("pkg.floor",))
    assert sorted(offenders) == ["pkg.floor.direct", "pkg.floor.transitive"]
    assert "pkg.device -> pkg.heavy -> torch" in offenders["pkg.floor.transitive"]
    assert sorted(torch_importers(trap_package, ("pkg.floor",), frozenset({"pkg.heavy"}))) == ["pkg.floor.direct"]
