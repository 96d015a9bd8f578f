"""The import graph of align, read from the source: every `import` statement counts (module level, inside
functions, under `if TYPE_CHECKING:`), so a circle hidden behind a lazy or type-only import is still a circle.

    pytest tests/test_layout.py        # what docs/ARCHITECTURE.md and issue 25's note cite
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "align"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the align modules it imports (a name imported from a package resolves to the submodule when
    there is one, else to the package)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(known(a.name) for a in node.names if a.name.split(".")[0] == "align")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package upwards
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] == "align":
                    deps.update(known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base)
                                for a in node.names)
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_hidden_behind_lazy_and_type_only_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_kind_of_import():
    graph = import_graph()
    assert "align.modeling.models" in graph["align.stages.judging"]  # a function-level import counts
    assert "align.runtime.process" in graph["align.orchestrator.warm"]  # a function-level import counts
    assert "align.config" in graph["align.modeling.generation"]  # `if TYPE_CHECKING:` counts
    assert len(graph) > 50


def test_align_has_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def _imports_from(graph: dict[str, set[str]], layer: tuple[str, ...], forbidden: tuple[str, ...],
                  allowed: set[tuple[str, str]] = frozenset()) -> dict[str, list[str]]:
    found = {m: sorted(d for d in deps if d.startswith(forbidden) and (m, d) not in allowed)
             for m, deps in graph.items() if m.startswith(layer)}
    return {m: d for m, d in found.items() if d}


SHARED = ("align.core", "align.config", "align.data", "align.templates")
ORCHESTRATOR = ("align.orchestrator",)
STAGE_SIDE = ("align.runtime", "align.stages", "align.modeling", "align.report")


def test_the_shared_layers_import_neither_process_side():
    """core, config, data and templates are read by both processes: they import nothing from the orchestrator, the
    stages, the modeling library or the report."""
    assert _imports_from(import_graph(), SHARED, ORCHESTRATOR + STAGE_SIDE) == {}


def test_the_orchestrator_imports_nothing_of_the_stage_processes():
    """What needs torch reaches the orchestrator through a helper process (a module path, not an import). The
    exceptions are the two ways into a stage process, each a function-level import of its entry point: warm.py's
    forked child, and `align stage SPEC` in the CLI (which is otherwise the orchestrator's)."""
    allowed = {("align.orchestrator.warm", "align.runtime.process"), ("align.cli", "align.runtime.process")}
    assert _imports_from(import_graph(), ORCHESTRATOR + ("align.cli",), STAGE_SIDE, allowed) == {}
    cli = ast.parse((PACKAGE / "cli.py").read_text(encoding="utf-8"))
    top = [n.module for n in cli.body if isinstance(n, ast.ImportFrom)]  # module level: what `align run` loads
    assert not [m for m in top if m and m.startswith(STAGE_SIDE)], top


def test_the_library_and_the_report_import_neither_the_orchestrator_nor_the_stages():
    graph = import_graph()
    assert _imports_from(graph, ("align.modeling", "align.report"), ORCHESTRATOR + ("align.runtime", "align.stages")) == {}


def test_no_orchestrator_module_imports_torch_or_a_library_that_does():
    """Read from the source, every import statement (function-level ones too): the runtime test
    (tests/test_orchestrator.py) only sees the paths it runs."""
    heavy = ("torch", "transformers", "trl", "peft", "deepspeed", "accelerate", "datasets", "vllm")
    found = []
    for f in [*sorted((PACKAGE / "orchestrator").glob("*.py")), PACKAGE / "cli.py"]:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{f.name}: {n}" for n in names if n.split(".")[0] in heavy]
    assert found == []


def test_the_shared_layers_import_no_heavy_library_but_the_hub_card_reader():
    """core, config, data and templates run in the torch-free orchestrator too. One function-level exception:
    reading a hub dataset card's rows (data/cards.py `_read_hub`) needs `datasets` (it does not import torch)."""
    heavy = ("torch", "transformers", "trl", "peft", "deepspeed", "accelerate", "datasets", "vllm")
    found = []
    for layer in ("core", "config", "data", "templates"):
        for f in sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{layer}/{f.name}: {n}" for n in names if n.split(".")[0] in heavy]
    assert sorted(found) == ["data/cards.py: datasets", "data/cards.py: datasets.utils"], found

