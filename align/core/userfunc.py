"""A user's own function named `module:function` (a card's transform, a Python judge), imported with errors that
name the setting, the module and where it was looked for."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable


def import_function(name: str, what: str, folders: list[str], error: type[Exception],
                    where: Callable[[str], str]) -> Callable:
    """The callable `name` = `module:function`. `folders` are appended to the Python path (searched after it, as
    `python -m` would); a failure raises `error` naming `what` ("transform", "judge"), with `where(path)` (path: the
    module's file, e.g. pkg/mod.py) saying where to put the module."""
    module_name, _, func_name = name.partition(":")
    if not module_name or not func_name:
        raise error(f"{what} '{name}': expected module:function")
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} '{name}': cannot import module '{module_name}' ({exc}); "
                    f"{where(module_name.replace('.', '/') + '.py')}") from None
    expected = _in_folders(module_name, folders)
    found = getattr(module, "__file__", None)
    if expected is not None and (found is None or Path(found).resolve() != expected):
        # Python keeps one module per name: another card's module of this name (or one earlier on the path) was
        # imported instead, and would run in its place, its file hashed in its place
        raise error(f"{what} '{name}': module '{module_name}' is {found or 'a module without a file'}, not {expected}: "
                    "a module of that name was imported first from elsewhere (another card's or judge's module of "
                    "the same name, or one on the Python path), and Python holds one module per name. Give this one "
                    f"a name of its own (rename {expected.name} and the `{module_name}:{func_name}` that names it)")
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise error(f"{what} '{name}': module '{module_name}' has no function '{func_name}'")
    return fn


def _in_folders(module_name: str, folders: list[str]) -> Path | None:
    """The file `module_name` names in the first of `folders` that holds it (a module or a package), resolved."""
    rel = Path(*module_name.split("."))
    for folder in folders:
        for candidate in (Path(folder) / rel.with_suffix(".py"), Path(folder) / rel / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None
