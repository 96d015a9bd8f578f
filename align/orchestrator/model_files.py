"""A local model directory's files, checked without loading them (no torch): its config.json, and whether its
weights can load as a whole (align/orchestrator/inputs.py checks the pipeline's models with these)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from align.core import gguf


def config_problem(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A model's config.json as a dict, or what is wrong with it."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, (f"{path} cannot be read as JSON ({type(exc).__name__}: {exc}); the model directory is "
                      "damaged: copy it again (a packaged model: `align model NAME` reads every file and converts it "
                      "again)")
    if not isinstance(raw, dict):
        return None, f"{path} holds a JSON {type(raw).__name__}, not the object of a model config"
    if "model_type" not in raw:
        return None, (f"{path} has no `model_type`, so transformers cannot tell which architecture it is; the "
                      "directory is damaged or not a transformers model: save it again with model.save_pretrained")
    return raw, None


def model_dir_problem(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A local model directory's config.json as a dict, or what keeps the directory from loading: no config (a
    .gguf inside is named), a damaged one, no weights, weights cut short."""
    if not (directory / "config.json").is_file():
        ggufs = sorted(p.name for p in directory.iterdir() if gguf.is_gguf(p.name))
        return None, (f"{directory} has no config.json; it is not a transformers model directory (save one with "
                      "model.save_pretrained)"
                      + (f"; to use its GGUF checkpoint, name the file: {directory / ggufs[0]}" if ggufs else ""))
    read, problem = config_problem(directory / "config.json")
    if problem:
        return None, problem
    if not any(any(directory.glob(pattern)) for pattern in WEIGHT_FILES):
        return None, (f"{directory} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}); copy the "
                      "whole model directory, or save it with model.save_pretrained")
    return (None, problem) if (problem := weights_problem(directory)) else (read, None)


LOAD_ORDER = (("model.safetensors", None), ("model.safetensors.index.json", "model.safetensors"),
              ("pytorch_model.bin", None), ("pytorch_model.bin.index.json", "pytorch_model.bin"))
"""transformers' order: the first of these a directory holds is what it loads; (index, the single file it names when
it is a one-file index)."""


def weights_problem(directory: Path) -> str | None:
    """What keeps the weights transformers will load from `directory` (the first of LOAD_ORDER it holds; another
    kind beside them, e.g. a .bin index a download without *.bin left, is not read) from loading as a whole, found
    without loading them (None: nothing): a shard its index names that is not there (a copy still running, a shard
    left out), a single-file checkpoint beside an index naming other shards (transformers loads the single file:
    after a copy over an older checkpoint, the older weights), a safetensors file shorter than its own header says,
    a zip-format .bin without its directory (both cut short)."""
    try:
        name, single = next((n, s) for n, s in LOAD_ORDER if (directory / n).is_file())
    except StopIteration:
        return None
    files = [directory / name]
    if name.endswith(".index.json"):
        try:
            shards = set(json.loads((directory / name).read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{directory / name} is not a readable shard index (no weight_map); copy the model again"
        if missing := sorted(s for s in shards if not (directory / s).is_file()):
            return (f"{directory / name} names {len(shards)} shards, {len(missing)} of them missing "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the copy is incomplete; copy "
                    "the model again")
        files = [directory / s for s in sorted(shards)]
    elif (directory / f"{name}.index.json").is_file():  # model.safetensors beside model.safetensors.index.json
        index = directory / f"{name}.index.json"
        try:
            named = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            named = set()
        if named - {name}:
            return (f"{directory} holds both {name} and {index.name} (shards): transformers loads {name}, and the "
                    "shards are ignored; remove whichever is stale (a copy over an older checkpoint leaves both)")
    return next(filter(None, map(_file_problem, files)), None)


def _file_problem(path: Path) -> str | None:
    """A weight file cut short: a safetensors file shorter than its header says, a zip-format .bin without its end."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if path.suffix == ".bin":  # torch.save's zip format since 1.6 (older files are plain pickles)
                zipped = head[:4] == b"PK\x03\x04"
                return (f"{path} is a zip archive without its end (the copy was cut short); copy the model again"
                        if zipped and not zipfile.is_zipfile(path) else None)
            length = int.from_bytes(head, "little")
            header = json.loads(fh.read(length)) if 2 <= length <= min(size - 8, 100 << 20) else None
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except OSError as exc:  # a dangling link of a hub cache, a file without read permission
        return f"{path} cannot be read ({exc.strerror or exc}); copy the model again"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path} is not a readable safetensors file (its header is damaged); copy the model again"
    if 8 + length + end > size:
        return (f"{path} is {size:,} bytes, its header describes {8 + length + end:,}: the copy was cut short; "
                "copy the model again")
    return None


WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
"""What transformers loads a PyTorch model's weights from."""
