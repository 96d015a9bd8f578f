"""The stage process's shell, shared by every stage type: its context (spec, run directory, manifest, tracker,
checkpoint hygiene: context.py) and its entry point and outcome (process.py)."""
