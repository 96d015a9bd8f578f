"""How the preferences stage turns one prompt's judged samples into pairs (align/stages/preferences.py), on
hand-made scores: the best-vs-worst pair, and every non-tied pair for a reward model (split train_all_pairs)."""

from __future__ import annotations

import pytest

from align.stages.preferences import all_pairs, pair_up


def test_best_vs_worst_pair_and_ties():
    pair = pair_up("p", ["a", "b", "c"], [0.1, 0.9, -0.4], 0.1)
    assert (pair["chosen"], pair["rejected"], pair["score_chosen"], pair["score_rejected"]) == ("b", "c", 0.9, -0.4)
    assert pair_up("p", ["a", "b"], [0.30, 0.35], 0.1) is None  # margin 0.05 < 0.1: a tie
    assert pair_up("p", ["same", "same"], [0.0, 1.0], 0.1) is None  # the same text twice is no comparison


def test_every_pair_that_is_not_a_tie_higher_score_chosen():
    # scores 0.5, -0.2, 0.45, 0.9: pairs (0,1) 0.7, (0,2) 0.05 tie, (0,3) 0.4, (1,2) 0.65, (1,3) 1.1, (2,3) 0.45;
    # texts 1 and 3 differ; with margin 0.1 five of the six pairs remain
    responses = ["w", "x", "y", "z"]
    got = all_pairs("p", responses, [0.5, -0.2, 0.45, 0.9], 0.1)
    assert [(p["chosen"], p["rejected"]) for p in got] == [("w", "x"), ("z", "w"), ("y", "x"), ("z", "x"),
                                                            ("z", "y")]
    assert all(p["prompt"] == "p" and p["score_chosen"] - p["score_rejected"] >= 0.1 for p in got)
    # identical texts are no pair whatever their scores, and a text sampled twice counts once, as first sampled:
    # [A, A, B] wrote the pair of A and B twice (weighing it double), and both ways round where the copies' scores
    # straddle B's
    assert all_pairs("p", ["a", "a", "b"], [0.0, 1.0, 2.0], 0.1) == [
        {"prompt": "p", "chosen": "b", "rejected": "a", "score_chosen": 2.0, "score_rejected": 0.0}]
    assert [(p["chosen"], p["rejected"]) for p in all_pairs("p", ["a", "b", "a"], [0.0, 1.0, 3.0], 0.1)] == [("b", "a")]
    assert len(all_pairs("p", ["a", "b"], [0.0, 1.0], 0.1)) == 1


def test_equal_scores_are_a_tie_at_min_margin_0():
    """`min_margin: 0` is allowed; an exact tie (VADER scores neutral text 0.0) was a pair then, its chosen side the
    earlier sample by position alone: coin-flip labels for the reward model. Equal scores are a tie at any margin."""
    assert pair_up("p", ["a", "b", "c"], [0.0, 0.0, 0.0], 0.0) is None
    assert all_pairs("p", ["a", "b", "c"], [0.0, 0.0, 0.25], 0.0) == [
        {"prompt": "p", "chosen": "c", "rejected": "a", "score_chosen": 0.25, "score_rejected": 0.0},
        {"prompt": "p", "chosen": "c", "rejected": "b", "score_chosen": 0.25, "score_rejected": 0.0}]
    assert pair_up("p", ["a", "b"], [0.0, 0.25], 0.25)["chosen"] == "b"  # a margin equal to min_margin is a pair


def test_pairs_that_render_identically_through_the_template_are_dropped_or_refused():
    """A template that trims replies (Llama-3's `| trim`) makes 'Yes.' and 'Yes. ' one text to the model: the data card
    compared them as different; the stage that renders them drops a few and counts them, and refuses many."""
    from pathlib import Path
    from types import SimpleNamespace

    import pytest
    from transformers import AutoTokenizer

    from align.runtime.context import StageError
    from align.runtime.rows import _rendered

    repo = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(repo / "tokenizers" / "gpt2")
    tok.chat_template = (repo / "tests" / "chat_templates" / "llama3_1.jinja").read_text()
    tok.add_special_tokens({"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"})  # Llama-3's
    user = [{"role": "user", "content": "Is it on?"}]
    rows = [{"prompt": user, "chosen": [{"role": "assistant", "content": f"Yes {i}."}],
             "rejected": [{"role": "assistant", "content": f"No {i}."}]} for i in range(150)]
    rows[42]["rejected"] = [{"role": "assistant", "content": "  Yes 42.\n"}]  # differs only in what the template trims
    ctx = SimpleNamespace(name="dpo", extra_manifest={})
    kept = _rendered(ctx, rows, tok, "pairs split 'train'")
    assert len(kept) == 149 and all(r["chosen"] != r["rejected"] for r in kept)
    assert ctx.extra_manifest["dropped_rows"] == {"pairs split 'train': identical after the chat template": 1}
    rows[7]["rejected"] = [{"role": "assistant", "content": "Yes 7. "}]  # 2 of 150: above 1%
    with pytest.raises(StageError, match=r"stage 'dpo': pairs split 'train': 2 of 150 pairs have chosen and rejected "
                                         r"replies that render identically through the chat template .*the pairs of the prompts"):
        _rendered(SimpleNamespace(name="dpo", extra_manifest={}), rows, tok, "pairs split 'train'")

    # `align validate` refuses such a card before anything trains: its helper renders the card's pairs for the
    # length check, the same way (align/modeling/checks.py)
    from align.config import stage_types
    from align.modeling.checks import CheckError, check_length

    rule = stage_types()["dpo"].LENGTH_RULE.name
    with pytest.raises(CheckError, match=r"p.yaml: stages.dpo.data: 2 of 150 pairs have chosen and rejected replies"):
        check_length(tok, "p.yaml", False, "stages.dpo.data", "dpo", rule, rows, 512, 0.5)
    rows[7]["rejected"] = [{"role": "assistant", "content": "No 7."}]  # 1 of 150: dropped by the stage, passes
    check_length(tok, "p.yaml", False, "stages.dpo.data", "dpo", rule, rows, 512, 0.5)


def test_the_policy_is_freed_before_a_pairwise_judge_loads(tmp_path, monkeypatch):
    """A local pairwise judge loads a model of its own onto the GPU once sampling is done: the policy (held by the hf
    engine, itself held by the stage's closing(engine) until its block ended) must be gone by then, or an 8B policy
    and an 8B judge share one GPU. The judge sees no live policy and every prompt's samples."""
    import contextlib
    import gc
    import weakref
    from types import SimpleNamespace

    import torch

    from align.config import Generation
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.stages import preferences
    from families import TEXTS, build

    seed = 13
    print("seed", seed)
    torch.manual_seed(seed)
    base, tok_dir = build("llama", tmp_path / "llama", seed=seed)
    tok = load_tokenizer(str(tok_dir))
    loaded = []

    def load_lm(path, device=False, frozen=False):
        loaded.append(weakref.ref(model := load_causal_lm(path)))
        return model

    seen = []

    def judge_pairwise(ctx, cfg, records, plain=None):
        gc.collect()
        seen.append(([ref() is None for ref in loaded], len(records)))

    monkeypatch.setattr(preferences, "judge_pairwise", judge_pairwise)
    compute = SimpleNamespace(fast_generation=lambda fast: False, engine_dtype=lambda: "float32",
                              autocast=contextlib.nullcontext, device=torch.device("cpu"))
    ctx = SimpleNamespace(load_lm=load_lm, compute=compute, seed=seed, dir=tmp_path, progress=lambda *a: None, name="p",
                          state=SimpleNamespace(process_index=0, num_processes=1), note_engine=lambda e: None,
                          is_main=True, checkpoints=tmp_path / "checkpoints")
    cfg = SimpleNamespace(generation=Generation(batch_size=4, max_new_tokens=3), judge=None, samples_per_prompt=2,
                          pairwise=object())
    records, _, _ = preferences.sample_records(ctx, cfg, tok, list(TEXTS), str(base))
    assert seen == [([True], len(TEXTS))] and all(len(r["responses"]) == 2 for r in records)


def test_each_round_of_iterated_dpo_samples_with_its_own_random_numbers(tmp_path, monkeypatch):
    """pairs1, pairs2, ... share the pipeline's seed: every round sampled with round 1's random numbers (the same
    tokens wherever DPO had moved the policy little). The stage's name is in its sampling seed now: one stage samples
    the same texts each time it runs, another stage from the same policy others."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from align.config import Generation
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.stages import preferences
    from families import TEXTS, build

    seed = 29
    print("seed", seed)
    torch.manual_seed(seed)
    base, tok_dir = build("llama", tmp_path / "llama", seed=seed)
    tok = load_tokenizer(str(tok_dir))
    monkeypatch.setattr(preferences, "judge_pairwise", lambda ctx, cfg, records, plain=None: None)
    compute = SimpleNamespace(fast_generation=lambda fast: False, engine_dtype=lambda: "float32",
                              autocast=contextlib.nullcontext, device=torch.device("cpu"))
    cfg = SimpleNamespace(generation=Generation(batch_size=8, max_new_tokens=6), judge=None, samples_per_prompt=2,
                          pairwise=object())

    prompts = [f"{text} ({i})" for i in range(3) for text in TEXTS]  # 3 batches of up to 4 prompts (8 samples)
    last: dict = {}

    def samples(name, attempt=""):
        ctx = SimpleNamespace(load_lm=lambda path, device=False, frozen=False: load_causal_lm(path), compute=compute,
                              seed=seed, dir=tmp_path, progress=lambda *a: None, name=name, note_engine=lambda e: None,
                              state=SimpleNamespace(process_index=0, num_processes=1), is_main=True,
                              checkpoints=tmp_path / f"{name}{attempt}" / "checkpoints")
        records, last["counts"], _ = preferences.sample_records(ctx, cfg, tok, prompts, str(base))
        return [r["responses"] for r in records]

    first = samples("pairs1")
    assert samples("pairs1", "again") == first and samples("pairs2") != first
    # killed after its first batch: the next attempt samples the others alone, and gets what one attempt gets
    real, calls = preferences.sample_texts, []

    def killed_after_one(*args, **kwargs):
        calls.append(1)
        if calls == [1, 1] and kill:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(preferences, "sample_texts", killed_after_one)
    kill = True
    with pytest.raises(KeyboardInterrupt):
        samples("pairs1", "killed")
    calls.clear()
    kill = False
    assert samples("pairs1", "killed") == first and len(calls) == 2 and last["counts"]["resumed_batches"] == 1
    # a 32-bit seed whatever the pipeline's seed (vLLM and numpy refuse larger), with room for rank and batch index
    assert all(preferences.sampling_seed(SimpleNamespace(seed=s, name="preferences")) < 2 ** 31 for s in (0, 383, 4294))


def test_prompts_that_leave_no_room_for_a_reply_within_the_models_positions_are_dropped_and_counted(tmp_path):
    """Preferences and evaluate sampled every prompt whatever its length: past the model's positions a RoPE model
    samples from positions it never learned (nothing refuses) and the vllm engine refuses to start after loading.
    They are dropped and counted now, as PPO drops prompts over max_prompt_length; a published adapter is sized by
    its base; none left fails the stage."""
    import json
    from types import SimpleNamespace

    import pytest

    from align.modeling.models import ADAPTER_BASE, load_tokenizer
    from align.runtime.context import StageError
    from align.runtime.rows import prompts_within_positions
    from families import TEXTS, build

    base, tok_dir = build("llama", tmp_path / "llama")
    tok = load_tokenizer(str(tok_dir))
    config = json.loads((base / "config.json").read_text())
    config["max_position_embeddings"] = 24
    (base / "config.json").write_text(json.dumps(config))
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    room = 24 - sorted(lengths)[1] - 1  # the two shorter prompts fit with this many new tokens (and the one position
    # more the engine is started with), the longest not
    assert sorted(lengths)[1] < max(lengths)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / ADAPTER_BASE).write_text(json.dumps({"base_model": str(base), "task": "CAUSAL_LM"}))
    for path in (base, adapter):
        ctx = SimpleNamespace(pipeline=SimpleNamespace(trust_remote_code=False), extra_manifest={}, is_main=True,
                              name="pairs")
        kept = prompts_within_positions(ctx, list(TEXTS), tok, str(path), room)
        assert kept == [t for t, n in zip(TEXTS, lengths) if n + room < 24] and len(kept) == 2
        assert ctx.extra_manifest["dropped_rows"] == {
            f"no room for generation.max_new_tokens ({room}) within the model's 24 positions": 1}
    with pytest.raises(StageError, match=r"every prompt is too long to sample 24 tokens .* 24 positions"):
        prompts_within_positions(ctx, list(TEXTS), tok, str(base), 24)


def test_a_judges_nan_or_inf_pairs_with_nothing_wherever_it_lies_and_one_text_counts_once():
    """A reward model's NaN made a pair or a tie depending on its position among the samples ([nan, 1, 0]: a tie;
    [1, 0, nan]: a pair), an inf made the mean margin inf (then "the model diverged: lower learning_rate", which a
    preferences stage does not have), and NaN was written into samples.jsonl (not strict JSON). Non-finite scores
    are None now, counted, and pair with nothing; a judge that scores nothing finitely is named in the error. The
    best and the worst sample of one text were a tie though a distinct sample lay between them; each text counts
    once, at its copies' mean score (whatever their order). A pairwise judge's prompt with one finished sample of two
    (no scores) raised IndexError after all the judging."""
    import pytest

    from align.runtime.context import StageError
    import json
    import math
    from types import SimpleNamespace

    from align.config.preferences import PreferencesStage
    from align.stages.preferences import finite_or_none, split_pairs

    def record(prompt, responses, scores, ended=None, **kw):
        return {"prompt": prompt, "responses": responses, "scores": scores, "ended": ended or [True] * 3, **kw}

    ctx, cfg = SimpleNamespace(name="prefs", seed=0), PreferencesStage(test_fraction=0.0)
    records = [record("a", ["x", "y", "z"], [math.nan, 1.0, 0.0]), record("b", ["x", "y", "z"], [1.0, 0.0, math.nan]),
               record("c", ["x", "y", "z"], [math.inf, 1.0, 0.0]), record("d", ["same", "mid", "same"], [3.0, 2.5, 0.0]),
               record("e", ["same", "mid", "same"], [0.0, 2.5, 3.0])]
    assert finite_or_none(records) == 3
    json.loads(json.dumps(records), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict JSON
    splits, pairs, ties, cut = split_pairs(ctx, cfg, records)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [
        ("a", "y", "z"), ("b", "x", "y"), ("c", "y", "z"), ("d", "mid", "same"), ("e", "mid", "same")]
    assert ties == cut == 0 and pairs[3]["score_rejected"] == 1.5  # "same" at its copies' mean
    nan = [record(p, ["x", "y", "z"], [math.nan] * 3) for p in "fg"]
    finite_or_none(nan)
    with pytest.raises(StageError, match="the judge gave 6 samples no finite score"):
        split_pairs(ctx, cfg, nan)
    pairwise = [record("e", ["x", "y"], [1.0, 0.0], [True, True], outcome="win"),
                record("f", ["x", "y"], [], [True, False], outcome="unfinished")]
    _, pairs, ties, cut = split_pairs(ctx, PreferencesStage(pairwise=object(), test_fraction=0.0), pairwise)
    assert [p["prompt"] for p in pairs] == ["e"] and (ties, cut) == (0, 1)


def test_an_invalid_verdict_or_a_prompt_without_two_finite_scores_is_not_counted_a_tie():
    """`preferences/ties_dropped` counted the pairwise judge's invalid verdicts (scored 0.5 each, as a tie) and
    prompts left without two finite scores: 8 wins and 2 invalid read as 2 ties though the judge said tie to none,
    and with every verdict invalid the error said they "were ties (the pairwise judge preferred neither ...)"."""
    import math
    from types import SimpleNamespace

    from align.config.preferences import PreferencesStage
    from align.runtime.context import StageError
    from align.stages.preferences import finite_or_none, split_pairs

    def judged(prompt, outcome):
        scores = {"win": [1.0, 0.0], "tie": [0.5, 0.5], "invalid": [0.5, 0.5]}[outcome]
        return {"prompt": prompt, "responses": ["x", "y"], "scores": scores, "ended": [True, True], "outcome": outcome}

    ctx, cfg = SimpleNamespace(name="prefs", seed=0), PreferencesStage(pairwise=object(), test_fraction=0.0)
    records = [judged(f"w{i}", "win") for i in range(8)] + [judged("i0", "invalid"), judged("i1", "invalid"),
                                                            judged("t0", "tie")]
    _, pairs, ties, cut = split_pairs(ctx, cfg, records)
    assert (len(pairs), ties, cut) == (8, 1, 0)
    with pytest.raises(StageError, match=r"none of 2 prompts made a pair: 0 were ties .*; 2 had no valid verdict"):
        split_pairs(ctx, cfg, [judged("i0", "invalid"), judged("i1", "invalid")])
    nan = [{"prompt": "n", "responses": ["x", "y", "z"], "scores": [math.nan, 1.0, math.inf], "ended": [True] * 3},
           {"prompt": "t", "responses": ["x", "y"], "scores": [1.0, 1.0], "ended": [True] * 2}]
    finite_or_none(nan)
    _, pairs, ties, cut = split_pairs(ctx, PreferencesStage(test_fraction=0.0), nan + [
        {"prompt": "p", "responses": ["x", "y"], "scores": [1.0, 0.0], "ended": [True] * 2}])
    assert (len(pairs), ties) == (1, 1)  # "n" has one finite score: no pair, and no tie


def test_samples_kept_for_a_pairwise_judge_are_named_by_what_drew_them_not_by_the_judge(tmp_path):
    """preferences/sampled/ lets a rerun judge the samples an earlier attempt drew: its name must change with
    anything that changes the samples (the prompts, the generation settings, the policy's publication, the dtype,
    the engine's precision, the seed) and not with the judge (a rerun with other judge settings reuses them)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from align.config import Generation
    from align.config.preferences import PreferencesStage
    from align.stages.preferences import _sampled_paths

    def ctx(**kw):
        p = {"dtype": "auto", "precision": "auto", "attn_implementation": "auto", **kw.pop("pipeline", {})}
        compute = SimpleNamespace(engine_dtype=lambda: kw.get("engine_dtype", "float32"), device=torch.device("cpu"),
                                  fast_generation=lambda fast: False)
        spec = SimpleNamespace(input_digests={"sft": kw.get("digest", "d1")}, code_version="v1")
        return SimpleNamespace(dir=tmp_path, seed=kw.get("seed", 7), name="prefs", spec=spec, compute=compute,
                               pipeline=SimpleNamespace(**p), state=SimpleNamespace(num_processes=kw.get("world", 1)))

    def _sampled_path(context, cfg, prompts, rank, world):  # process `rank`'s of `world` (its context says world)
        assert context.state.num_processes == world
        return _sampled_paths(context, cfg, prompts)[rank]

    cfg = PreferencesStage(policy="sft", pairwise=object(), generation=Generation(max_new_tokens=8))
    base = _sampled_path(ctx(), cfg, ["p1", "p2"], 0, 1)
    other_judge = dataclasses.replace(cfg, pairwise=object(), min_margin=0.5)
    assert _sampled_path(ctx(), other_judge, ["p1", "p2"], 0, 1) == base
    changed = [_sampled_path(ctx(), cfg, ["p1"], 0, 1),
               _sampled_path(ctx(), dataclasses.replace(cfg, generation=Generation(max_new_tokens=9)), ["p1", "p2"], 0, 1),
               _sampled_path(ctx(digest="d2"), cfg, ["p1", "p2"], 0, 1),
               _sampled_path(ctx(pipeline={"dtype": "float32"}), cfg, ["p1", "p2"], 0, 1),
               _sampled_path(ctx(engine_dtype="bfloat16"), cfg, ["p1", "p2"], 0, 1),
               _sampled_path(ctx(seed=8), cfg, ["p1", "p2"], 0, 1),
               _sampled_path(ctx(), dataclasses.replace(cfg, samples_per_prompt=3), ["p1", "p2"], 0, 1)]
    assert base not in changed and len({p.name for p in changed}) == len(changed)
    assert _sampled_path(ctx(world=2), cfg, ["p1", "p2"], 1, 2).name.endswith(".rank1of2.json")
