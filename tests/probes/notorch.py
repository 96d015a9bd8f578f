"""Run the align CLI with torch unimportable in this process (tests/test_orchestrator.py): an import hook refuses
`torch` and its submodules before align is imported. Child processes (the helper, stage processes) are not
affected. At exit, asserts that no torch module was imported and prints `NO-TORCH rc N`."""

import importlib.abc
import sys


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is unimportable in the orchestrator (tests/probes/notorch.py): {name}")
        return None


sys.meta_path.insert(0, _Refuse())

from align.cli import main  # noqa: E402  (after the hook)

rc = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"torch modules imported: {loaded[:5]}"
print(f"NO-TORCH rc {rc}", flush=True)
sys.exit(rc)
