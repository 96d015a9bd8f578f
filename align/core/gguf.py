"""GGUF checkpoints (llama.cpp's single-file format) as a `base_model`.

transformers reads a `.gguf` file (`from_pretrained(folder, gguf_file=name)`, with the optional `gguf` package)
and dequantises every tensor: align then trains the dequantised weights in the pipeline's `dtype`; nothing is
trained quantised. The manifest of the stage that loads one says so (`base_model_format`).

Here, without torch: the metadata a plan and `align validate` need (architecture, context length, vocabulary,
special tokens, chat template), read with the `gguf` package's memory-mapped reader.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install gguf (or: pip install -e '.[gguf]')"
# GGUF's file types (llama.cpp's LLAMA_FTYPE_*) for the manifest's description of what was dequantised.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


# Large per-token arrays nothing here reads (decoding them costs seconds).
SKIPPED = ("tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


class GGUFError(ValueError):
    """A .gguf file that cannot be read; the message names it and the fix."""


def is_gguf(path_or_id: str | Path | None) -> bool:
    return bool(path_or_id) and str(path_or_id).lower().endswith(".gguf")  # model.GGUF too


def folder_and_file(path: str | Path) -> tuple[str, str]:
    """The (folder, file name) pair transformers' `from_pretrained(folder, gguf_file=name)` takes."""
    p = Path(path)
    return str(p.parent), p.name


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every scalar, string and list field of the file's metadata (tensors are not read). Read once per process
    and file version (a relative and an absolute path to the same file share it): one read of SmolLM2's
    metadata takes ~3 s on the 2-core CPU, and validation asks for it from several places."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise GGUFError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return _read_metadata(str(p), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _read_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: a GGUF file needs the `gguf` package to be read: {INSTALL_HINT}") from None
    try:
        reader = GGUFReader(str(path), "r")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); download it again") from None
    out: dict[str, Any] = {UNREADABLE: _undequantisable(reader)}
    for name, fld in reader.fields.items():
        if name in SKIPPED:
            continue
        try:
            out[name] = fld.contents()
        except (ValueError, IndexError, KeyError):  # a field type this gguf version cannot decode: not needed
            continue
    return out


UNREADABLE = "align.undequantisable_tensors"
"""(In what read_metadata returns) tensor type -> the names of tensors of that type no loader here dequantises."""


def _undequantisable(reader) -> dict[str, list[str]]:
    """Tensors whose quantisation type the gguf package cannot dequantise (transformers' GGUF loader calls its
    `dequantize`: F32, F16 and the types with a numpy implementation; e.g. Q8_K has none)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    known = {T.F32, T.F16, *getattr(quants, "_type_traits", {})}
    out: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in known:
            out.setdefault(getattr(tensor.tensor_type, "name", str(tensor.tensor_type)), []).append(tensor.name)
    return out


MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
               "gemma3": "gemma3_text", "gemma4": "gemma4_text"}
"""llama.cpp's architecture names that transformers' GGUF loader renames to its own model_type
(modeling_gguf_pytorch_utils.load_gguf_checkpoint); any other is the same in both."""


def config_of(path: str | Path) -> dict[str, Any]:
    """The parts of a config.json that validation and `align estimate` read, from the GGUF metadata; a file with
    tensors no loader here can dequantise is refused, naming them."""
    meta = read_metadata(str(path))
    bad = meta.get(UNREADABLE) or {}
    if bad:
        kinds = "; ".join(f"{len(names)} {kind} tensors ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                          for kind, names in bad.items())
        raise GGUFError(f"{path}: holds tensors of a quantisation type that cannot be dequantised here: {kinds}. "
                        "Use a GGUF file quantised as F16, BF16, Q8_0, Q4_K_M or another type with a dequantiser "
                        "(the gguf package's quants module), or the model's Hugging Face directory")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: its metadata names no `general.architecture`; it is not a model checkpoint")
    config: dict[str, Any] = {"model_type": MODEL_TYPES.get(arch, arch)}
    keys = {"max_position_embeddings": "context_length", "hidden_size": "embedding_length",
            "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
            "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv"}
    for key, gguf_key in keys.items():
        value = meta.get(f"{arch}.{gguf_key}")
        if isinstance(value, int):
            config[key] = value
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        config["vocab_size"] = meta.get(f"{arch}.vocab_size", len(tokens))
    return config


def describe(path: str | Path) -> str:
    """E.g. 'GGUF Q4_1 (llama), dequantised': what the manifest records of a GGUF base model."""
    meta = read_metadata(str(path))
    kind = FILE_TYPES.get(meta.get("general.file_type"), f"file type {meta.get('general.file_type')}")
    return f"GGUF {kind} ({meta.get('general.architecture')}), dequantised on load"
