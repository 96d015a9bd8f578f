"""The builtin model (`base_model: builtin:tiny-llama`): its name, checked by the orchestrator. Its transformers config
is built where models are built (align/modeling/models.py `llama_config`): by the stage that builds the model and by
the helper process that sizes it for `align estimate`. No torch here."""

from __future__ import annotations

PREFIX = "builtin:"
KINDS = ("tiny-llama",)


def is_builtin(spec: str) -> bool:
    return spec.startswith(PREFIX)


def check_builtin(spec: str) -> None:
    """A `builtin:` base model must name a known kind."""
    if is_builtin(spec) and spec[len(PREFIX):] not in KINDS:
        raise ValueError(f"base_model '{spec}': unknown builtin; use " + " or ".join(PREFIX + k for k in KINDS))
