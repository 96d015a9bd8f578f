"""Data cards: a YAML file that says where a dataset lives, its licence, how to read it, and how to split it.

A card is validated before anything trains: the card's fields, the file's existence and encoding, each
row's parse (errors name the file and line), the column mapping, the transform, and non-empty splits.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from align.core.console import verbose
from align.data.hub import hub_mirror, mirror_digest, resolved_revision
from align.data.formats import FORMS, FormatError, check_canonical, drop_unusable, row_prompt_key
from align.data.transforms import TRANSFORMS, transform_source_digest, user_transform

FORMATS = ("jsonl", "json", "tsv", "csv", "parquet", "hub")


class DataCardError(ValueError):
    """A data card or its data is invalid; the message names the file, line/row or field, and the fix."""


class DataUnavailableError(DataCardError):
    """A hub dataset could not be fetched from here (offline, no access); the card itself may be fine."""


@dataclass
class DataCard:
    """A validated data card (docs/ARCHITECTURE.md, "Data cards", describes every field)."""

    path: Path
    name: str
    source: dict[str, Any]
    format: str
    produces: str
    columns: dict[str, Any] = field(default_factory=dict)
    transform: dict[str, Any] = field(default_factory=dict)
    splits: dict[str, Any] = field(default_factory=lambda: {"train": 1.0, "seed": 0})
    license: str = ""
    description: str = ""
    citation: str = ""
    max_unusable_fraction: float = 0.01
    """Rows that cannot teach (an empty reply, equal replies, no assistant turn) are dropped and counted up to this
    fraction of a split's rows; above it the card is refused, naming them."""

    @property
    def file(self) -> Path | None:
        """The local data file, resolved relative to the card's directory."""
        if "path" not in self.source:
            return None
        return (self.path.parent / self.source["path"]).resolve()

    @property
    def source_splits(self) -> dict[str, str] | None:
        """A hub source that names its own splits (`source.splits`: align split -> the dataset's split, e.g.
        {train: train_prefs, test: test_prefs}): each align split reads that split whole, nothing is re-split."""
        return self.source.get("splits") if self.format == "hub" else None

    @property
    def split_names(self) -> list[str]:
        return list(self.source_splits or {k for k in self.splits if k != "seed"})

    def content_hash(self) -> str:
        """sha256 of the card text, of its transforms' code, and of the local data file; for a hub source the hub
        id and the revision resolved to its commit (or, read from a local mirror, the mirrored files)."""
        h = hashlib.sha256(self.path.read_bytes())
        for name in self.transform:
            if ":" in name:  # a user's transform: its source file's content
                h.update(name.encode() + transform_source_digest(name, self.path).encode())
        if self.file is not None:
            with open(self.file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            return h.hexdigest()
        h.update(json.dumps(self.source, sort_keys=True).encode())
        mirror = hub_mirror(self.source["hub"])
        if mirror is not None:
            h.update(mirror_digest(mirror).encode())
        else:
            h.update(str(resolved_revision(self.source["hub"], self.source.get("revision"))).encode())
        return h.hexdigest()


_CARD_FIELDS = {"name", "description", "source", "license", "citation", "format", "columns", "produces",
                "transform", "splits", "max_unusable_fraction"}


def _check_mappings(path: Path, raw: dict[str, Any]) -> None:
    """The card fields that are mappings are mappings, and the split's seed a whole number."""
    for key, example in (("columns", "{prompt: question, completion: answer}"), ("transform", "{alpaca: {}}"),
                         ("splits", "{train: 0.9, test: 0.1, seed: 0}")):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise DataCardError(f"{path}: field '{key}': a mapping, e.g. `{key}: {example}`, got a "
                                f"{type(raw[key]).__name__}: {str(raw[key])[:80]}")
    seed = (raw.get("splits") or {}).get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataCardError(f"{path}: field 'splits.seed': a whole number (it seeds the split), got {seed!r}")


def load_card(path: str | Path) -> DataCard:
    """Parse and check a card's fields (not its data: see `load_split`)."""
    path = Path(path)
    if not path.is_file():
        raise DataCardError(f"{path}: data card not found (check the path in the pipeline YAML)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DataCardError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise DataCardError(f"{path}: a data card is a mapping of fields ({', '.join(sorted(_CARD_FIELDS))})")
    unknown = set(raw) - _CARD_FIELDS
    if unknown:
        raise DataCardError(f"{path}: unknown field(s) {sorted(unknown)}; valid: {sorted(_CARD_FIELDS)}")
    for key in ("name", "source", "format", "produces", "license"):
        if not raw.get(key):
            raise DataCardError(f"{path}: field '{key}' is required")
    if raw["format"] not in FORMATS:
        raise DataCardError(f"{path}: field 'format': '{raw['format']}' is not one of {FORMATS}")
    if raw["produces"] not in FORMS:
        raise DataCardError(f"{path}: field 'produces': '{raw['produces']}' is not one of {list(FORMS)}")
    source = raw["source"]
    if not isinstance(source, dict) or not ({"path"} <= source.keys() or {"hub"} <= source.keys()):
        raise DataCardError(f"{path}: field 'source' needs `path: <file>` or `hub: <org/name>` (+ revision)")
    _check_mappings(path, raw)
    for name in (raw.get("transform") or {}):
        if ":" in name:  # a user's own transform, `module:function` (like judges): resolved now, not at the stage
            try:
                user_transform(name, path)
            except FormatError as exc:
                raise DataCardError(f"{path}: field 'transform': {exc}") from None
        elif name not in TRANSFORMS:
            raise DataCardError(f"{path}: field 'transform': unknown transform '{name}'; known: {sorted(TRANSFORMS)}, "
                                "or your own as module:function (a module importable from the card's directory)")
    card = DataCard(path=path, name=raw["name"], source=source, format=raw["format"], produces=raw["produces"],
                    columns=raw.get("columns") or {}, transform=raw.get("transform") or {},
                    splits=raw.get("splits") or {"train": 1.0, "seed": 0}, license=raw["license"],
                    description=raw.get("description", ""), citation=raw.get("citation", ""),
                    max_unusable_fraction=_fraction(path, raw.get("max_unusable_fraction", 0.01)))
    if card.file is not None and card.file.is_dir():
        raise DataCardError(f"{path}: field 'source.path': {card.file} is a directory; name the data file in it")
    if card.file is not None and not card.file.is_file():
        raise DataCardError(f"{path}: field 'source.path': file {card.file} does not exist")
    if "splits" in source:
        named = source["splits"]
        if card.format != "hub":
            raise DataCardError(f"{path}: field 'source.splits': only a hub source names its own splits; split a local "
                                "file with `splits:` fractions")
        if not isinstance(named, dict) or not named or not all(isinstance(k, str) and isinstance(v, str) and v
                                                                for k, v in named.items()):
            raise DataCardError(f"{path}: field 'source.splits': a mapping of align split -> the dataset's split, e.g. "
                                "{train: train_prefs, test: test_prefs}")
        if raw.get("splits") or "split" in source:
            raise DataCardError(f"{path}: field 'source.splits' names the dataset's own splits; remove "
                                f"{'`splits:`' if raw.get('splits') else '`source.split`'} (nothing is re-split)")
        return card
    _check_fractions(path, {k: v for k, v in card.splits.items() if k != "seed"})
    return card


def _check_fractions(path: Path, fractions: dict[str, Any]) -> None:
    wrong = {k: v for k, v in fractions.items() if isinstance(v, bool) or not isinstance(v, (int, float))
             or not math.isfinite(v)}
    if wrong:
        raise DataCardError(f"{path}: field 'splits': each fraction must be a number, got "
                            + ", ".join(f"{k}: {v!r} ({type(v).__name__})" for k, v in wrong.items())
                            + "; write e.g. {train: 0.9, test: 0.1} (unquoted)")
    if not fractions or any(v < 0 for v in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-6:
        raise DataCardError(f"{path}: field 'splits': fractions must be >= 0 and sum to 1, got {fractions}")


def _fraction(path: Path, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise DataCardError(f"{path}: field 'max_unusable_fraction': {value!r} is not a fraction between 0 and 1")
    return float(value)


# --------------------------------------------------------------------------------------------- reading
def _read_text(file: Path) -> str:
    data = file.read_bytes()
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
    if not card.columns:
        if not isinstance(row, dict):
            raise DataCardError(f"{where}: rows are not named; add `columns:` to {card.path}")
        return row
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
    assert file is not None
    if card.format == "parquet":
        import pyarrow.parquet as pq  # heavy: only for parquet cards

        try:
            table = pq.read_table(file).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataCardError(f"{file}: not a readable parquet file ({str(exc).splitlines()[0]})") from None
        return [_map_columns(card, r, f"{file}: row {i}") for i, r in enumerate(table)]
    text = _read_text(file)
    rows: list[dict[str, Any]] = []
    if card.format == "jsonl":
        for n, obj in _json_lines(text, file, "fix or remove the line"):
            rows.append(_map_columns(card, obj, f"{file}: line {n}"))
    elif card.format == "json":
        try:
            objs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataCardError(f"{file}: line {exc.lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(objs, list):
            raise DataCardError(f"{file}: a json source must hold a list of rows")
        rows = [_map_columns(card, o, f"{file}: row {i}") for i, o in enumerate(objs)]
    else:  # tsv / csv: `columns` by index (no header line), or by name (the first line is the header)
        delim = "\t" if card.format == "tsv" else ","
        reader = csv.reader(io.StringIO(text), delimiter=delim, quoting=csv.QUOTE_NONE if delim == "\t" else 0)
        names = [v for v in card.columns.values() if isinstance(v, str)]
        if names and len(names) != len(card.columns):
            raise DataCardError(f"{card.path}: field 'columns': name every column by its header or by its index "
                                f"(from 0), not both: {card.columns}")
        header: list[str] | None = None
        for n, fields_ in enumerate(reader, start=1):
            if not fields_:
                continue
            if names and header is None:
                header = fields_
                missing = [v for v in names if v not in header]
                if missing:
                    raise DataCardError(f"{card.path}: field 'columns': {missing[0]!r} is not in the header line of "
                                        f"{file} ({', '.join(header)[:200]})")
                continue
            if card.columns and not names and not rows and [fields_[v] for v in card.columns.values() if isinstance(v, int)
                                           and v < len(fields_)] == list(card.columns):
                raise DataCardError(f"{file}: line {n} is a header ({', '.join(fields_)[:120]}) and the card names "
                                    "columns by index, which reads it as a row: name them by the header instead, "
                                    f"e.g. `columns: {{{', '.join(f'{k}: {k}' for k in card.columns)}}}`")
            row = dict(zip(header, fields_)) if header is not None else fields_
            rows.append(_map_columns(card, row, f"{file}: line {n}"))
    return rows


def _read_hub(card: DataCard, split: str) -> list[dict[str, Any]]:
    import datasets  # heavy: only for hub cards
    from datasets.utils import logging as ds_logging

    if not verbose():  # its download and split bars would only fill the console (the stage's log has the rows)
        ds_logging.disable_progress_bar()
        ds_logging.set_verbosity_error()
    src = card.source
    mirror = hub_mirror(src["hub"])
    where = f"{src['hub']!r}" + (f" from its mirror {mirror}" if mirror else f" (revision {src.get('revision')!r})")
    try:
        if mirror is not None:
            ds = datasets.load_dataset(str(mirror), src.get("config"), data_dir=src.get("data_dir"), split=split)
        else:
            ds = datasets.load_dataset(src["hub"], src.get("config"), data_dir=src.get("data_dir"), split=split,
                                       revision=resolved_revision(src["hub"], src.get("revision")))
    except ValueError as exc:  # reached, and wrong: an unknown split or config ("Unknown split 'trian'. Should be
        # one of [...]"), which a run would only meet when its stage starts, hours in
        raise DataCardError(f"{card.path}: field 'source' ({_named(src, split)}): hub dataset {where} has no such "
                            f"split or config: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; fix "
                            "the card") from exc
    except Exception as exc:  # network, auth, gated, a missing revision: not reachable from here, maybe elsewhere
        raise DataUnavailableError(f"{card.path}: could not load split {split!r} of hub dataset {where}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    return [_map_columns(card, r, f"{card.path}: hub row {i}") for i, r in enumerate(ds)]


def _named(src: dict[str, Any], split: str) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (("config", src.get("config")), ("data_dir", src.get("data_dir")),
                                                  ("split", split)) if v)


# --------------------------------------------------------------------------------------------- splits
@dataclass
class LoadedSplit:
    """Rows of one split in canonical form, plus counts of what the transform dropped."""

    card: DataCard
    split: str
    rows: list[dict[str, Any]]
    dropped: Counter
    total_rows: int
    available: bool = True  # False: a hub dataset not reachable from here (rows not checked)


def load_split(card: DataCard | str | Path, split: str) -> LoadedSplit:
    """Read, transform, validate and split a card; return one split (an empty split is an error)."""
    if not isinstance(card, DataCard):
        card = load_card(card)
    named = card.source_splits
    if named is not None and split not in named:
        raise DataCardError(f"{card.path}: no split '{split}'; the card defines {sorted(named)} (source.splits)")
    rows = read_rows(card, named[split] if named else None)
    if not rows:
        raise DataCardError(f"{card.file or card.path}: the dataset is empty")
    seed = int(card.splits.get("seed", 0))
    read = len(rows)
    dropped: Counter = Counter()
    try:
        for name, args in card.transform.items():
            rows, d = (user_transform(name, card.path) if ":" in name else TRANSFORMS[name])(rows, args, seed)
            dropped.update(d)
        if not rows:
            reasons = ", ".join(f"{n} {why}" for why, n in dropped.most_common())
            raise FormatError(f"transform {', '.join(card.transform)} dropped every one of the {read} rows "
                              f"({reasons or 'no reason counted'}); fix the data, or the transform's settings")
        check_canonical(rows, card.produces, str(card.file or card.path))
        rows, unusable = drop_unusable(rows, card.produces, str(card.file or card.path), card.max_unusable_fraction)
        dropped.update(unusable)
    except FormatError as exc:
        raise DataCardError(f"{card.path}: {exc}") from None
    if named is not None:  # the dataset's own split, whole
        return LoadedSplit(card, split, rows, dropped, len(rows))
    fractions = {k: float(v) for k, v in card.splits.items() if k != "seed"}
    if split not in fractions:
        raise DataCardError(f"{card.path}: no split '{split}'; the card defines {sorted(fractions)}")
    # Whole prompt groups go to splits, so rows sharing a prompt never straddle train and test; each group by its own
    # seeded hash, so a prompt's split does not depend on which other rows the card kept (a messages card and a
    # preference card over the same prompts, one dropping a pair, split alike). Sizes follow the fractions on average.
    lo = sum(f for name, f in list(fractions.items())[:list(fractions).index(split)])
    hi = lo + fractions[split]
    last = [name for name, f in fractions.items() if f > 0][-1] == split  # takes what rounding leaves above 1 - eps
    chosen = [i for i, row in enumerate(rows) if lo <= (u := _unit(seed, _split_key(row))) < hi or (last and u >= hi)]
    if not chosen:
        raise DataCardError(f"{card.path}: split '{split}' is empty ({len(rows)} rows after transforms, "
                            f"fraction {fractions[split]}); give it a larger fraction or more data")
    return LoadedSplit(card, split, [rows[i] for i in chosen], dropped, len(rows))


def _unit(seed: int, key: str) -> float:
    """A prompt's place in [0, 1) for the split: sha256 of the seed and the prompt (the same on every machine)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{key}".encode()).digest()[:8], "big") / 2 ** 64


def _split_key(row: dict[str, Any]) -> str:
    key = row_prompt_key(row)
    return json.dumps(row, sort_keys=True) if key is None else key


def _json_lines(text: str, where: Path, fix: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; invalid JSON names its line and the fix. Lines end at
    \n only (JSON Lines): str.splitlines() would also split inside strings at U+2028, U+0085 or a form feed, which
    JSON allows raw."""
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataCardError(f"{where}: line {n}: invalid JSON ({exc.msg}); {fix}") from None


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
