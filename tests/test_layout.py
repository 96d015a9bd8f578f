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
    assert "align.modeling.models" in graph["align.judges.pointwise"]  # a function-level import counts
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
    """core, config, data and templates run in the torch-free orchestrator too, and so do the registries they read:
    the engines' (align/engines/__init__.py, kinds.py, vllm_env.py) and the Python judges' (align/judges/__init__.py). One
    function-level exception:
    reading a hub dataset card's rows (data/sources.py `_read_hub`) needs `datasets` (it does not import torch)."""
    heavy = ("torch", "transformers", "trl", "peft", "deepspeed", "accelerate", "datasets", "vllm")
    found = []
    torch_free = [PACKAGE / "engines" / n for n in ("__init__.py", "kinds.py", "vllm_env.py")] + [PACKAGE / "judges" / "__init__.py"]
    for layer in ("core", "config", "data", "templates", "registries"):
        for f in torch_free if layer == "registries" else sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{layer}/{f.name}: {n}" for n in names if n.split(".")[0] in heavy]
    assert sorted(found) == ["data/sources.py: datasets", "data/sources.py: datasets.utils"], found



def test_outside_the_engines_package_nothing_names_an_engine():
    """An engine's home is align/engines/: elsewhere no module imports an engine's own module (only the registry,
    align.engines, and the interface, align.engines.base), names an engine class, or compares with an engine's name
    (a string constant equal to one). Stages ask the engine's kind instead (EngineKind: own copy, problems, memory)."""
    from align.engines import engine_names
    from align.engines.hf import HFEngine
    from align.engines.vllm import VLLMEngine

    names, classes = set(engine_names()), {HFEngine.__name__, VLLMEngine.__name__}
    assert {"hf", "vllm"} <= names
    # packaged.py's "hf" is the directory a packaged model's converted Hugging Face files go in, not the engine
    allowed = {("core/packaged.py", "hf")}
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel.startswith("engines/"):
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef,
                      ast.FunctionDef, ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings \
                    and (rel, node.value) not in allowed:
                found.append(f"{rel}:{node.lineno}: the string {node.value!r}")
            if isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) in classes:
                found.append(f"{rel}:{node.lineno}: {getattr(node, 'id', None) or node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("align.engines.") \
                    and node.module != "align.engines.base":
                found.append(f"{rel}:{node.lineno}: imports {node.module}")
            if isinstance(node, ast.ImportFrom) and node.module == "align.engines":
                found += [f"{rel}:{node.lineno}: imports {a.name}" for a in node.names if a.name in classes | {"hf", "vllm", "vllm_env"}]
    assert found == []


def test_the_engine_check_finds_what_it_looks_for(tmp_path):
    """The check above is not vacuous: each kind of naming it refuses is found in a module written to break it."""
    source = ('from align.engines.vllm import VLLMEngine\n'
              'def pick(gen):\n    """Mentions vllm and "hf" in a docstring: allowed."""\n'
              '    return gen.engine == "vllm" or isinstance(gen, VLLMEngine)\n')
    tree = ast.parse(source)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in ("hf", "vllm")]
    assert strings == ["vllm"]  # the comparison; the docstring is a longer string
    assert [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] == ["align.engines.vllm"]
    assert [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "VLLMEngine"] == ["VLLMEngine"]


def test_a_stage_type_imports_no_other_stage_types_module():
    """What several stage types share lives outside their modules (runtime/, judges/, report/, modeling/; GRPO and
    RLOO's common base, stages/online_rl.py, is no stage type): a stage module that imported another type's module
    would tie the two together, and moving or removing one would break the other."""
    from align.config import stage_types

    modules = {cls.stage_module() for cls in stage_types().values()}
    owner = {m.removeprefix("align.stages.").split(".")[0] for m in modules if m.startswith("align.stages.")}
    assert {"sft", "reward", "dpo", "ppo", "evaluate", "grpo", "rloo"} <= owner
    graph = import_graph()
    found = {m: sorted(d for d in deps if d.startswith("align.stages.")
                       and d.removeprefix("align.stages.").split(".")[0] in owner
                       and d.removeprefix("align.stages.").split(".")[0] != m.removeprefix("align.stages.").split(".")[0])
             for m, deps in graph.items() if m.startswith("align.stages.")}
    assert {m: d for m, d in found.items() if d} == {}
