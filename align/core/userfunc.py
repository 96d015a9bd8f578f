"""A user's own function named `module:function` (a card's transform, a Python judge), imported with errors that
name the setting, the module and where it was looked for."""

from __future__ import annotations

import importlib
import sys
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
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise error(f"{what} '{name}': module '{module_name}' has no function '{func_name}'")
    return fn
