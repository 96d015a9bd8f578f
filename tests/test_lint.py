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
