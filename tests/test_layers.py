"""The package's layers (issue 35), read from the source with `ast`, never by importing it.

1. Imports point down the layer table (`LAYERS`) or stay within a layer. Every import statement counts: at module
   level, inside functions and inside `try`; only those under `if TYPE_CHECKING:` do not (they never run). Every
   module of the package must fall in the table: a new top-level module or package fails until it is placed.
2. No import cycle among the package's modules, nor among the experiment files (module-level graph, all imports).
3. No monkeypatching (`monkeypatching` says what counts): no `setattr(` call at all; no `getattr(X, ...)`,
   `X.attr = ...` or `del X.attr` where X is a name imported from the package (a module, a class); no function
   installed on, attribute wrapped on or attribute deleted from another object. The interpreter's documented hook
   slots (`HOOKS`: `sys.unraisablehook`, `sys.excepthook`, ...) are made to be assigned and do not count.

Each failure lists the offending file:line and what it does.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.test_imports import cycles  # Tarjan over a module graph, shared with the import test

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mgrpo_jax"
TREES = ("mgrpo_jax", "experiments", "launch")

# Bottom to top. A module belongs to the entry that is its name or its longest dotted prefix (`mgrpo_jax` itself,
# the package's __init__, only by its exact name: everything that imports a submodule runs it, so it must import
# nothing of the package). Within level 0 the order follows what the modules import: the tier-0a modules import
# no other part of the package; tokenizer_hf extends tokenizer, config reads presets (and names from core, store).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0a", ("mgrpo_jax", "mgrpo_jax.runtime", "mgrpo_jax.core", "mgrpo_jax.store", "mgrpo_jax.presets",
            "mgrpo_jax.tokenizer")),
    ("0b", ("mgrpo_jax.tokenizer_hf",)),
    ("1", ("mgrpo_jax.model", "mgrpo_jax.env")),
    ("1b", ("mgrpo_jax.config",)),  # validates against the model and env registries
    ("2", ("mgrpo_jax.sampling",)),
    ("3", ("mgrpo_jax.rollout",)),
    ("4", ("mgrpo_jax.agent",)),
    ("5", ("mgrpo_jax.rl",)),
    ("6", ("mgrpo_jax.bench",)),
    ("7", ("launch", "experiments")),  # above everything: nothing imports them
)
LEVEL = {member: (i, label) for i, (label, members) in enumerate(LAYERS) for member in members}


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, label) of the table entry `module` belongs to, or None when it is in none."""
    if module == PACKAGE:
        return LEVEL[PACKAGE]
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix != PACKAGE and prefix in LEVEL:
            return LEVEL[prefix]
    return None


# -- reading the source ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the module imported (`from a.b import c`: a.b.c when that is a module, else a.b)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(root: Path = ROOT, trees=TREES) -> dict[str, Path]:
    return {module_name(p, root): p for tree in trees for p in sorted((root / tree).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (its `else:` still counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            stack.append(node.test)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _base(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative ones resolved against the importing module)."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def imports(name: str, tree: ast.AST, modules, is_package: bool = False) -> list[Import]:
    """The modules `name` imports (any depth, any scope but TYPE_CHECKING blocks), with their lines."""
    found = []
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, is_package, node)
            found += [Import(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
                      for a in node.names]
    return sorted(set(found), key=lambda i: (i.line, i.target))


class Parsed:
    def __init__(self, root: Path = ROOT, trees=TREES):
        self.root = root
        self.paths = sources(root, trees)
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, path in self.paths.items()}
        self.imports = {name: imports(name, tree, self.paths, self.paths[name].name == "__init__.py")
                        for name, tree in self.trees.items()}

    def where(self, name: str, line: int) -> str:
        return f"{self.paths[name].relative_to(self.root)}:{line} ({name})"


# -- the checks ------------------------------------------------------------------------------------------------------


def unplaced(parsed: Parsed) -> list[str]:
    """Modules of the package (and imported package names) that no layer holds."""
    out = [f"{parsed.paths[name].relative_to(parsed.root)} ({name}): in no layer of LAYERS"
           for name in parsed.paths if layer_of(name) is None]
    out += [f"{parsed.where(name, i.line)}: imports {i.target}, which is in no layer of LAYERS"
            for name, found in parsed.imports.items() for i in found
            if (i.target == PACKAGE or i.target.startswith(PACKAGE + ".")) and layer_of(i.target) is None]
    return out


def upward_imports(parsed: Parsed) -> list[str]:
    out = []
    for name, found in parsed.imports.items():
        own = layer_of(name)
        for i in found:
            target = layer_of(i.target)
            if own is not None and target is not None and target[0] > own[0]:
                out.append(f"{parsed.where(name, i.line)}, layer {own[1]}: imports {i.target}, layer {target[1]}")
    return out


def graph(parsed: Parsed, prefix: str) -> dict[str, dict[str, int]]:
    """Module -> {imported module: first line}, over the modules whose name starts with `prefix`."""
    nodes = [n for n in parsed.paths if n == prefix or n.startswith(prefix + ".")]
    edges = {}
    for name in nodes:
        edges[name] = {}
        for i in parsed.imports[name]:
            if i.target in nodes and i.target != name:
                edges[name].setdefault(i.target, i.line)
    return edges


def cycle_report(parsed: Parsed, prefix: str) -> list[str]:
    edges = graph(parsed, prefix)
    return [f"cycle {' <-> '.join(c)}: " + "; ".join(
        f"{parsed.where(a, edges[a][b])} imports {b}" for a in c for b in sorted(edges[a]) if b in c)
        for c in cycles(edges)]


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_OWNERS = ("self", "cls")


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` that are not inside a nested function or class (those are yielded, not entered)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.AST):
    """(target, the value assigned to it or None) of an assignment or `del`, tuples unpacked."""
    if isinstance(node, ast.Assign):
        pending = [(t, node.value) for t in node.targets]
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        pending = [(node.target, None)]
    elif isinstance(node, ast.Delete):
        pending = [(t, None) for t in node.targets]
    else:
        return
    while pending:
        target, value = pending.pop()
        if isinstance(target, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts) \
                else [None] * len(target.elts)
            pending.extend(zip(target.elts, values, strict=True))
        elif isinstance(target, ast.Starred):
            pending.append((target.value, None))
        else:
            yield target, value


def _bound_names(targets) -> set[str]:
    """The plain names an assignment binds (`a, (b, *c) = ...`; not the `x` of `x.attr = ...`)."""
    names, pending = set(), list(targets)
    while pending:
        target = pending.pop()
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Tuple | ast.List):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
    return names


def _params(scope: ast.AST) -> set[str]:
    if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return set()
    a = scope.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}


def _bindings(name: str, scope: ast.AST, inherited: set[str], is_package: bool) -> set[str]:
    """The names that stand for a module, class or function of the package in `scope`: imported from it here or in
    an enclosing scope (unless a parameter or a plain assignment here shadows them), or aliases of those
    (`cls = slots.DecodeSlots`)."""
    imported, assigned = set(), set()
    for node in _own_nodes(scope):
        if isinstance(node, ast.Import):
            imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."))
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, is_package, node)
            if base == PACKAGE or base.startswith(PACKAGE + "."):
                imported.update(alias.asname or alias.name for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.For | ast.AsyncFor):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            assigned.update(_bound_names(targets))
    bound = (inherited - _params(scope) - assigned) | imported
    for _ in range(2):  # an alias of an alias
        for node in _own_nodes(scope):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name | ast.Attribute) \
                    and _root_name(node.value) in bound:
                bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return bound


# Slots the standard library documents as the way to install a handler: assigning them is their API, not a patch.
HOOKS = frozenset({"sys.unraisablehook", "sys.excepthook", "sys.displayhook", "sys.breakpointhook",
                   "threading.excepthook"})


def monkeypatching(name: str, tree: ast.AST, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, what) of each way one module changes another's objects from outside:

    - a `setattr(` call on anything but `self` / `cls` (an object naming its own attributes, as an nnx module
      builds its parameters, is not patching);
    - `getattr(X, ...)`, `X.attr = ...`, `X.attr += ...` or `del X.attr` where X is a name of the package (imported
      from it, or an alias of such a name);
    - on any object but `self` / `cls`: `del obj.attr`, `obj.attr = f` with f a lambda or a function defined in
      this module (installing it), `obj.attr = Wrapper(obj.attr, ...)` (wrapping what was there), unless
      `obj.attr` is one of the documented `HOOKS`.
    """
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    found = []

    def visit(scope, inherited):
        bound = _bindings(name, scope, inherited, is_package)
        for node in _own_nodes(scope):
            if isinstance(node, _SCOPES):
                visit(node, inherited if isinstance(scope, ast.ClassDef) else bound)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                first = node.args[0] if node.args else None
                if node.func.id == "setattr" and not (isinstance(first, ast.Name) and first.id in _OWNERS):
                    found.append((node.lineno, f"setattr({ast.unparse(first) if first else ''}, ...)"))
                elif node.func.id == "getattr" and isinstance(first, ast.Name) and first.id in bound:
                    found.append((node.lineno, f"getattr({first.id}, ...): {first.id} is a name of {PACKAGE}"))
            for target, value in _targets(node):
                if not isinstance(target, ast.Attribute):
                    continue
                root, what = _root_name(target), ast.unparse(target)
                verb = "del" if isinstance(node, ast.Delete) else "assigns"
                if root in bound:
                    found.append((node.lineno, f"{verb} {what}: {root} is a name of {PACKAGE}"))
                elif root in _OWNERS or what in HOOKS:
                    continue
                elif isinstance(node, ast.Delete):
                    found.append((node.lineno, f"del {what}: deletes another object's attribute"))
                elif isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in functions):
                    found.append((node.lineno, f"assigns {what} = {ast.unparse(value)}: installs a function on "
                                               "another object"))
                elif isinstance(value, ast.Call) and any(_same(arg, target) for arg in value.args):
                    found.append((node.lineno, f"assigns {what} = {ast.unparse(value.func)}({what}, ...): wraps "
                                               "another object's attribute"))

    visit(tree, set())
    return sorted(found)


def _same(a: ast.AST, b: ast.AST) -> bool:
    """The same expression (load or store)."""
    def key(node):
        return ast.dump(node, annotate_fields=False).replace("Store()", "Load()").replace("Del()", "Load()")
    return key(a) == key(b)


def monkeypatching_report(parsed: Parsed) -> list[str]:
    return [f"{parsed.where(name, line)}: {what}" for name, tree in parsed.trees.items()
            for line, what in monkeypatching(name, tree, parsed.paths[name].name == "__init__.py")]


def _fail_on(found: list[str], what: str) -> None:
    if found:
        print(f"{what}:", *found, sep="\n  ")
    assert not found, f"{what}:\n  " + "\n  ".join(found)


# -- the checks of the checks ----------------------------------------------------------------------------------------


def _parse(text: str) -> ast.AST:
    return ast.parse(text)


def test_imports_are_read_in_functions_relative_and_not_under_type_checking():
    tree = _parse("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mgrpo_jax.rl import x\n"
                  "else:\n    import mgrpo_jax.env\n"
                  "def f():\n    from mgrpo_jax.rollout import engine\n"
                  "try:\n    from . import sibling\nexcept ImportError:\n    pass\n"
                  "from ..core import losses\n")
    modules = {"mgrpo_jax.rollout.engine", "mgrpo_jax.model.sibling", "mgrpo_jax.core.losses"}
    found = imports("mgrpo_jax.model.thing", tree, modules)
    assert sorted((i.line, i.target) for i in found) == [
        (1, "os"), (2, "typing"), (6, "mgrpo_jax.env"), (8, "mgrpo_jax.rollout.engine"),
        (10, "mgrpo_jax.model.sibling"), (13, "mgrpo_jax.core.losses")]
    # in a package's __init__, `from . import x` is relative to the package itself
    assert imports("mgrpo_jax.model", _parse("from . import lora"), {"mgrpo_jax.model.lora"}, is_package=True) \
        == [Import(1, "mgrpo_jax.model.lora")]


def test_the_layer_table_places_modules_by_their_longest_prefix():
    assert layer_of("mgrpo_jax")[1] == "0a"
    assert layer_of("mgrpo_jax.config")[1] == "1b"
    assert layer_of("mgrpo_jax.env.compact.world")[1] == "1"
    assert layer_of("experiments.figures.runs")[1] == "7"
    assert layer_of("mgrpo_jax.newthing") is None  # an unplaced top-level module fails `test_every_module_...`
    assert layer_of("numpy") is None
    labels = [label for label, _ in LAYERS]
    assert len(labels) == len(set(labels)) and len(LEVEL) == sum(len(m) for _, m in LAYERS)


def test_cycles_are_found():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_monkeypatching_is_recognised_and_ordinary_attributes_are_not():
    tree = _parse("from mgrpo_jax.rl.trainer import Trainer\nimport mgrpo_jax.rollout.engine as engine\n"
                  "import mgrpo_jax.store\nfrom mgrpo_jax import presets\n"
                  "Trainer.rl_step = lambda self: None\n"         # 5
                  "engine.RolloutEngine.run = None\n"            # 6
                  "setattr(obj, 'x', 1)\n"                       # 7
                  "getattr(presets, name)\n"                     # 8
                  "mgrpo_jax.store.open_store = None\n"          # 9
                  "del Trainer.rl_step\n"                        # 10
                  "a, presets.X = 1, 2\n"                         # 11
                  "def f(agent, presets):\n"                     # 12: the parameter shadows the module
                  "    presets.x = 1\n"
                  "    cls = engine.RolloutEngine\n"
                  "    cls.run = None\n"                         # 15: an alias of a package class
                  "    agent.train = f\n"                        # 16: installs a function
                  "    agent.step = Timed(agent.step, 1)\n"      # 17: wraps
                  "    del agent.train\n"                        # 18
                  "    engine.x, presets.y = 1, 2\n"              # 19: engine, not presets (a parameter)
                  "    agent.steps = 3\n    agent.fn = g(x)\n    self.train = f\n    del self.cache\n"
                  "config.steps = 3\ngetattr(config, 'x')\nobject.__setattr__(self, 'a', 1)\n"
                  "presets_dict['x'] = 1\nclass C:\n    cls = 1\n    def m(cls):\n        cls.x = 1\n"
                  "sys.unraisablehook = f\nthreading.excepthook = f\n"  # 32, 33: documented hook slots
                  "sys.stdout.write = f\nsys.exit = f\n")             # 34, 35: not hooks
    assert [line for line, _ in monkeypatching("experiments.x", tree)] == [5, 6, 7, 8, 9, 10, 11, 15, 16, 17, 18, 19,
                                                                           34, 35]


# -- the package -----------------------------------------------------------------------------------------------------


PARSED = Parsed()


def test_every_module_of_the_package_is_in_a_layer():
    assert "mgrpo_jax.rl.trainer" in PARSED.paths and "experiments.figures.runs" in PARSED.paths
    _fail_on(unplaced(PARSED), "modules in no layer")


def test_no_import_points_up_a_layer():
    _fail_on(upward_imports(PARSED), "imports that point up a layer")


def test_no_import_cycles_among_the_package_modules():
    _fail_on(cycle_report(PARSED, PACKAGE), "import cycles in the package")


def test_no_import_cycles_among_the_experiment_files():
    _fail_on(cycle_report(PARSED, "experiments"), "import cycles in experiments/")


def test_no_monkeypatching():
    _fail_on(monkeypatching_report(PARSED), "monkeypatching")
