"""Errors that both the orchestrator and the stage processes raise, in a module that imports nothing (so that
torch-free code, e.g. align/templates, can raise them without importing align/models.py)."""


class ModelError(ValueError):
    """A model or tokenizer cannot be used as configured; the message says how to fix it."""
