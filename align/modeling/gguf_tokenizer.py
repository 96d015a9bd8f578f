"""A `.gguf` file's tokenizer, converted once into align's cache (align/modeling/models.py `load_tokenizer`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from align.core import gguf


def gguf_tokenizer_dir(gguf_path: str, rebuild: bool = False) -> str:
    """The tokenizer of a `.gguf` file, converted once into a tokenizer directory in align's cache
    (`$ALIGN_CACHE/gguf-tokenizers/<file digest>/`): converting SmolLM2's vocabulary and merges from the GGUF
    metadata takes ~7 s on the 2-core CPU, loading the converted directory 0.4 s, and validation and the first
    stage each load it. The digest covers the file's path, size and modification time; a conversion is written
    to a temporary directory and renamed into place, so a killed one leaves nothing half-written; one damaged
    since (`rebuild`: it did not load) is converted again."""
    from transformers import AutoTokenizer  # heavy: loaded on use

    from align.core.fsutil import cache_root

    p = Path(gguf_path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    out = cache_root() / "gguf-tokenizers" / key
    if rebuild:
        shutil.rmtree(out, ignore_errors=True)
    if not (out / "tokenizer_config.json").is_file():
        folder, name = gguf.folder_and_file(p)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out.parent))
        tmp.chmod(0o755)  # a cache others on the machine may read, as align's other cached models
        try:
            tok.save_pretrained(tmp)
            (tmp / "SOURCE").write_text(f"{p}\n", encoding="utf-8")
            try:
                os.replace(tmp, out)
            except OSError:  # another process converted it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
