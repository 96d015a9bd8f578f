"""KTO (unpaired preferences): the data form its config module declares, pairs unpaired into desirable and
undesirable rows, and `pipelines/kto.yaml` (sft -> preferences -> dpo, kto -> evaluate) run tiny, with KTO beside
DPO in the report. Seeds are the pipeline's (17) and, for the shuffle tests, printed."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_align

SEED = 23
TINY_KTO = [
    "builtin.vocab_size=512", "builtin.hidden_size=32", "builtin.num_layers=2", "builtin.num_heads=2",
    "builtin.intermediate_size=64", "builtin.max_position_embeddings=96",
    "sft.max_steps=30", "sft.per_device_batch_size=16", "sft.logging_steps=5", "sft.save_steps=10",
    "sft.learning_rate=3e-3", "sft.max_truncated_fraction=0.1", "sft.max_train_examples=2000",
    "preferences.max_prompts=128", "preferences.min_margin=0.05", "preferences.generation.max_new_tokens=12",
    "dpo.max_length=96", "dpo.max_steps=8", "dpo.logging_steps=2", "dpo.save_steps=4", "dpo.per_device_batch_size=8",
    "kto.max_length=96", "kto.max_steps=8", "kto.logging_steps=2", "kto.save_steps=4", "kto.per_device_batch_size=8",
    # KTO under ZeRO-2 with gradient accumulation 2 (8 x 2 = the 16 rows per step it had on one plain process)
    "kto.accelerate=zero2", "kto.num_processes=1", "kto.gradient_accumulation_steps=2",
    "evaluate.max_prompts=24", "evaluate.generation.max_new_tokens=12", "evaluate.bootstrap_samples=200",
]


def test_pairs_are_unpaired_into_a_desirable_and_an_undesirable_row_each():
    from align.config.kto import unpaired

    print(f"seed {SEED}")
    pairs = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)]
    rows = unpaired(pairs, SEED)
    assert len(rows) == 40
    assert sorted((r["prompt"], r["completion"], r["label"]) for r in rows) == sorted(
        [(f"p{i}", f"good {i}", True) for i in range(20)] + [(f"p{i}", f"bad {i}", False) for i in range(20)])
    assert rows == unpaired(pairs, SEED) and rows != unpaired(pairs, SEED + 1)  # shuffled, by the seed
    assert [r["label"] for r in rows] != [True, False] * 20  # not left in pair order (KTO reads batches in order)
    assert len(unpaired(pairs, SEED, 10)) == 10  # max_train_examples counts examples, not the pairs they came from


def test_a_reply_two_pairs_label_both_ways_is_dropped_as_a_cards_row_would_be():
    """Pairs A > B and B > C unpaired into (B, desirable) and (B, undesirable): the two rows' gradients cancel, and
    both counted toward the KL estimate and desirable_fraction; a card's such rows were dropped, pairs' were not."""
    from align.config.kto import unpaired

    print(f"seed {SEED}")
    pairs = [{"prompt": "p", "chosen": "A", "rejected": "B"}, {"prompt": "p", "chosen": "B", "rejected": "C"},
             {"prompt": "q", "chosen": "B", "rejected": "C"}]  # another prompt's B is another example
    rows = unpaired(pairs, SEED)
    assert sorted((r["prompt"], r["completion"], r["label"]) for r in rows) == [
        ("p", "A", True), ("p", "C", False), ("q", "B", True), ("q", "C", False)]


def test_the_weighted_ratio_of_desirable_to_undesirable_examples_by_hand():
    """KTO's recommended lambda_D n_D / (lambda_U n_U) in [1, 4/3]: 80 desirable and 20 undesirable rows at weights
    1 and 1 give 4 (the stage warns, naming desirable_weight 0.25 to 0.333); at 0.3 they give 1.2."""
    from align.config.kto import weighted_ratio

    assert weighted_ratio(80, 20, 1.0, 1.0) == 4.0
    assert abs(weighted_ratio(80, 20, 0.3, 1.0) - 1.2) < 1e-12
    assert weighted_ratio(5, 0, 1.0, 1.0) == float("inf")


def test_a_card_of_unpaired_rows_in_label_order_is_shuffled_into_mixed_batches():
    from align.config.kto import unpaired

    print(f"seed {SEED}")
    rows = [{"prompt": f"p{i}", "completion": f"c{i}", "label": i < 40} for i in range(80)]  # desirable ones first
    out = unpaired(rows, SEED)
    assert sorted(map(repr, out)) == sorted(map(repr, rows)) and out == unpaired(rows, SEED)
    batches = [{r["label"] for r in out[i:i + 8]} for i in range(0, 80, 8)]
    assert sum(len(b) == 2 for b in batches) >= 8, batches  # in file order, all 10 batches held one label


def test_validate_refuses_a_cut_of_kto_data_that_holds_one_label(capsys, tmp_path):
    from conftest import refused, validate

    rows = [{"prompt": f"The movie {i}", "completion": f" was {'great' if i % 2 else 'dull'}", "label": bool(i % 2)}
            for i in range(40)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = tmp_path / "thumbs.yaml"
    card.write_text("name: thumbs\nsource: {path: rows.jsonl}\nlicense: MIT\nformat: jsonl\n"
                    "produces: unpaired_preference\nsplits: {train: 0.8, test: 0.2, seed: 1}\n")
    base = [str(REPO / "pipelines" / "kto.yaml"), *TINY_KTO, f"kto.data={card}"]
    rc, out = validate(capsys, *base)
    assert rc == 0, out[-2000:]
    rc, out = validate(capsys, *base, "kto.max_train_examples=1")
    refused(out, rc, "stages.kto", "thumbs.yaml", "every training example is", "max_train_examples: 1 keeps 1")


def test_the_unpaired_form_is_declared_by_the_stage_and_checked(tmp_path):
    from align.config import stage_types
    from align.data.cards import DataCardError, load_split
    from align.data.formats import FORMS

    stage_types()
    assert FORMS["unpaired_preference"].columns == ("prompt", "completion", "label")
    rows = [{"prompt": f"The movie {i}", "completion": f" was {w}", "label": w == "great"}
            for i, w in enumerate(["great", "dull"] * 10)]

    def card(data, max_unusable_fraction=None):
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        path = tmp_path / "card.yaml"
        path.write_text("name: thumbs\nsource: {path: rows.jsonl}\nlicense: MIT\nformat: jsonl\n"
                        "produces: unpaired_preference\nsplits: {train: 0.8, test: 0.2, seed: 1}\n"
                        + (f"max_unusable_fraction: {max_unusable_fraction}\n" if max_unusable_fraction else ""))
        return path

    loaded = load_split(card(rows), "train")
    assert loaded.rows and all(isinstance(r["label"], bool) for r in loaded.rows)
    with pytest.raises(DataCardError, match=r"row 3: field 'label' must be true or false .*got 'yes'"):
        load_split(card(rows[:3] + [dict(rows[3], label="yes")] + rows[4:]), "train")
    with pytest.raises(DataCardError, match=r"1 row \(5\) with no visible text in 'completion'"):
        load_split(card(rows[:5] + [dict(rows[5], completion="  ")] + rows[6:]), "train")
    conflict = rows + [dict(rows[0], label=not rows[0]["label"])]  # row 20 says row 0's completion is the wrong one
    with pytest.raises(DataCardError, match=r"2 rows \(0, 20\) whose prompt and completion appear labelled both"):
        load_split(card(conflict), "train")
    with pytest.raises(DataCardError, match=r"10 rows .* in data with no undesirable \(label: false\) row at all.*"
                                            r"That is every row, so no setting can help") as err:
        load_split(card([r for r in rows if r["label"]]), "train")
    assert "raise max_unusable_fraction" not in str(err.value)  # advice that cannot work is not given
    with pytest.raises(DataCardError, match=r"no undesirable \(label: false\) row at all.*That is every row"):
        load_split(card([r for r in rows if r["label"]], max_unusable_fraction=1.0), "train")  # not "split is empty"


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_a_csv_card_spells_its_labels_as_text_and_they_are_read_as_true_or_false(tmp_path, fmt):
    """CSV / TSV hold text only: a label column of "True" / "false" / "1" / "0" is the labels (it was refused as
    "must be true or false, got 'True'"); other text still is refused, naming the row."""
    from align.config import stage_types
    from align.data.cards import DataCardError, load_split

    stage_types()
    sep = "," if fmt == "csv" else "\t"
    spellings = ["True", "false", "1", "0", " TRUE ", "False"]
    lines = [sep.join(["prompt", "completion", "label"])] + [
        sep.join([f"The movie {i}", f"was take {i}", spellings[i % 6]]) for i in range(24)]

    def card(text):
        (tmp_path / f"rows.{fmt}").write_text(text)
        path = tmp_path / "card.yaml"
        path.write_text(f"name: thumbs\nsource: {{path: rows.{fmt}}}\nlicense: MIT\nformat: {fmt}\n"
                        "columns: {prompt: prompt, completion: completion, label: label}\n"
                        "produces: unpaired_preference\nsplits: {train: 1.0, seed: 1}\n")
        return path

    rows = load_split(card("\n".join(lines) + "\n"), "train").rows
    want = {f"The movie {i}": spellings[i % 6].strip().lower() in ("true", "1") for i in range(24)}
    assert {r["prompt"]: r["label"] for r in rows} == want and all(type(r["label"]) is bool for r in rows)
    lines[4] = lines[4].rsplit(sep, 1)[0] + sep + "yes"
    with pytest.raises(DataCardError, match=r"row 3: field 'label' must be true or false .*got 'yes'"):
        load_split(card("\n".join(lines) + "\n"), "train")


def test_a_flag_is_read_from_numbers_and_numpy_scalars_and_nothing_else():
    """A 0/1 column made float by a missing value (pandas), or numpy scalars a transform returned, are labels too;
    a 2, a NaN, 'yes' or None is not."""
    import numpy as np

    from align.data.formats import FormatError, flag_value

    for value, want in ((np.bool_(True), True), (np.int64(0), False), (1.0, True), (0.0, False), (" 1.0", True),
                        (1, True), (False, False)):
        assert flag_value(value, "row 0: field 'label'") is want, value
    for value in (2, float("nan"), "yes", None, -1.0, b"1"):
        with pytest.raises(FormatError, match=r"row 0: field 'label' must be true or false"):
            flag_value(value, "row 0: field 'label'")


def test_validate_refuses_a_card_kto_cannot_learn_from(workdir):
    proc = run_align("validate", "pipelines/kto.yaml", *TINY_KTO, "kto.data=../data_cards/movie_review_snippets.yaml",
                     cwd=workdir)
    assert proc.returncode == 2
    assert "stages.kto: data: card produces 'prompt_completion'; kto needs preference pairs or unpaired_preference" \
        in proc.stderr


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    proc = run_align("run", "pipelines/kto.yaml", "tracking.wandb=disabled", *TINY_KTO, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "runs" / "kto" / "main", proc


def test_kto_trains_from_the_sft_policy_on_the_unpaired_pairs(kto_run):
    run, _ = kto_run
    m = json.loads((run / "kto" / "manifest.json").read_text())
    pairs = json.loads((run / "preferences" / "manifest.json").read_text())["final_metrics"]["preferences/pairs_train"]
    assert m["status"] == "completed" and m["global_step"] == 8
    assert m["final_metrics"]["train/examples"] == 2 * pairs  # every pair: one desirable, one undesirable row
    assert m["final_metrics"]["train/conflicting_rows_dropped"] == 0  # one pair a prompt: no reply labelled both ways
    assert m["final_metrics"]["train/desirable_fraction"] == 0.5
    assert m["final_metrics"]["train/weighted_desirable_ratio"] == 1.0  # pairs: as many of each, at weights 1 and 1
    rows = [json.loads(x) for x in (run / "kto" / "metrics.jsonl").read_text().splitlines()]
    margins = [r["rewards/margin"] for r in rows if "rewards/margin" in r]
    # desirable completions gained log-probability over undesirable ones, relative to the reference (0 at first)
    assert len(margins) == 4 and margins[0] < 0.01 and margins[-1] > margins[0] + 0.02, margins
    held_out = [r for r in rows if "eval/rewards/margin" in r]  # logged once, under its singular name (TRL's plural
    assert len(held_out) == 1 and not any("eval/rewards/margins" in r for r in rows)  # was logged beside it)
    assert held_out[0]["eval/rewards/margin"] == m["final_metrics"]["eval/rewards/margin"]

    from transformers import AutoModelForCausalLM

    sft = AutoModelForCausalLM.from_pretrained(run / "sft" / "model")
    kto = AutoModelForCausalLM.from_pretrained(run / "kto" / "model")
    changed = [n for (n, a), (_, b) in zip(sft.named_parameters(), kto.named_parameters()) if not a.equal(b)]
    assert len(changed) == len(list(sft.parameters()))  # full fine-tuning moved every tensor


def test_the_report_has_kto_beside_dpo(kto_run):
    run, proc = kto_run
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    for policy in ("dpo", "kto"):
        assert 0.0 <= metrics[f"eval/{policy}/vader/win_rate"] <= 1.0
        assert metrics[f"eval/{policy}/kl"] == metrics[f"eval/{policy}/kl"]  # a number, not NaN
    report = (run / "report" / "report.md").read_text()
    assert "| kto |" in report and "| dpo |" in report
    assert "| kto |" in proc.stdout  # the run's closing headline, from the evaluate stage's manifest
