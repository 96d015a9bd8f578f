"""The repository is clean under ruff with the rules in pyproject.toml ([tool.ruff]): pyflakes (unused imports and
variables, undefined names), pycodestyle errors and warnings, and bugbear (likely bugs)."""

from __future__ import annotations

import shutil
import subprocess

from conftest import REPO


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(REPO / ".venv" / "bin" / "ruff")
    proc = subprocess.run([ruff, "check", "align", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _sizes():
    """(module, lines) for every module of align/, and (module:function, lines) for every function in them."""
    import ast

    modules, functions = [], []
    for f in sorted((REPO / "align").rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        rel = f.relative_to(REPO).as_posix()
        modules.append((rel, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((f"{rel}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1))
    return modules, functions


def test_no_module_over_400_lines_and_no_function_over_60():
    """A module that grows past 400 lines holds more than one concept; a function past 60 lines no longer reads in
    one screen (issue 37's bounds): split it where the concepts part."""
    modules, functions = _sizes()
    assert len(modules) > 50 and max(n for _, n in functions) > 30  # the walk sees the package
    assert [m for m in modules if m[1] > 400] == []
    assert [f for f in functions if f[1] > 60] == []
