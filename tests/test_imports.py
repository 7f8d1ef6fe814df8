"""The package's modules import each other without cycles: every import statement counts, including those inside
functions (a lazy import hides a cycle from Python, not from a reader). The experiment files count too: they import
the package, so the package must never load them, by an import statement or by file path (importlib), a load no
import graph can see."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mgrpo_jax"
EXPERIMENTS = ROOT / "experiments"
# Calls that load a module other than by an import statement (from a file path, or a name computed at run time).
RUNTIME_LOADERS = {"spec_from_file_location", "spec_from_loader", "SourceFileLoader", "module_from_spec",
                   "exec_module", "load_module", "run_path", "run_module", "import_module", "__import__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(trees=(PACKAGE,)) -> dict[str, set[str]]:
    modules = {module_name(p): p for tree in trees for p in tree.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "mgrpo_jax.core.mgrpo" in graph["mgrpo_jax.core"]  # the package re-exports it
    assert "mgrpo_jax.core.alignment" in graph["mgrpo_jax.core.mgrpo"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def runtime_loads(source: str) -> list[str]:
    """The calls in `source` that load a module the import graph cannot see."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in RUNTIME_LOADERS:
                found.append(f"line {node.lineno}: {name}")
    return found


def test_no_import_cycles_between_the_package_modules():
    assert cycles(import_graph()) == []


def test_the_package_loads_modules_by_import_statements_only():
    """So the graph above has every edge: a module loaded by path (as `get_config` once loaded
    experiments/<benchmark>.py, which imports mgrpo_jax.config) would be a cycle it misses."""
    assert runtime_loads("import importlib.util\nspec = importlib.util.spec_from_file_location('x', 'x.py')\n"
                         "spec.loader.exec_module(m)\n") == ["line 2: spec_from_file_location", "line 3: exec_module"]
    found = {module_name(p): runtime_loads(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {name: calls for name, calls in found.items() if calls} == {}


def test_the_experiment_files_import_the_package_never_the_reverse():
    graph = import_graph((PACKAGE, EXPERIMENTS))
    assert "mgrpo_jax.config" in graph["experiments.xbench"]
    assert {name: sorted(e for e in edges if e.startswith("experiments"))
            for name, edges in graph.items() if name.startswith("mgrpo_jax")
            and any(e.startswith("experiments") for e in edges)} == {}
    assert [c for c in cycles(graph) if any(m.startswith("mgrpo_jax") for m in c)] == []
