"""Offline preference-stage settings that trained something other than asked (a probe of dpo, kto, reward and
preferences settings, 2026-11-29): each passed `align validate` and is now refused naming the field and the fix, or
refused by the stage before it trains. Seeds: the pipelines' own (17) and SEED below, printed."""

from __future__ import annotations

import types

import pytest

from conftest import REPO, refused, validate

DEFAULT = str(REPO / "pipelines" / "default.yaml")
SEED = 20261129
PAIRWISE = "preferences.pairwise={name: j, model: m, base_url: 'http://127.0.0.1:9/v1'}"


@pytest.mark.parametrize("overrides, needles", [
    # one optimiser step at the default warmup (0.05 of 1 step rounds up to 1): the only step ran at learning rate 0
    (["dpo.max_steps=1"], ["stages.dpo", "warmup_ratio: 0.05 of max_steps 1 warms up for every step"]),
    (["sft.max_steps=9", "sft.warmup_ratio=0.9"], ["stages.sft", "warmup_ratio: 0.9 of max_steps 9"]),
    # transformers' polynomial schedule decays to a fixed 1e-7, which it refuses to reach from below, at train time
    (["dpo.lr_scheduler=polynomial", "dpo.learning_rate=1e-7"], ["stages.dpo", "learning_rate: 1e-07 with lr_scheduler: polynomial"]),
    # a pairwise judge compares the first two samples: the rest were sampled and dropped
    ([PAIRWISE], ["stages.preferences", "samples_per_prompt: 4 with a pairwise judge", "set samples_per_prompt: 2"]),
    ([PAIRWISE.replace("}", ", max_prompts: 10}"), "preferences.samples_per_prompt=2"],
     ["pairwise.max_prompts: 10: a preferences stage judges every prompt it samples"]),
    # the held-out share of the prompts rounds to none or all of them
    (["preferences.max_prompts=2"], ["test_fraction: 0.1 of 2 prompts", "holds out 0: no held-out pairs"]),
    (["preferences.max_prompts=2", "preferences.test_fraction=0.9"], ["holds out 2: no training pairs"]),
    # sweeps whose variants differ only in what the stage leaves unread trained twins
    (["dpo.sweep={lora.r: [8, 16]}"], ["stages.dpo.sweep.lora.r:", "which the stage does not read (lora.enabled is false)"]),
    (["dpo.sweep={lora.dropout: [0.0, 0.1]}", "dpo.lora.enabled=true"],
     ["stages.dpo.sweep.lora.dropout:", "a dpo stage trains with dropout off"]),
    (["reward.sweep={warmup_ratio: [0.0, 0.1]}", "reward.lr_scheduler=constant"],
     ["stages.reward.sweep.warmup_ratio:", "lr_scheduler is constant"]),
    ([PAIRWISE, "preferences.samples_per_prompt=2", "preferences.sweep={min_margin: [0.1, 0.5]}"],
     ["stages.preferences.sweep.min_margin:", "a pairwise judge labels the pairs"]),
    (["ppo.sweep={lora.alpha: [16, 32]}"], ["stages.ppo.sweep.lora.alpha:", "lora.enabled is false"]),
    # settings left out of the fingerprint, and epochs under max_steps (2026-11-30 probe: twins that validated)
    (["dpo.sweep={save_steps: [5, 10]}"], ["stages.dpo.sweep.save_steps:", "left out of its fingerprint"]),
    (["dpo.max_steps=20", "dpo.sweep={epochs: [1, 2]}"], ["stages.dpo.sweep.epochs:", "max_steps is set"]),
    (["dpo.sweep={save_total_limit: [1, 2]}"], ["stages.dpo.sweep.save_total_limit:", "left out of its fingerprint"]),
    (["ppo.sweep={generation.engine_timeout_s: [60, 600]}"],
     ["stages.ppo.sweep.generation.engine_timeout_s:", "left out of its fingerprint"]),
    # train_turns picks among a conversation's assistant turns: not for prompt/completion rows
    (["sft.train_turns=last"], ["stages.sft", "train_turns: 'last' picks the assistant turns", "the card produces "
                                "'prompt_completion'"]),
    # `mode` is the sweep's own keyword: a value that is neither a mode nor a list of a setting's values
    (["dpo.sweep={mode: 3, beta: [0.1, 0.2]}"], ["stages.dpo.sweep.mode: 3 is not one of cartesian, zip"]),
    # a trainer's max_length that no reply of its preferences stage fits in, after any prompt: refused after sampling
    (["dpo.max_length=32"], ["stages.dpo.max_length: 32 cannot hold a reply of stages.preferences.generation."
                             "max_new_tokens (32 tokens)", "raise max_length"]),
    (["reward.max_length=24"], ["stages.reward.max_length: 24 cannot hold a reply"]),
])
def test_preference_settings_that_would_not_train_as_asked_are_refused(overrides, needles, capsys):
    rc, out = validate(capsys, DEFAULT, *overrides)
    refused(out, rc, *needles)


def test_the_same_settings_where_they_are_read_still_validate(capsys):
    for overrides in (["dpo.max_steps=2"], ["dpo.max_steps=1", "dpo.warmup_ratio=0"],
                      ["dpo.max_steps=1", "dpo.lr_scheduler=constant"],
                      ["dpo.lr_scheduler=polynomial", "dpo.learning_rate=1e-6"],
                      ["dpo.sweep={lora.r: [8, 16]}", "dpo.lora.enabled=true"],
                      ["preferences.max_prompts=10"], ["dpo.sweep={warmup_ratio: [0.0, 0.1]}"],
                      ["dpo.sweep={epochs: [1, 2]}"], ["dpo.sweep={accelerate: [cpu, zero2]}"]):
        rc, out = validate(capsys, DEFAULT, *overrides)
        assert rc == 0, (overrides, out[-2000:])


def test_a_stage_whose_epochs_give_one_step_is_refused_before_it_trains(tmp_path):
    """max_steps is checked at validate; the steps an epoch gives are known only once the data is loaded."""
    from transformers import TrainerState, TrainingArguments

    from align.runtime.context import StageError
    from align.runtime.resume import stop_at_max_steps

    callback = stop_at_max_steps("dpo")
    for scheduler, steps, refuses in (("cosine", 1, True), ("cosine", 2, False), ("constant", 1, False),
                                      ("linear", 19, False)):
        args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=0.05, lr_scheduler_type=scheduler,
                                 use_cpu=True, report_to="none")
        state = TrainerState()
        state.max_steps = steps
        if refuses:
            with pytest.raises(StageError, match=r"stage 'dpo': warmup_ratio 0.05 of its 1 optimiser steps"):
                callback.on_train_begin(args, state, None)
        else:
            callback.on_train_begin(args, state, None)


def test_a_preferences_stage_whose_pairs_are_all_held_out_fails_instead_of_publishing_none():
    from align.config.preferences import PreferencesStage
    from align.runtime.context import StageError
    from align.data.cards import held_out_prompts
    from align.stages.preferences import split_pairs

    print(f"seed {SEED}")
    ctx = types.SimpleNamespace(name="preferences", seed=SEED)
    records = [{"prompt": f"p{i}", "responses": ["good", "bad"], "scores": [1.0, 0.0], "ended": [True, True]}
               for i in range(3)]
    cfg = PreferencesStage(test_fraction=0.5)
    splits, pairs, ties, cut = split_pairs(ctx, cfg, records)
    assert (len(splits["train"]) + len(splits["test"]), ties, cut) == (3, 0, 0) and splits["train"] and splits["test"]
    tied = [dict(r, scores=[0.5, 0.5]) for r in records]
    # at 0.9 every prompt but one is held out (one is always kept); that one's samples tie: nothing to train on
    kept = next(p for p in ("p0", "p1", "p2") if p not in held_out_prompts(["p0", "p1", "p2"], 0.9, SEED))
    records = [dict(r, scores=[0.5, 0.5]) if r["prompt"] == kept else r for r in records]
    with pytest.raises(StageError, match=r"no training pairs: 2 pairs are held out \(test_fraction 0.9 of 3 prompts\), "
                                         r"1 prompts tied"):
        split_pairs(ctx, PreferencesStage(test_fraction=0.9), records)
    with pytest.raises(StageError, match=r"none of 3 prompts made a pair: 3 were ties \(min_margin"):
        split_pairs(ctx, PreferencesStage(), tied)
    with pytest.raises(StageError, match=r"the pairwise judge preferred neither response"):
        split_pairs(ctx, PreferencesStage(pairwise=object()), tied)


def test_held_out_prompts_that_all_tie_are_said_and_stay_held_out_for_a_later_round(capsys):
    """10 prompts at test_fraction 0.1 hold one out by the floor of one; when its samples tie, no held-out pair is left:
    said (the reward stage refuses such data). Drawing the held-out prompts from those that paired instead moved the
    floor onto a prompt round 1 of iterated DPO trained on: the held-out set is every sampled prompt's."""
    from align.config.preferences import PreferencesStage
    from align.data.cards import held_out_prompts
    from align.stages.preferences import split_pairs

    print(f"seed {SEED}")
    ctx = types.SimpleNamespace(name="preferences", seed=SEED)
    prompts = [f"p{i}" for i in range(10)]
    held = held_out_prompts(prompts, 0.1, SEED)
    paired = [{"prompt": p, "responses": ["good", "bad"], "scores": [1.0, 0.0], "ended": [True, True]} for p in prompts]
    first, _, _, _ = split_pairs(ctx, PreferencesStage(test_fraction=0.1), paired)
    assert {p["prompt"] for p in first["test"]} == held
    tied = [dict(r, scores=[0.5, 0.5]) if r["prompt"] in held else r for r in paired]
    later, pairs, ties, _ = split_pairs(ctx, PreferencesStage(test_fraction=0.1), tied)
    assert ties == len(held) and not later["test"] and len(later["train"]) == len(pairs) == 10 - len(held)
    assert not {p["prompt"] for p in first["train"]} & {p["prompt"] for p in later["test"]}
    assert "warning: no held-out pair" in capsys.readouterr().out


def test_whether_a_prompt_is_held_out_is_its_own_so_a_later_round_with_more_prompts_never_tests_on_trained_ones():
    """Iterated DPO: round 2's preferences stage sampled 300 prompts where round 1's sampled 200 (the same first
    200). Held out by position (random.sample of indices), 15 of round 2's 30 test prompts had been round 1's training
    prompts, so dpo2's held-out figures were partly on prompts its starting policy trained on. Now membership is a
    seeded hash of the prompt: none, whatever the counts, and still about test_fraction of them."""
    from align.config.preferences import PreferencesStage
    from align.stages.preferences import split_pairs

    print(f"seed {SEED}")
    ctx = types.SimpleNamespace(name="pairs", seed=SEED)
    rows = [{"prompt": f"prompt {i}", "responses": ["good", "bad"], "scores": [1.0, 0.0], "ended": [True, True]}
            for i in range(2048)]
    for small, large in ((200, 300), (200, 190), (2000, 2048)):
        first, _, _, _ = split_pairs(ctx, PreferencesStage(test_fraction=0.1), rows[:small])
        later, _, _, _ = split_pairs(ctx, PreferencesStage(test_fraction=0.1), rows[:large])
        trained = {p["prompt"] for p in first["train"]}
        assert not trained & {p["prompt"] for p in later["test"]}, (small, large)
        assert 0.05 * large <= len(later["test"]) <= 0.15 * large


def test_a_sample_cut_at_max_new_tokens_goes_into_no_pair():
    """TRL's DPO, KTO and reward trainers append EOS to a text reply: a sample cut at max_new_tokens ("the film was
    so very") was trained as a reply that ends there. Such samples are left out of every pair (and counted); a
    prompt left with fewer than two makes none; `drop_unfinished: false` pairs them as before."""
    from align.config.preferences import PreferencesStage
    from align.runtime.context import StageError
    from align.stages.preferences import split_pairs

    print(f"seed {SEED}")
    ctx = types.SimpleNamespace(name="preferences", seed=SEED)
    records = [{"prompt": f"p{i}", "responses": ["great.", "the film was so very", "dull.", "fine."],
                "scores": [0.9, 1.0, 0.1, 0.5], "ended": [True, False, True, True]} for i in range(10)]
    records[3]["ended"] = [True, False, False, False]  # one finished sample: no pair
    splits, pairs, ties, cut = split_pairs(ctx, PreferencesStage(test_fraction=0.2), records)
    assert (len(pairs), ties, cut) == (9, 0, 1)
    assert all((p["chosen"], p["rejected"]) == ("great.", "dull.") for p in pairs)  # not the cut best-scored one
    assert not [p for p in splits["train_all_pairs"] if "so very" in p["chosen"] + p["rejected"]]
    assert len(splits["train_all_pairs"]) == 3 * len({p["prompt"] for p in splits["train"]})
    _, pairs, _, cut = split_pairs(ctx, PreferencesStage(test_fraction=0.2, drop_unfinished=False), records)
    assert cut == 0 and pairs[0]["chosen"] == "the film was so very"
    every = [dict(r, ended=[False, False, True, False]) for r in records]
    with pytest.raises(StageError, match=r"none of 10 prompts made a pair: 0 were ties .*; 10 had fewer than two "
                                         r"samples that ended within generation.max_new_tokens \(\d+\): raise it, "
                                         r"or set drop_unfinished: false"):
        split_pairs(ctx, PreferencesStage(), every)


@pytest.mark.parametrize("overrides, needles, absent", [
    # a list or mapping where one value is meant was told it was "a number or a date: quote it"
    (["dpo.policy=[sft]"], ["stages.dpo.policy: expected a string, got ['sft']"], "quote it"),
    (["preferences.judge=[vader]"], ["stages.preferences.judge: expected a string or a mapping, got ['vader']"],
     "quote it"),
    (["preferences.judge={vader: x}"], ["stages.preferences.judge.vader: expected a number, got 'x'"], "convert"),
    (["dpo.beta=2026-11-29"], ["stages.dpo.beta", "expected a number"], None),
    # a split the card lacks named the card alone, not the stage that asked for it
    (["sft.split=validation"], ["stages.sft.data (split 'validation'):", "no split 'validation'"], None),
    # distinct values whose variant names collide were called duplicates
    (["dpo.sweep={data: [a/b.yaml, a_b.yaml]}"], ["both named 'dpo-data_a_b.yaml'", "differ only elsewhere"],
     "must be distinct"),
])
def test_refusals_name_the_field_and_say_what_is_wrong(overrides, needles, absent, capsys):
    rc, out = validate(capsys, DEFAULT, *overrides)
    refused(out, rc, *needles)
    assert absent is None or absent not in out, out[-2000:]


def test_sample_texts_says_which_samples_ended_in_the_order_of_the_prompts():
    """The engine samples in length-sorted batches; `ended` comes back in the order of the prompts, as the texts."""
    import torch

    from align.config import Generation
    from align.modeling.generation import Rollout, sample_texts

    class Engine:
        def generate(self, batch, gen, seed):  # ends (EOS) exactly the prompts of an odd number of words
            n = len(batch)
            return Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                           torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long),
                           torch.tensor([len(p.split()) % 2 == 1 for p in batch]))

    class Tokenizer:
        def __call__(self, prompts, add_special_tokens=True):
            return {"input_ids": [p.split() for p in prompts]}

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    prompts = ["a b c d", "e", "f g", "h i j", "k l m n o p"]
    ended: list = []
    texts, _ = sample_texts(Engine(), Tokenizer(), prompts, Generation(batch_size=2), seed=0, ended=ended)
    assert len(texts) == 5 and ended == [len(p.split()) % 2 == 1 for p in prompts]


def test_a_reward_stage_with_no_held_out_pair_is_refused_before_it_trains(monkeypatch):
    """Its held-out accuracy is the reward stage's result: with an empty test split (or every test pair longer than
    max_length) it trained and published without eval/rewards/accuracy, and `align status` showed "-"."""
    from align.config.reward import RewardStage
    from align.runtime.context import StageError
    from align.stages import reward

    long_pair = {"prompt": "p", "chosen": "a " * 600, "rejected": "b"}
    monkeypatch.setattr(reward, "load_rows", lambda ctx, data, split, *a, **kw: [] if split == "test" else [long_pair])
    monkeypatch.setattr(reward, "check_lengths", lambda *a: None)
    ctx = types.SimpleNamespace(cfg=RewardStage(init="sft", data="preferences", max_length=64), name="reward",
                                input_model=lambda name: "model", load_tokenizer=lambda path: None)
    with pytest.raises(StageError, match=r"stage 'reward': preferences's test split holds no pair to measure the "
                                         r"reward model's accuracy on; give it held-out pairs"):
        reward.run(ctx)
    monkeypatch.setattr(reward, "pairs_within", lambda rows, tok, n: [])
    monkeypatch.setattr(reward, "load_rows", lambda ctx, data, split, *a, **kw: [long_pair])
    with pytest.raises(StageError, match=r"\(1 longer than max_length 64: raise it\)"):
        reward.run(ctx)
