"""The import graph of dptorch: no cycles, and every layer imports only what lies below it.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` of a
dptorch module, at module level or inside a function (a lazy import is still a dependency), but
not those under ``if TYPE_CHECKING:`` (never executed). ``from pkg import name`` depends on
``pkg/__init__`` unless ``name`` is a submodule, in which case it depends on that submodule.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dptorch"

#: modules under utils/ kept at Opacus's paths (``opacus.utils.X``); they re-export code that
#: lives above utils/ and may define nothing themselves
UTILS_ALIASES = {
    "dptorch.utils.batch_memory_manager",
    "dptorch.utils.fast_gradient_clipping_utils",
    "dptorch.utils.per_sample_gradients_utils",
}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """``{module: modules of the package at root that it imports}``."""
    pkg = root.name
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
                continue
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & paths.keys()
            if subs:
                deps |= subs
            if len(subs) < len(node.names):
                deps.add(target)
        graph[name] = {d for d in deps if d in paths and d != name and d.split(".")[0] == pkg}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


GRAPH = import_graph(ROOT)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_cycles() -> None:
    assert cycles(GRAPH) == []


def test_utils_imports_only_utils() -> None:
    """``utils/`` sits at the bottom: it imports only torch, numpy, the standard library and
    itself. The Opacus-path aliases are the exception, and they define nothing."""
    upward = {
        m: sorted(d for d in deps if not _in(d, "dptorch.utils"))
        for m, deps in GRAPH.items()
        if _in(m, "dptorch.utils") and m not in UTILS_ALIASES
    }
    assert {m: d for m, d in upward.items() if d} == {}
    for alias in UTILS_ALIASES:
        path = ROOT / "utils" / f"{alias.rsplit('.', 1)[1]}.py"
        body = ast.parse(path.read_text()).body
        defines = [
            type(n).__name__
            for n in body
            if not isinstance(n, (ast.Import, ast.ImportFrom))
            and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        ]
        assert defines == [], f"{alias} should only re-export, but defines {defines}"


def test_layering() -> None:
    """``modes.py`` imports nothing of dptorch; ``grad_sample/`` imports neither the optimizers
    nor the engine; only the package root and the user-facing front ends import the engine."""
    assert GRAPH["dptorch.modes"] == set()
    for m, deps in GRAPH.items():
        if _in(m, "dptorch.grad_sample"):
            bad = {d for d in deps if _in(d, "dptorch.optimizers") or d == "dptorch.privacy_engine"}
            assert bad == set(), f"{m} imports {bad}"
    front_ends = (
        "dptorch",
        "dptorch.integrations",
        "dptorch.lightning",
        "dptorch.auditing",
        "dptorch.cli",
        "dptorch.experimental",
        "dptorch.scripts",
    )
    engine_users = {m for m, deps in GRAPH.items() if "dptorch.privacy_engine" in deps}
    assert {m for m in engine_users if not any(_in(m, f) for f in front_ends)} == set()


def test_checker_sees_cycles_and_lazy_imports(tmp_path: pathlib.Path) -> None:
    """The checker itself: a cycle closed by a function-level import is found; one closed only
    under ``if TYPE_CHECKING:`` is not; ``from . import sub`` depends on ``sub`` only."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n"
    )
    (pkg / "d.py").write_text("from .c import z\n")
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


@pytest.mark.parametrize("alias", sorted(UTILS_ALIASES))
def test_aliases_export_the_real_objects(alias: str) -> None:
    import importlib

    mod = importlib.import_module(alias)
    assert mod.__all__, alias
    for name in mod.__all__:
        obj = getattr(mod, name)
        assert obj.__module__ != alias, f"{alias}.{name} should be the real object, not a copy"
