"""The installed package's import graph: no cycle, and each layer imports only the layers below it.

Read from the source of every module (`ast`), as Python imports it: module-level imports, not
those under `if TYPE_CHECKING:` (never run) nor those inside functions (run at the call, after
every module has loaded). Layers, from the bottom: `torch_compat` (every private torch API),
`runtime` (the IR ops, kernels and step-time machinery: it sees only `torch_compat` above it),
`passes` (the graph rewrites: `runtime` and `torch_compat`), and the rest of `zpp_compile`.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import networkx as nx

PACKAGE = "zpp_compile"
# What a module of each layer may import from the package, besides its own layer.
BELOW = {
    f"{PACKAGE}.runtime": {f"{PACKAGE}.torch_compat"},
    f"{PACKAGE}.passes": {f"{PACKAGE}.torch_compat", f"{PACKAGE}.runtime"},
}


def _source(name: str) -> Path | None:
    """The source file of the package's module `name`, as the installed package resolves it (an
    editable install maps `runtime` and `passes` to folders of their own); None if there is none."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # `from .x import y`, y a name rather than a module
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _imports(name: str, path: Path) -> list[str]:
    """What module `name` (source `path`) imports at import time, as absolute names: each
    `from M import x` gives M and M.x (x may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for statement in _run_at_import(ast.parse(path.read_text(), str(path)).body):
        if isinstance(statement, ast.Import):
            targets += [alias.name for alias in statement.names]
            continue
        source = statement.module
        if statement.level:
            parts = package.split(".")[: len(package.split(".")) - (statement.level - 1)]
            source = ".".join(parts + ([statement.module] if statement.module else []))
        targets += [source, *(f"{source}.{alias.name}" for alias in statement.names)]
    return [t for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")]


def import_graph() -> nx.DiGraph:
    """An edge from each module of the installed package to each of its modules it imports at
    import time. Modules are found in each package's folders and through the imports themselves."""
    graph = nx.DiGraph()
    waiting, seen = [PACKAGE], {PACKAGE}
    while waiting:
        name = waiting.pop()
        path = _source(name)
        if path is None:
            continue
        graph.add_node(name)
        imported = _imports(name, path)
        # A module's packages are imported before it, whatever it imports: no edge to them.
        graph.add_edges_from((name, target) for target in imported
                             if not name.startswith(target + ".") and target != name and _source(target))
        inside = [f"{name}.{info.name}" for info in pkgutil.iter_modules([str(path.parent)])] \
            if path.name == "__init__.py" else []
        for found in imported + inside:
            if found not in seen:
                seen.add(found)
                waiting.append(found)
    return graph


def _run_at_import(body: list[ast.stmt]):
    """The import statements of `body` that run when the module is imported."""
    for statement in body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            yield statement
        elif isinstance(statement, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(statement.test):
                yield from _run_at_import(statement.body)
            yield from _run_at_import(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, *(h.body for h in statement.handlers), statement.orelse,
                          statement.finalbody):
                yield from _run_at_import(block)


def _layer(module: str) -> str:
    for layer in BELOW:
        if module == layer or module.startswith(layer + "."):
            return layer
    return module


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {f"{PACKAGE}.reports.ledger", f"{PACKAGE}.runtime.registry", f"{PACKAGE}.passes.fx_util"} <= set(graph)
    assert graph.has_edge(f"{PACKAGE}.reports.ledger", f"{PACKAGE}.passes.fx_util")  # ledger.py: from .passes.fx_util
    assert graph.has_edge(f"{PACKAGE}.runtime.ops", f"{PACKAGE}.runtime.registry")  # ops.py: from .registry


def test_no_module_imports_itself_through_others():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle + cycle[:1]) for cycle in cycles)


def test_runtime_and_passes_import_only_the_layers_below_them():
    wrong = [(module, target) for module, target in import_graph().edges
             if _layer(module) in BELOW and _layer(target) != _layer(module)
             and _layer(target) not in BELOW[_layer(module)]]
    assert not wrong, wrong


def test_no_pass_imports_another():
    # What passes share lives in passes/base.py and passes/fx_util.py; a pass is one file.
    from zpp_compile.passes import PASSES

    pass_modules = {f"{PACKAGE}.passes.{p.run.__module__.rpartition('.')[2]}" for p in PASSES}
    assert len(pass_modules) == len(PASSES)  # one file per pass
    graph = import_graph()
    wrong = [(m, t) for m, t in graph.edges if m in pass_modules and t in pass_modules]
    assert not wrong, wrong
