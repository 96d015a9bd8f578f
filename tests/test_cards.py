"""Data cards: shipped cards validate; bad inputs fail early with the file, line/row or field named."""

import gzip
import sys
import json
from pathlib import Path

import pytest
import yaml

from align.data.cards import DataCardError, DataUnavailableError, load_card, load_split
from align.data.transforms import hh_transcript, parse_hh_turns

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("card", sorted((REPO / "data_cards").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_cards_validate(card):
    c = load_card(card)
    assert c.license and (c.file is None or c.file.is_file())
    if c.format == "hub":  # tests run offline (HF_HUB_OFFLINE=1): the card parses, the rows are out of reach
        from align.data.cards import DataUnavailableError

        assert c.source["hub"] and c.source.get("revision")
        with pytest.raises(DataUnavailableError, match=c.source["hub"]):
            load_split(c, "train")
        return
    for split in (k for k in c.splits if k != "seed"):
        assert load_split(c, split).rows


def test_movie_splits_are_disjoint_by_prompt_and_deterministic():
    card = REPO / "data_cards" / "movie_review_snippets.yaml"
    train, test = load_split(card, "train"), load_split(card, "test")
    assert not {r["prompt"] for r in train.rows} & {r["prompt"] for r in test.rows}
    assert 0.85 < len(train.rows) / (len(train.rows) + len(test.rows)) < 0.95
    assert load_split(card, "test").rows == test.rows
    for r in test.rows[:50]:
        assert 2 <= len(r["prompt"].split()) <= 8 and r["completion"].startswith(" ")


def _card(tmp: Path, data: bytes | str | None, name="d.jsonl", **fields) -> Path:
    if data is not None:
        (tmp / name).write_bytes(data.encode() if isinstance(data, str) else data)
    body = {"name": "t", "license": "MIT", "format": "jsonl", "produces": "preference",
            "source": {"path": name}, "splits": {"train": 1.0, "seed": 0}, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    (tmp / "card.yaml").write_text(yaml.safe_dump(body))
    return tmp / "card.yaml"


PAIR = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})

# (id, data, card fields, split, expected message fragments)
BAD = [
    ("missing-file", None, {}, "train", ["d.jsonl", "does not exist"]),
    ("invalid-json-line-3", f"{PAIR}\n{PAIR}\n{{oops\n", {}, "train", ["d.jsonl", "line 3", "invalid JSON"]),
    ("missing-column", json.dumps({"prompt": "p", "chosen": "a"}) + "\n", {}, "train",
     ["row 0", "missing field 'rejected'", "(its fields: chosen, prompt)", "`columns: {rejected: <field>}`"]),
    ("source-path-a-directory", None, {"source": {"path": "."}}, "train", ["field 'source.path'", "is a directory"]),
    ("split-fraction-quoted", PAIR, {"splits": {"train": "0.9", "test": 0.1}}, "train",
     ["each fraction must be a number", "train: '0.9' (str)", "(unquoted)"]),
    ("split-fraction-nan", PAIR, {"splits": {"train": float("nan"), "test": 0.1}}, "train",
     ["each fraction must be a number", "train: nan (float)"]),
    ("mapped-column-missing", json.dumps({"q": "p"}) + "\n", {"columns": {"prompt": "question"}}, "train",
     ["line 1", "column 'question'", "missing"]),
    ("tsv-column-index", "1\tonly two\n", {"format": "tsv", "columns": {"id": 0, "score": 1, "text": 2},
                                           "produces": "prompt", "name": "t"}, "train", ["line 1", "column 2"]),
    ("empty-dataset", "\n\n", {}, "train", ["d.jsonl", "empty"]),
    ("empty-split", PAIR + "\n", {"splits": {"train": 1.0, "test": 0.0, "seed": 0}}, "test",
     ["split 'test' is empty"]),
    ("chosen-equals-rejected", json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"}) + "\n", {},
     "train", ["1 row (0)", "differ at most in whitespace or invisible characters"]),
    ("zero-width-difference", json.dumps({"prompt": "p", "chosen": "same", "rejected": "sa\u200bme\ufeff"}) + "\n",
     {}, "train", ["1 row (0)", "differ at most in whitespace or invisible characters"]),
    ("invisible-completion", json.dumps({"prompt": "p", "completion": " \u200b\u2060 "}) + "\n",
     {"produces": "prompt_completion"}, "train", ["1 row (0)", "no visible text in 'completion'"]),
    ("whitespace-prompts", "".join(json.dumps({"prompt": p}) + "\n" for p in ["ok?", "  \n\t", "fine?"]),
     {"produces": "prompt"}, "train", ["1 row (1)", "no visible text in 'prompt'", "1 of 3 rows"]),
    ("non-utf8", PAIR.encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n', {}, "train", ["line 2", "not UTF-8"]),
    ("gzip-without-gz-name", gzip.compress((PAIR + "\n").encode(), mtime=0), {}, "train",
     ["d.jsonl", "reads it as jsonl text but it is gzip-compressed", "name it with `.gz` at the end"]),
    ("parquet-read-as-jsonl", b"PAR1\x15\x04\x15\x90\x01\x15\x90\x01\x2c" + b"\x00" * 16 + b"PAR1", {}, "train",
     ["d.jsonl", "it is a parquet file", "set `format: parquet`"]),
    ("utf16-text", (PAIR + "\n").encode("utf-16"), {}, "train", ["d.jsonl", "it is UTF-16 text", "save it as UTF-8"]),
    ("jsonl-read-as-parquet", PAIR + "\n", {"format": "parquet"}, "train",
     ["d.jsonl", "not a readable parquet file", "its first line looks like jsonl: set `format: jsonl`"]),
    ("unknown-format", PAIR, {"format": "xlsx"}, "train", ["field 'format'", "xlsx"]),
    ("unknown-produces", PAIR, {"produces": "triples"}, "train", ["field 'produces'", "triples"]),
    ("unknown-transform", PAIR, {"transform": {"shout": True}}, "train", ["unknown transform 'shout'"]),
    ("unknown-card-field", PAIR, {"licence": "MIT"}, "train", ["unknown field", "licence"]),
    ("sharegpt-roles", json.dumps({"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "yo"}]})
     + "\n", {"produces": "messages"}, "train", ["row 0: field 'messages'", "role 'human'", "user/assistant"]),
    ("csv-without-columns", "a,b\n", {"format": "csv", "produces": "prompt_completion"}, "train",
     ["rows are not named; add `columns:`"]),
    ("csv-header-read-as-a-row", "prompt,completion\nHi,there\n", {"format": "csv", "produces": "prompt_completion",
                                                                     "columns": {"prompt": 0, "completion": 1}},
     "train", ["line 1 is a header (prompt, completion)", "name them by the header", "prompt: prompt"]),
    ("csv-header-lacks-a-name", "question,answer\nHi,there\n", {"format": "csv", "produces": "prompt_completion",
                                                                 "columns": {"prompt": "question", "completion": "reply"}},
     "train", ["field 'columns': 'reply' is not in the header line", "question, answer"]),
    ("splits-a-list", PAIR, {"splits": ["train"]}, "train", ["field 'splits': a mapping", "got a list"]),
    ("transform-a-list", PAIR, {"transform": ["alpaca"]}, "train", ["field 'transform': a mapping", "{alpaca: {}}"]),
    ("columns-a-list", PAIR, {"columns": ["prompt", "completion"]}, "train", ["field 'columns': a mapping"]),
    ("split-seed-text", PAIR, {"splits": {"train": 1.0, "seed": "abc"}}, "train", ["splits.seed", "'abc'"]),
    ("splits-do-not-sum", PAIR, {"splits": {"train": 0.5, "test": 0.2}}, "train", ["splits", "sum to 1"]),
    ("missing-license", PAIR, {"license": None}, "train", ["field 'license' is required"]),
    ("non-text-field", json.dumps({"prompt": 3, "chosen": "a", "rejected": "b"}) + "\n", {}, "train",
     ["row 0", "'prompt' must be text"]),
    ("undefined-split", PAIR + "\n", {}, "validation", ["no split 'validation'"]),
    ("json-not-a-list", json.dumps({"a": 1}), {"format": "json"}, "train", ["list of rows"]),
    ("bad-prefix-args", json.dumps({"text": "a b c"}) + "\n", {"produces": "prompt_completion",
                                                               "transform": {"prefix_words": [5, 2]}}, "train",
     ["prefix_words", "min <= max"]),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_fail_with_location(tmp_path, case):
    _, data, fields, split, fragments = case
    card = _card(tmp_path, data, **fields)
    with pytest.raises(DataCardError) as err:
        load_split(card, split)
    for frag in fragments:
        assert frag in str(err.value), f"{frag!r} not in {err.value}"


def test_a_parquet_file_cut_short_is_called_that_and_a_csv_beginning_par1_is_a_csv(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i},\t", "chosen": "a", "rejected": "b"} for i in range(50)]),
                   tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    with pytest.raises(DataCardError, match=r"cut\.parquet: not a readable parquet file .*begins as parquet but is cut "
                                            r"short or damaged: copy or download it again"):
        load_split(_card(tmp_path, data[: len(data) // 2], "cut.parquet", format="parquet"), "train")
    csv = "PAR1,chosen,rejected\nhello,a,b\n"
    rows = load_split(_card(tmp_path, csv, "par.csv", format="csv", produces="preference",
                            columns={"prompt": "PAR1", "chosen": "chosen", "rejected": "rejected"}), "train").rows
    assert rows == [{"prompt": "hello", "chosen": "a", "rejected": "b"}]


def test_missing_card_file(tmp_path):
    with pytest.raises(DataCardError, match="data card not found"):
        load_card(tmp_path / "nope.yaml")


def test_gzip_jsonl_and_card_hash_changes_with_data(tmp_path):
    card = _card(tmp_path, gzip.compress((PAIR + "\n").encode()), name="d.jsonl.gz")
    h1 = load_card(card).content_hash()
    assert load_split(card, "train").rows[0]["chosen"] == "a"
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress((PAIR + "\n" + PAIR + "\n").encode()))
    assert load_card(card).content_hash() != h1


# --------------------------------------------------------------------------------------------- HH-RLHF
def test_hh_multi_turn_prompt_is_all_turns_before_final_reply():
    chosen = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: Why did the chicken..."
    rejected = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: No."
    rows, dropped = hh_transcript([{"chosen": chosen, "rejected": rejected}], None, 0)
    assert rows == [{"prompt": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant:",
                     "chosen": " Why did the chicken...", "rejected": " No."}]
    assert not dropped


def test_hh_pairs_diverging_before_last_turn_are_skipped_and_counted():
    a = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: joke\n\nAssistant: ha"
    b = "\n\nHuman: Hi\n\nAssistant: Go away.\n\nHuman: joke\n\nAssistant: no"
    same = "\n\nHuman: Hi\n\nAssistant: ok"
    two, spaced = "\n\nHuman: Hi\n\nAssistant: ok, go", "\n\nHuman: Hi\n\nAssistant: ok,\n  go"
    empty = "\n\nHuman: Hi\n\nAssistant: "
    rows, dropped = hh_transcript([{"chosen": a, "rejected": b}, {"chosen": same, "rejected": same},
                                   {"chosen": two, "rejected": spaced}, {"chosen": empty, "rejected": same},
                                   {"chosen": "no markers", "rejected": a},
                                   {"chosen": same + "\n\nAssistant: A", "rejected": same + "\n\nAssistant: B"},
                                   {"chosen": same + "\n\nAssistant: more\n\nHuman: joke\n\nAssistant: ha",
                                    "rejected": same + "\n\nAssistant: more\n\nHuman: joke\n\nAssistant: no"}],
                                  None, 0)
    assert rows == []
    assert dropped == {"chosen and rejected diverge before the final reply": 1,
                       "chosen identical to rejected (up to whitespace)": 2, "empty final reply": 1,
                       "unparseable transcript": 1, "final reply not after a Human turn": 1,
                       "two turns of one role in a row": 1}


def test_hh_turn_parser():
    assert parse_hh_turns("\n\nHuman: a\n\nAssistant: b") == [("user", "a"), ("assistant", "b")]


def test_vendored_hh_sample_parses():
    card = REPO / "data_cards" / "hh_rlhf_harmless_pairs.yaml"
    train = load_split(card, "train")
    assert len(train.rows) + len(load_split(card, "test").rows) + sum(train.dropped.values()) == 200
    assert len(train.rows) > 80 and set(train.dropped) <= {"prompt longer than 400 characters",
                                                            "chosen and rejected diverge before the final reply"}
    assert all(p["prompt"].endswith("\n\nAssistant:") and p["chosen"] != p["rejected"] for p in train.rows)


def test_alpaca_rows_become_prompt_completion_and_empty_outputs_are_counted(tmp_path):
    rows = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
            {"instruction": "Translate", "input": "chat", "output": "cat"},
            {"instruction": "Say nothing", "input": "", "output": "  "}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    card = _card(tmp_path, None, name="a.json", format="json", produces="prompt_completion",
                 transform={"alpaca": True})
    data = load_split(card, "train")
    assert data.rows == [{"prompt": "Name a colour.", "completion": " Blue."},
                         {"prompt": "Translate\n\nchat", "completion": " cat"}]
    assert data.dropped == {"empty output": 1}


def test_messages_form_validates_and_rejects_bad_turns(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    card = _card(tmp_path, json.dumps(good) + "\n", produces="messages")
    assert load_split(card, "train").rows == [good]
    bad = {"messages": [{"role": "user"}]}
    card = _card(tmp_path, json.dumps(bad) + "\n", produces="messages")
    with pytest.raises(DataCardError, match="row 0: field 'messages' must be a list of"):
        load_split(card, "train")


# --------------------------------------------------------------------------------------------- hub data as published
def test_implicit_prompt_conversations_become_the_explicit_form():
    """UltraFeedback as published: prompt a string, chosen / rejected whole user + assistant conversations."""
    from align.data.formats import FormatError, implicit_prompt

    user = {"role": "user", "content": "Name a prime."}
    row = {"prompt": "Name a prime.", "prompt_id": "x", "chosen": [user, {"role": "assistant", "content": "7"}],
           "rejected": [user, {"role": "assistant", "content": "8"}], "score_chosen": 9.0}
    out = implicit_prompt(row, "row 0")
    assert out["prompt"] == [user] and out["chosen"] == [{"role": "assistant", "content": "7"}]
    assert out["rejected"] == [{"role": "assistant", "content": "8"}] and out["score_chosen"] == 9.0
    # multi-turn: every shared turn up to the last user turn is the prompt
    turns = [{"role": "system", "content": "Be brief."}, user, {"role": "assistant", "content": "7"},
             {"role": "user", "content": "Another?"}]
    multi = implicit_prompt({"chosen": turns + [{"role": "assistant", "content": "11"}],
                             "rejected": turns + [{"role": "assistant", "content": "12"}]}, "row 1")
    assert multi["prompt"] == turns and multi["chosen"][0]["content"] == "11"
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "7"}],
                "rejected": [{"role": "assistant", "content": "8"}]}
    assert implicit_prompt(explicit, "row 2") is explicit  # already explicit: as it is
    text = {"prompt": "a", "chosen": " b", "rejected": " c"}
    assert implicit_prompt(text, "row 3") is text
    with pytest.raises(FormatError, match=r"row 4: fields 'chosen' and 'rejected' are whole conversations .* share 1 "
                                          r"of 2 and 3 turns; turn 1 differs: \('assistant', '7'\) in 'chosen', "
                                          r"\('assistant', '8'\) in 'rejected'"):  # rejected ends with no reply
        implicit_prompt({"chosen": [user, {"role": "assistant", "content": "7"}],
                         "rejected": [user, {"role": "assistant", "content": "8"}, {"role": "user", "content": "?"}]},
                        "row 4")
    with pytest.raises(FormatError, match=r"row 5: field 'prompt' is not the conversation's last user turn"):
        implicit_prompt({**row, "prompt": "Name a composite."}, "row 5")


def test_implicit_pairs_diverging_before_the_final_reply_are_dropped_and_counted_not_a_refused_card(tmp_path):
    """One UltraFeedback-style row whose conversations differ before the final reply (earlier assistant turns, or
    other user turns) refused the whole card, 1 row in 401, under a 1% allowance (a data review, 2026-12-02); such
    pairs are dropped and counted, as the HH transforms drop theirs. A trailing space in one user turn is no other
    prompt."""
    from align.data.cards import load_split

    def conv(*texts):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]

    rows = [{"prompt": f"Q{i}?", "chosen": conv(f"Q{i}?", "A"), "rejected": conv(f"Q{i}?", "B")} for i in range(400)]
    rows.append({"prompt": "more?", "chosen": conv("Hi", "a1", "more?", "A"), "rejected": conv("Hi", "b1", "more?", "B")})
    rows.append({"prompt": "Q ", "chosen": conv("Q ", "A"), "rejected": conv("Q", "B")})
    rows.append({"prompt": "more?", "chosen": conv("Hi", "a1", "more?", " "), "rejected": conv("Hi", "b1", "more?", "B")})
    (tmp_path / "uf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = tmp_path / "uf.yaml"
    card.write_text("name: uf\nsource: {path: uf.jsonl}\nlicense: MIT\nformat: jsonl\nproduces: preference\n"
                    "splits: {train: 1.0, seed: 3}\n")
    loaded = load_split(str(card), "train")
    assert len(loaded.rows) == 401 and not any(len(r) != 3 for r in loaded.rows)  # no mark left on a kept row
    assert [r["prompt"] for r in loaded.rows if r["chosen"][0]["content"] == "A" and
            r["prompt"][0]["content"].startswith("Q ")] == [[{"role": "user", "content": "Q "}]]
    assert {k: v for k, v in loaded.dropped.items() if "diverge" in k} == {
        "whose 'chosen' and 'rejected' conversations diverge before the final reply (no one prompt to compare the "
        "replies on)": 2}
    assert sum(loaded.dropped.values()) == 2  # the one with an empty reply as well counted once
    (tmp_path / "uf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5] + rows[400:401] * 3))
    with pytest.raises(Exception, match=r"3 rows \(5, 6, 7\) whose 'chosen' and 'rejected' conversations diverge"):
        load_split(str(card), "train")  # above the card's max_unusable_fraction: refused, naming them


def _uf_mirror(root: Path, ties: tuple[int, ...] = ()) -> Path:
    """A two-split UltraFeedback-shaped dataset in the hub's layout (parquet per split, named by the card's
    `configs:`), as `hf download` leaves it; the rows in `ties` rated alike."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    user = lambda i: {"content": f"Question {i}?", "role": "user"}  # noqa: E731
    rows = [{"prompt": f"Question {i}?", "prompt_id": str(i), "chosen": [user(i), {"content": f"Good {i}.", "role": "assistant"}],
             "rejected": [user(i), {"content": f"Bad {i}.", "role": "assistant"}], "messages": [user(i)],
             "score_chosen": 8.0, "score_rejected": 8.0 if i in ties else 3.0} for i in range(12)]
    ds = root / "HuggingFaceH4" / "ultrafeedback_binarized"
    (ds / "data").mkdir(parents=True)
    for split, part in (("train_prefs", rows[:9]), ("test_prefs", rows[9:])):
        pq.write_table(pa.Table.from_pylist(part), ds / "data" / f"{split}-00000-of-00001.parquet")
    (ds / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_prefs\n"
                                  "    path: data/train_prefs-*\n  - split: test_prefs\n    path: data/test_prefs-*\n---\n")
    return root


def test_the_ultrafeedback_card_reads_the_datasets_own_splits_as_published(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(_uf_mirror(tmp_path / "hub")))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    card = load_card(REPO / "data_cards" / "ultrafeedback_binarized_prefs.yaml")
    assert card.split_names == ["train", "test"]
    train, test = load_split(card, "train"), load_split(card, "test")
    assert len(train.rows) == 9 and len(test.rows) == 3  # train_prefs and test_prefs, whole: nothing re-split
    assert train.rows[0]["prompt"] == [{"content": "Question 0?", "role": "user"}]
    assert test.rows[0]["chosen"] == [{"content": "Good 9.", "role": "assistant"}]
    assert set(train.rows[0]) == {"prompt", "chosen", "rejected"}  # `columns:` keeps what the stages read
    with pytest.raises(DataCardError, match=r"no split 'validation'; the card defines \['test', 'train'\]"):
        load_split(card, "validation")
    assert train.dropped == {} and test.dropped == {}
    typo = tmp_path / "typo.yaml"  # the dataset is reached: a split it lacks is the card's error, not "unreachable"
    typo.write_text((REPO / "data_cards" / "ultrafeedback_binarized_prefs.yaml").read_text().replace(
        "train: train_prefs", "train: trian_prefs"))
    with pytest.raises(DataCardError, match=r"typo.yaml: field 'source' \(split: trian_prefs\): hub dataset .*has no "
                                            r"such split, config or data_dir: .*trian_prefs.*fix the card") as err:
        load_split(load_card(typo), "train")
    assert not isinstance(err.value, DataUnavailableError)
    before = card.content_hash()
    (tmp_path / "hub" / "HuggingFaceH4" / "ultrafeedback_binarized" / "README.md").write_text(
        (tmp_path / "hub" / "HuggingFaceH4" / "ultrafeedback_binarized" / "README.md").read_text() + "\n")
    assert card.content_hash() != before  # the mirrored files are part of the fingerprint


def test_ultrafeedback_pairs_rated_alike_are_dropped_and_counted(tmp_path, monkeypatch):
    """A review (2026-11-30): the card kept only prompt / chosen / rejected, so a pair whose `rejected` (one of the
    other completions at random) was rated as high as `chosen` trained the reward model and DPO on a coin flip, and
    counted in their held-out accuracy. The card maps the ratings and drops such pairs (and reversed ones)."""
    from align.data.formats import FormatError
    from align.data.transforms import drop_score_ties

    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(_uf_mirror(tmp_path / "hub", ties=(2, 5, 10))))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    card = load_card(REPO / "data_cards" / "ultrafeedback_binarized_prefs.yaml")
    train, test = load_split(card, "train"), load_split(card, "test")
    assert (len(train.rows), len(test.rows)) == (7, 2)
    assert train.dropped == {"rated alike (a tie)": 2} and test.dropped == {"rated alike (a tie)": 1}
    assert "Question 2?" not in str(train.rows) and set(train.rows[0]) == {"prompt", "chosen", "rejected"}
    rows = [{"chosen": "a", "rejected": "b", "s_c": 1, "s_r": 2}, {"chosen": "a", "rejected": "b", "s_c": 3, "s_r": 2}]
    kept, dropped = drop_score_ties(rows, {"chosen": "s_c", "rejected": "s_r"}, 0)
    assert kept == [{"chosen": "a", "rejected": "b"}] and dropped == {"rejected rated above chosen": 1}
    with pytest.raises(FormatError, match=r"row 0: transform drop_score_ties: field 'score_chosen' must be a number "
                                          r"\(a rating\), got None; map the ratings in `columns:`"):
        drop_score_ties([{"chosen": "a", "rejected": "b", "score_rejected": 2}], {}, 0)
    with pytest.raises(FormatError, match=r"expected \{\} or \{chosen: <field>, rejected: <field>\}"):
        drop_score_ties(rows, {"margin": 1}, 0)


def test_two_mirrors_of_one_dataset_and_a_mirror_rewritten_in_place_each_read_their_own_rows(tmp_path, monkeypatch):
    """datasets keys a local dataset's cache by its name and file patterns: a second mirror of UltraFeedback, at
    another path, read the first one's cached rows, and so did a mirror whose parquet was replaced in place, while
    the card's fingerprint (a digest of the files) said the data had changed."""
    import pyarrow.parquet as pq

    card = load_card(REPO / "data_cards" / "ultrafeedback_binarized_prefs.yaml")
    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(_uf_mirror(tmp_path / "a")))
    assert len(load_split(card, "train").rows) == 9
    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(_uf_mirror(tmp_path / "b", ties=(0, 1, 2))))
    assert len(load_split(card, "train").rows) == 6
    part = tmp_path / "b" / "HuggingFaceH4" / "ultrafeedback_binarized" / "data" / "train_prefs-00000-of-00001.parquet"
    pq.write_table(pq.read_table(part).slice(0, 4), part)  # rows 0-3, three of them ties
    assert len(load_split(card, "train").rows) == 1


def test_hub_source_splits_are_checked(tmp_path):
    def card(extra: str) -> Path:
        path = tmp_path / "c.yaml"
        path.write_text("name: x\nlicense: MIT\nformat: hub\nproduces: preference\n" + extra)
        return path

    with pytest.raises(DataCardError, match=r"'source.splits' names the dataset's own splits; remove `splits:`"):
        load_card(card("source: {hub: a/b, splits: {train: t}}\nsplits: {train: 1.0}\n"))
    with pytest.raises(DataCardError, match=r"source.splits': a mapping of align split -> the dataset's split"):
        load_card(card("source: {hub: a/b, splits: [train]}\n"))
    with pytest.raises(DataCardError, match=r"only a hub source names its own splits"):
        path = tmp_path / "local.yaml"
        (tmp_path / "rows.jsonl").write_text('{"prompt": "a"}\n')
        path.write_text("name: x\nlicense: MIT\nformat: jsonl\nproduces: prompt\nsource: {path: rows.jsonl, "
                        "splits: {train: train}}\n")
        load_card(path)


def test_a_users_transform_module_function_runs_is_checked_and_fingerprinted(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"q": f"q{i}", "a": f" a{i}"}) + "\n" for i in range(10)))
    (tmp_path / "my_rows.py").write_text(
        "from collections import Counter\n"
        "def to_pc(rows, args, seed):\n"
        "    out = [{'prompt': r['q'], 'completion': r['a']} for r in rows if r['q'] != args['skip']]\n"
        "    return out, Counter({'skipped by my_rows': len(rows) - len(out)})\n"
        "def broken(rows, args, seed):\n"
        "    return 'not rows'\n")
    path = tmp_path / "card.yaml"
    path.write_text("name: mine\nlicense: MIT\nformat: jsonl\nproduces: prompt_completion\nsource: {path: rows.jsonl}\n"
                    "transform: {'my_rows:to_pc': {skip: q3}}\nsplits: {train: 1.0, seed: 1}\n")
    loaded = load_split(path, "train")
    assert len(loaded.rows) == 9 and loaded.dropped["skipped by my_rows"] == 1
    assert {r["prompt"] for r in loaded.rows} == {f"q{i}" for i in range(10)} - {"q3"}
    before = load_card(path).content_hash()
    (tmp_path / "my_rows.py").write_text((tmp_path / "my_rows.py").read_text() + "# edited\n")
    assert load_card(path).content_hash() != before  # editing the transform reruns what reads the card
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("'my_rows:to_pc': {skip: q3}", "'my_rows:broken': true"))
    with pytest.raises(DataCardError, match=r"transform 'my_rows:broken' returned str, not a list of rows"):
        load_split(bad, "train")
    missing = tmp_path / "missing.yaml"
    missing.write_text(path.read_text().replace("my_rows:to_pc", "no_such_module:f"))
    with pytest.raises(DataCardError, match=r"transform 'no_such_module:f': cannot import module 'no_such_module'"):
        load_card(missing)


def test_the_chat_message_hh_hub_cards_read_the_published_layout(tmp_path, monkeypatch):
    """Anthropic/hh-rlhf's harmless-base/{train,test}.jsonl.gz, read as conversations (SFT messages and pairs)."""
    hh = tmp_path / "hub" / "Anthropic" / "hh-rlhf" / "harmless-base"
    hh.mkdir(parents=True)
    with gzip.open(REPO / "data_cards" / "data" / "hh_rlhf_harmless" / "harmless_base_sample_200.jsonl.gz", "rt") as fh:
        lines = fh.readlines()
    for split, part in (("train", lines[:150]), ("test", lines[150:])):
        with gzip.open(hh / f"{split}.jsonl.gz", "wt") as fh:
            fh.writelines(part)
    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    sft = load_split(REPO / "data_cards" / "hh_rlhf_harmless_hub_chat_sft.yaml", "train")
    pairs = load_split(REPO / "data_cards" / "hh_rlhf_harmless_hub_chat_pairs.yaml", "test")
    assert sft.rows and sft.rows[0]["messages"][0]["role"] == "user" and sft.rows[0]["messages"][-1]["role"] == "assistant"
    assert pairs.rows and isinstance(pairs.rows[0]["prompt"], list) and pairs.rows[0]["chosen"][0]["role"] == "assistant"
    assert sft.total_rows + sum(sft.dropped.values()) == 150 and pairs.total_rows + sum(pairs.dropped.values()) == 50


def test_pairs_that_teach_nothing_are_dropped_and_counted_up_to_the_cards_fraction(tmp_path):
    """UltraFeedback as published has pairs whose chosen and rejected are one and the same conversation (435 of its
    61,135 training pairs): a few such rows are dropped and counted, not a refusal of the whole dataset; above the
    card's max_unusable_fraction the card is refused, naming the rows."""
    from align.data.formats import implicit_prompt

    user = {"role": "user", "content": "Q?"}
    same = [user, {"role": "assistant", "content": "Same."}]
    assert implicit_prompt({"chosen": same, "rejected": list(same)}, "row")["prompt"] == [user]
    rows = [{"prompt": f"Q{i}?", "chosen": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "A"}],
             "rejected": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "B"}]}
            for i in range(150)]
    rows[7]["rejected"] = list(rows[7]["chosen"])  # identical conversations: the pair teaches nothing
    (tmp_path / "uf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = tmp_path / "uf.yaml"
    card.write_text("name: uf\nlicense: MIT\nformat: jsonl\nproduces: preference\nsource: {path: uf.jsonl}\n"
                    "splits: {train: 1.0, seed: 3}\n")
    loaded = load_split(card, "train")
    assert len(loaded.rows) == 149
    assert loaded.dropped == {"whose 'chosen' and 'rejected' differ at most in whitespace or invisible characters": 1}
    card.write_text(card.read_text() + "max_unusable_fraction: 0.005\n")  # 1 of 150 is 0.67%: above 0.5%
    with pytest.raises(DataCardError, match=r"1 row \(7\) whose 'chosen' and 'rejected' differ at most in whitespace or invisible characters\. "
                                            r"That is 1 of 150 rows \(0\.7%\), above the card's max_unusable_fraction"):
        load_split(card, "train")
    card.write_text(card.read_text().replace("0.005", "2"))
    with pytest.raises(DataCardError, match=r"field 'max_unusable_fraction': 2 is not a fraction between 0 and 1"):
        load_card(card)


def test_a_byte_order_mark_is_not_text_and_jsonl_lines_end_at_newline_only(tmp_path):
    """Excel writes CSV with a BOM; JSON allows U+2028 and U+0085 raw inside strings (str.splitlines splits there)."""
    (tmp_path / "d.csv").write_bytes("\ufeffWhat is up?\nHow are you?\n".encode())
    card = _card(tmp_path, None, name="d.csv", format="csv", produces="prompt", columns={"prompt": 0})
    assert [r["prompt"] for r in load_split(card, "train").rows] == ["What is up?", "How are you?"]
    rows = [{"prompt": "a\u2028b", "chosen": "c\x85d", "rejected": "e\x0cf"}, {"prompt": "q", "chosen": "x", "rejected": "y"}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows)
    card = _card(tmp_path, "\ufeff" + text)
    assert load_split(card, "train").rows == rows


def test_a_hub_revision_resolved_once_is_remembered_when_the_hub_cannot_be_asked(tmp_path, monkeypatch):
    """A hub card's fingerprint holds the commit its revision names. Resolved while the hub answers, it is
    remembered (align's cache), so a resume while the hub is down (or from an offline node) plans the same
    fingerprints instead of rerunning every stage that reads the dataset; never resolved, the revision as written."""
    import types

    import align.data.hub as hub

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # (the suite's default is offline: nothing is asked then, below)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv(hub.RUN_REVISIONS_ENV, raising=False)
    monkeypatch.setattr(hub, "_REVISIONS", {})
    asked = []

    class Api:
        def dataset_info(self, hub_id, revision=None):
            asked.append((hub_id, revision))
            return types.SimpleNamespace(sha="c0ffee" + hub_id[-1])

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(HfApi=Api))
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    assert hub.resolved_revision("org/data1", "main") == "main"  # never resolved: as written
    monkeypatch.setattr(hub, "_REVISIONS", {})
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    assert hub.resolved_revision("org/data1", "main") == "c0ffee1" and asked == [("org/data1", "main")]
    monkeypatch.setattr(hub, "_REVISIONS", {})  # a new planning process, the hub down
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    assert hub.resolved_revision("org/data1", "main") == "c0ffee1"
    assert hub.resolved_revision("org/data2", None) is None  # another dataset, never resolved
    assert json.loads((tmp_path / "cache" / "hub-revisions.json").read_text()) == {"org/data1@main": "c0ffee1"}
    monkeypatch.setattr(hub, "_REVISIONS", {})  # datasets offline, the hub reachable: datasets reads its cache, so
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)  # the commit is not asked (it may not be cached)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert hub.resolved_revision("org/data3", "main") == "main" and ("org/data3", "main") not in asked


def test_revisions_remembered_at_the_same_moment_are_all_kept(tmp_path, monkeypatch):
    """Runs sharing align's cache (a sweep) or a run's processes resolving other datasets at once: each adds its
    commit to the one file of remembered revisions, and none drops another's (each read is slowed here so that
    every writer reads before any has written: without the lock only one commit would be left)."""
    import threading
    import time

    import align.data.hub as hub

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hub.RUN_REVISIONS_ENV, raising=False)
    known = hub._known

    def slow_known(path=None):
        found = known(path)
        time.sleep(0.05)
        return found

    monkeypatch.setattr(hub, "_known", slow_known)
    writers = [threading.Thread(target=hub._remember, args=(f"org/data{i}", "main", f"sha{i}")) for i in range(6)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(30)
    kept = json.loads((tmp_path / "cache" / "hub-revisions.json").read_text())
    assert kept == {f"org/data{i}@main": f"sha{i}" for i in range(6)}, kept


def test_a_runs_own_record_of_a_commit_wins_over_a_newer_one_another_run_left(tmp_path, monkeypatch):
    """Two runs on one cache: A resolved the dataset's main at one commit, B later at a newer one (the hub moved).
    A resumed while the hub cannot be asked keeps the commit A resolved (its own record, <run dir>/hub-revisions.json),
    so its fingerprints do not change; a run with no record of its own takes the newest any run left in the cache."""
    import types

    import align.data.hub as hub

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    head = {"sha": "aaa111"}

    class Api:
        def dataset_info(self, hub_id, revision=None):
            return types.SimpleNamespace(sha=head["sha"])

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(HfApi=Api))

    def resolve(run: str, online: bool) -> str | None:
        monkeypatch.setattr(hub, "_REVISIONS", {})  # a new process
        monkeypatch.setenv(hub.RUN_REVISIONS_ENV, str(tmp_path / run / "hub-revisions.json"))
        monkeypatch.setattr(hub, "hub_reachable", lambda: online)
        return hub.resolved_revision("org/data", "main")

    assert resolve("a", online=True) == "aaa111"
    head["sha"] = "bbb222"
    assert resolve("b", online=True) == "bbb222"
    assert resolve("a", online=False) == "aaa111"
    assert resolve("c", online=False) == "bbb222"
    monkeypatch.setattr(hub, "_PINNED", [True])  # a stage process of run a, started after the branch moved: it reads
    assert resolve("a", online=True) == "aaa111"  # the commit a's plan fingerprinted, not the branch's newest
    assert resolve("d", online=True) == "bbb222"  # a commit its run's plan never resolved: asked for as before
    assert json.loads((tmp_path / "cache" / "hub-revisions.json").read_text()) == {"org/data@main": "bbb222"}


def test_a_prompts_split_does_not_depend_on_the_other_rows_a_card_kept(tmp_path):
    """A messages card and a preference card over the same 200 prompts, 0.9/0.1 with one seed, where the preference
    card drops one pair as unusable (chosen equal to rejected): every prompt lands in the same split in both. (Shuffled
    and cut by position, removing one key moved others across the cut: 2 of 20 SFT test prompts were in DPO train.)"""
    seed = 17
    print("split seed", seed)
    prompts = [f"Question number {i}?" for i in range(200)]
    sft = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": f"Answer {i}."}]}
           for i, p in enumerate(prompts)]
    pairs = [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": "good"}],
              "rejected": [{"role": "assistant", "content": "good" if i == 0 else "bad"}]} for i, p in enumerate(prompts)]
    splits = {"train": 0.9, "test": 0.1, "seed": seed}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _card(tmp_path / "a", "".join(json.dumps(r) + "\n" for r in sft), produces="messages", splits=splits)
    b = _card(tmp_path / "b", "".join(json.dumps(r) + "\n" for r in pairs), splits=splits)

    def of(card, split, key):
        return {key(r) for r in load_split(card, split).rows}

    sft_test = of(a, "test", lambda r: r["messages"][0]["content"])
    sft_train = of(a, "train", lambda r: r["messages"][0]["content"])
    dpo_train = of(b, "train", lambda r: r["prompt"][0]["content"])
    dpo_test = of(b, "test", lambda r: r["prompt"][0]["content"])
    assert load_split(b, "train").dropped and len(dpo_train | dpo_test) == 199  # the one pair was dropped
    assert not sft_test & dpo_train and not sft_train & dpo_test
    assert sft_test | sft_train == set(prompts) and not sft_test & sft_train
    assert 8 <= len(sft_test) <= 34, len(sft_test)  # 20 expected; binomial(200, 0.1) within ~3.5 sd


def test_csv_columns_named_by_the_header_line(tmp_path):
    """`columns` by name reads the first line as the header (a quoted field may hold the delimiter); by index there
    is no header line."""
    data = 'id,question,answer\n1,"Hi, you",there\n2,Why?,Because.\n'
    card = _card(tmp_path, data, name="d.csv", format="csv", produces="prompt_completion",
                 columns={"prompt": "question", "completion": "answer"})
    assert load_split(card, "train").rows == [{"prompt": "Hi, you", "completion": "there"},
                                               {"prompt": "Why?", "completion": "Because."}]
    card = _card(tmp_path, data.split("\n", 1)[1], name="e.csv", format="csv", produces="prompt_completion",
                 columns={"prompt": 1, "completion": 2})
    assert [r["prompt"] for r in load_split(card, "train").rows] == ["Hi, you", "Why?"]


def test_align_reads_offline_mode_as_huggingface_hub_and_datasets_do():
    """Offline mode was read three ways: the push's check took HF_HUB_OFFLINE alone (TRANSFORMERS_OFFLINE=1 trained
    every stage, then the push failed), the cards' took "on" for online and let HF_DATASETS_OFFLINE=1 turn the hub
    offline. Each environment below is read by huggingface_hub and datasets themselves, in a fresh interpreter."""
    import itertools
    import subprocess

    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    cases = [dict(zip(names, v)) for v in itertools.product((None, "", "0", "1", "on", "True "), repeat=3)][::7]
    probe = ("import json, os, sys, importlib\nimport huggingface_hub.constants as c, datasets.config as d\n"
             "from align.data import hub\nout = []\nfor env in json.loads(sys.argv[1]):\n"
             "    for k, v in env.items():\n        os.environ.pop(k, None) if v is None else os.environ.update({k: v})\n"
             "    importlib.reload(c); importlib.reload(d)\n"
             "    out.append([c.HF_HUB_OFFLINE, hub.hub_offline(), d.HF_HUB_OFFLINE, hub.datasets_offline()])\n"
             "print(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", probe, json.dumps(cases)], capture_output=True, text=True,
                          check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(got) == len(cases) >= 30
    for env, (lib, ours, lib_data, ours_data) in zip(cases, got):
        assert (ours, ours_data) == (lib, lib_data), env
    assert any(row[0] for row in got) and not all(row[0] for row in got)  # both answers occur


def test_the_hub_probe_goes_where_huggingface_hub_would_connect(monkeypatch):
    """The probe took port 443 for an http HF_ENDPOINT (a mirror on port 80) and ignored HTTPS_PROXY: on a cluster
    that reaches the hub through a proxy alone it said "unreachable", and validation left every hub card unread and
    fingerprinted its revision as written, so a dataset's update never reran a stage."""
    from align.data.hub import hub_address

    for key in ("HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    assert hub_address() == ("huggingface.co", 443)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.internal")
    assert hub_address() == ("mirror.internal", 80)
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.cluster:3128")
    assert hub_address() == ("proxy.cluster", 3128)
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert hub_address() == ("huggingface.co", 443)
    for key in ("HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("ALL_PROXY", "socks5h://gate.cluster")  # httpx reads ALL_PROXY too; SOCKS listens on 1080
    assert hub_address() == ("gate.cluster", 1080)
