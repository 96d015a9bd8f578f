"""The builtin model (`base_model: builtin:tiny-llama`): its name and its transformers config, written once for
the SFT stage that builds it (align/models.py) and for `align estimate`, which sizes it. No torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: align.models imports this module
    from align.config import BuiltinModel

PREFIX = "builtin:"
KINDS = ("tiny-llama",)


def is_builtin(spec: str) -> bool:
    return spec.startswith(PREFIX)


def check_builtin(spec: str) -> None:
    """A `builtin:` base model must name a known kind."""
    if is_builtin(spec) and spec[len(PREFIX):] not in KINDS:
        raise ValueError(f"base_model '{spec}': unknown builtin; use " + " or ".join(PREFIX + k for k in KINDS))


def llama_config(size: BuiltinModel, vocab_size: int, **token_ids: Any):
    """The LlamaConfig of the builtin model (tied embeddings; one key/value head per attention head)."""
    from transformers import LlamaConfig  # heavy: only the SFT stage and the estimator build one

    return LlamaConfig(vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
                       num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
                       num_key_value_heads=size.num_heads, max_position_embeddings=size.max_position_embeddings,
                       tie_word_embeddings=True, **token_ids)
