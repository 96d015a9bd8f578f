"""The stage process's shell, shared by every stage type: its context (spec, run directory, manifest, tracker,
checkpoint hygiene: context.py), its entry point and outcome (process.py), and what stages share: trl.py (TRL
glue), rows.py (rows and prompts a stage reads), preload.py (what warm starts import)."""
