"""Reading a data card's source: the rows of a local file (JSONL, JSON, CSV/TSV, parquet, optionally gzipped) or of a
hub dataset, named by the card's `columns:` (align/data/cards.py checks the card's fields and splits what this reads).

Every damaged or misread row is an error that names the file, its line (1-based, as an editor counts) or row (from
0, for sources without lines), and the fix: nothing is shifted, dropped or turned into text silently.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import re
import zlib
from pathlib import Path
from typing import Any, Iterator

from align.core.console import verbose
from align.data.hub import hub_mirror, mirror_mismatch, resolved_revision

DataCard = Any  # align/data/cards.py's DataCard, which imports this module: named here only to say what is read


class DataCardError(ValueError):
    """A data card or its data is invalid; the message names the file, line/row or field, and the fix."""


class DataUnavailableError(DataCardError):
    """A hub dataset could not be fetched from here (offline, no access); the card itself may be fine."""


CSV_FIELD_LIMIT = 1 << 30
"""The longest CSV/TSV field read (Python's csv module stops at 131,072 characters by default: one long reply)."""
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


_CONTAINERS = ((b"\x1f\x8b", "gzip-compressed", "name it with `.gz` at the end (e.g. train.jsonl.gz); it is read "
                "unpacked"),
               (b"PAR1", "a parquet file", "set `format: parquet` in the card"),
               (b"PK\x03\x04", "a zip archive", "unpack it and point `source.path` at the file inside"),
               (b"\xfe\xff", "UTF-16 text", "save it as UTF-8"), (b"\xff\xfe", "UTF-16 text", "save it as UTF-8"))
"""Leading bytes of a file that is no text of any format: reading one as text would be a misleading 'not UTF-8'."""


def _text(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 text (a character cut at the end of the sample allowed)."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(head) - 3
    return True


def _container(head: bytes, file: Path, fmt: str) -> str | None:
    """What a file read as text of format `fmt` really is, and the fix, when its first bytes say so (and are not
    text: a CSV whose header begins `PAR1,` is a CSV); else None."""
    for magic, what, fix in _CONTAINERS:
        if head.startswith(magic) and not _text(head):
            return f"{file}: the card reads it as {fmt} text but it is {what}; {fix}"
    return None


def _looks_like(file: Path) -> str:
    """Why a file a parquet card names did not read, where its first bytes say: a parquet file cut short, a gzip
    file, or text whose first line says which format it is ('; ...'); else ''."""
    with open(file, "rb") as fh:
        head = fh.read(4096)
    if head.startswith(b"PAR1"):
        return "; it begins as parquet but is cut short or damaged: copy or download it again"
    if head.startswith(b"\x1f\x8b"):
        return "; it is gzip-compressed: unpack it, or name it *.jsonl.gz / *.csv.gz with that `format:`"
    if not _text(head):
        return ""
    first = head.lstrip(b"\xef\xbb\xbf \r\n\t").split(b"\n", 1)[0]
    guess = ("jsonl" if first.startswith(b"{") else "json" if first.startswith(b"[") else
             "tsv" if b"\t" in first else "csv" if b"," in first else None)
    return f"; its first line looks like {guess}: set `format: {guess}` in the card" if guess else ""


def _read_text(file: Path, fmt: str) -> str:
    data = file.read_bytes()
    if file.suffix != ".gz" and (problem := _container(data[:4096], file, fmt)):
        raise DataCardError(problem)
    if file.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error) as exc:  # truncated, or not gzip at all
            raise DataCardError(f"{file}: not a complete gzip file ({exc}); download or copy it again") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (Excel's CSV, Notepad's UTF-8) is not row 0's text
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataCardError(f"{file}: line {line}: bytes that are not UTF-8 at offset {exc.start}; "
                            "re-encode the file as UTF-8") from exc


def _map_columns(card: DataCard, row: Any, where: str) -> dict[str, Any]:
    if isinstance(row, list) and row and all(isinstance(r, dict) for r in row):
        raise DataCardError(f"{where}: holds a list of rows, not one row; a file that is one JSON array of rows is "
                            f"`format: json` in {card.path}")
    if not card.columns:
        if isinstance(row, list):
            raise DataCardError(f"{where}: rows are not named; add `columns:` to {card.path} (each field by its "
                                "header name or its index from 0)")
        if not isinstance(row, dict):
            raise DataCardError(f"{where}: a row is a JSON object of named fields, got {type(row).__name__} "
                                f"{str(row)[:80]}; fix or remove it")
        return row
    if not isinstance(row, (dict, list)):
        raise DataCardError(f"{where}: a row is a JSON object or a list of column values, got {type(row).__name__} "
                            f"{str(row)[:80]}; fix or remove it")
    out = {}
    for name, key in card.columns.items():
        try:
            out[name] = row[key]
        except (KeyError, IndexError, TypeError):
            have = list(row.keys()) if isinstance(row, dict) else f"{len(row)} columns"
            raise DataCardError(f"{where}: column {key!r} (mapped to '{name}' in {card.path}) is missing; "
                                f"the row has {have}") from None
    return out


def read_rows(card: DataCard, hub_split: str | None = None) -> list[dict[str, Any]]:
    """Read every row of the card's source (of a hub source, `hub_split` or its `split`), mapped to the card's column
    names."""
    if card.format == "hub":
        return _read_hub(card, hub_split or card.source.get("split", "train"))
    file = card.file
    if file is None:
        raise DataCardError(f"{card.path}: format '{card.format}' reads a local file: give `source: {{path: FILE}}`")
    if card.format == "parquet":
        import pyarrow.parquet as pq  # heavy: only for parquet cards

        try:
            table = pq.read_table(file).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataCardError(f"{file}: not a readable parquet file ({str(exc).splitlines()[0]})"
                                f"{_looks_like(file)}") from None
        return [_map_columns(card, r, f"{file}: row {i}") for i, r in enumerate(table)]
    text = _read_text(file, card.format)
    if card.format == "jsonl":
        return [_map_columns(card, obj, f"{file}: line {n}")
                for n, obj in _json_lines(text, file, "fix or remove the line")]
    if card.format == "json":
        try:
            objs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataCardError(f"{file}: line {exc.lineno}: invalid JSON ({exc.msg})") from None
        _text_only(text, objs, file, 1)
        if not isinstance(objs, list):
            raise DataCardError(f"{file}: a json source must hold a list of rows")
        return [_map_columns(card, o, f"{file}: row {i}") for i, o in enumerate(objs)]
    return _read_delimited(card, file, text)


def _read_delimited(card: DataCard, file: Path, text: str) -> list[dict[str, Any]]:
    """tsv / csv: `columns` by index (no header line), or by name (the first line is the header). Every row has as
    many fields as the header (or the first row): a stray delimiter would shift every field after it."""
    delim = "\t" if card.format == "tsv" else ","
    csv.field_size_limit(CSV_FIELD_LIMIT)
    reader = csv.reader(io.StringIO(text), delimiter=delim, quoting=csv.QUOTE_NONE if delim == "\t" else 0)
    names = [v for v in card.columns.values() if isinstance(v, str)]
    if names and len(names) != len(card.columns):
        raise DataCardError(f"{card.path}: field 'columns': name every column by its header or by its index "
                            f"(from 0), not both: {card.columns}")
    header: list[str] | None = None
    width = None
    rows: list[dict[str, Any]] = []
    try:
        for fields_ in reader:
            n = reader.line_num
            if not fields_:
                continue
            if names and header is None:
                header, width = fields_, len(fields_)
                _check_header(card, file, header, names)
                continue
            if card.columns and not names and not rows and [fields_[v] for v in card.columns.values()
                                                            if isinstance(v, int) and v < len(fields_)] == list(card.columns):
                raise DataCardError(f"{file}: line {n} is a header ({', '.join(fields_)[:120]}) and the card names "
                                    "columns by index, which reads it as a row: name them by the header instead, "
                                    f"e.g. `columns: {{{', '.join(f'{k}: {k}' for k in card.columns)}}}`")
            width = width or len(fields_)
            if len(fields_) != width:
                raise DataCardError(f"{file}: line {n}: {len(fields_)} fields where the "
                                    f"{'header' if header else 'first row'} has {width}: a "
                                    f"{'tab' if delim == chr(9) else 'comma'} inside a field shifts every field after "
                                    f"it; {'quote the field' if delim == ',' else 'remove the tab'} or fix the line")
            row = dict(zip(header, fields_)) if header is not None else fields_
            rows.append(_map_columns(card, row, f"{file}: line {n}"))
    except csv.Error as exc:  # a bare carriage return inside a field, a field longer than CSV_FIELD_LIMIT
        raise DataCardError(f"{file}: line {reader.line_num}: not readable as {card.format.upper()} ({exc}); fix the "
                            "line (quote a field that holds a line break)") from None
    return rows


def _check_header(card: DataCard, file: Path, header: list[str], names: list[str]) -> None:
    missing = [v for v in names if v not in header]
    if missing:
        raise DataCardError(f"{card.path}: field 'columns': {missing[0]!r} is not in the header line of "
                            f"{file} ({', '.join(header)[:200]})")
    twice = sorted({v for v in names if header.count(v) > 1})
    if twice:
        raise DataCardError(f"{file}: line 1: the header names {twice[0]!r} twice, and `columns:` in {card.path} "
                            "reads it: rename one of the two columns")


def _mirror_cache(mirror: Path) -> Path:
    """datasets' cache for a mirror as its files are now (each one's place and `file_stamp`): datasets keys a local
    dataset's cache by its name and its card's file patterns, so a second mirror of the same dataset, or one whose
    files were replaced in place, read the rows first cached (measured with datasets 5.2, 2026-11-30) while the
    card's fingerprint, a digest of the files, said they had changed."""
    from align.core.fsutil import cache_root, file_stamp

    h = hashlib.sha256()
    for file in sorted(p for p in mirror.rglob("*") if p.is_file() and ".cache" not in p.parts):
        h.update(f"{file.resolve()}\0{file_stamp(file)}\n".encode())
    return cache_root() / "hub-mirrors" / h.hexdigest()[:20]


def _read_hub(card: DataCard, split: str) -> list[dict[str, Any]]:
    import datasets  # heavy: only for hub cards
    from datasets.utils import logging as ds_logging

    if not verbose():  # its download and split bars would only fill the console (the stage's log has the rows)
        ds_logging.disable_progress_bar()
        ds_logging.set_verbosity_error()
    src = card.source
    mirror = hub_mirror(src["hub"])
    where = f"{src['hub']!r}" + (f" from its mirror {mirror}" if mirror else f" (revision {src.get('revision')!r})")
    problem = mirror is not None and mirror_mismatch(mirror, src["hub"], src.get("revision"), src.get("data_dir"))
    if problem:
        raise DataCardError(f"{card.path}: field 'source': hub dataset {src['hub']!r}: {problem}")
    try:
        if mirror is not None:
            ds = datasets.load_dataset(str(mirror), src.get("config"), data_dir=src.get("data_dir"), split=split,
                                       cache_dir=str(_mirror_cache(mirror)))
        else:
            ds = datasets.load_dataset(src["hub"], src.get("config"), data_dir=src.get("data_dir"), split=split,
                                       revision=resolved_revision(src["hub"], src.get("revision")))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, ValueError) or mirror is not None:
            # reached, and wrong: an unknown split or config ("Unknown split 'trian'. Should be one of [...]"), or a
            # data_dir a mirror on this disk does not hold, which a run would only meet when its stage starts
            raise DataCardError(f"{card.path}: field 'source' ({_named(src, split)}): hub dataset {where} has no such "
                                f"split, config or data_dir: {first}; fix the card") from exc
        # network, auth, gated, a missing revision: not reachable from here, maybe from elsewhere
        raise DataUnavailableError(f"{card.path}: could not load split {split!r} of hub dataset {where}: "
                                   f"{first}") from exc
    return [_map_columns(card, r, f"{card.path}: hub row {i}") for i, r in enumerate(ds)]


def _named(src: dict[str, Any], split: str) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (("config", src.get("config")), ("data_dir", src.get("data_dir")),
                                                  ("split", split)) if v)


def _text_only(text: str, obj: Any, where: Path, line: int) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (`\\ud800`), which is no character: no tokenizer or file
    takes it. Checked only where such an escape appears."""
    found = _SURROGATE.search(text)
    if found is None:
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        at = line + text[: found.start()].count("\n")
        raise DataCardError(f"{where}: line {at}: the escape {found.group()} is half of a UTF-16 surrogate pair, "
                            "not a character (a string cut in the middle of an emoji or other character outside "
                            "the BMP); fix or remove the line") from None


def _json_lines(text: str, where: Path, fix: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; invalid JSON names its line and the fix. Lines end at
    \n only (JSON Lines): str.splitlines() would also split inside strings at U+2028, U+0085 or a form feed, which
    JSON allows raw."""
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataCardError(f"{where}: line {n}: invalid JSON ({exc.msg}); {fix}") from None
        _text_only(line, obj, where, n)
        yield n, obj


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file that a stage wrote (e.g. preference pairs); a damaged file names its line."""
    rows = []
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataCardError(f"{path}: cannot be read ({type(exc).__name__}: {exc}); rerun the stage that wrote it") from None
    for n, row in _json_lines(text, path, "rerun the stage that wrote it"):
        if not isinstance(row, dict):
            raise DataCardError(f"{path}: line {n}: a row must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
