"""A reward model scores no sequence longer than it trained on (its reward stage's max_length: RewardTrainer drops
longer pairs): PPO, GRPO and RLOO whose sequences could pass it are refused at validate, and evaluate leaves out the
prompts after which a response of generation.max_new_tokens would pass it, counted and said in the report.

Before, evaluate sampled any held-out prompt: the 8B UltraFeedback recipe's reward model trained within 2048 tokens
and evaluate sampled 1024 after prompts of any length, so the report's reward-model scores and win rates mixed in
sequences past what its head learned to score (a learned-position model's IndexError)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO


def _default(pipeline: str = "default.yaml", **stages) -> tuple:
    from align.config import parse_pipeline

    raw = yaml.safe_load((REPO / "pipelines" / pipeline).read_text())
    for name, settings in stages.items():
        raw["stages"].setdefault(name, {}).update(settings)
    return parse_pipeline(raw, f"pipelines/{pipeline}"), REPO / "pipelines" / pipeline


def test_ppo_whose_sequences_pass_the_reward_models_max_length_is_refused_at_validate():
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    validate(*_default(reward={"max_length": 64}), verbose=False)  # 32 + 32 = 64: within
    with pytest.raises(PipelineError, match=r"stages\.ppo: max_prompt_length \+ generation\.max_new_tokens \(65\) is "
                                            r"longer than reward stage 'reward' trained on \(stages\.reward\."
                                            r"max_length: 64\).*raise stages\.reward\.max_length to 65"):
        validate(*_default(reward={"max_length": 64}, ppo={"max_prompt_length": 33}), verbose=False)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_grpo_and_rloo_whose_max_length_passes_the_reward_models_are_refused_at_validate(kind):
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    online = {"type": kind, "policy": "sft", "reward": "reward", "generation": {"max_new_tokens": 32},
              "prompts": "../data_cards/movie_review_snippets.yaml", "max_length": 128}
    validate(*_default(online=online), verbose=False)  # the reward stage's default max_length is 128
    with pytest.raises(PipelineError, match=r"stages\.online: max_length \(128\) is longer than reward stage 'reward' "
                                            r"trained on \(stages\.reward\.max_length: 96\)"):
        validate(*_default(online=online, reward={"max_length": 96}), verbose=False)


def test_sampling_whose_responses_alone_fill_the_reward_models_max_length_is_refused_at_validate():
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    with pytest.raises(PipelineError, match=r"stages\.evaluate\.generation\.max_new_tokens \(32\) leaves no room for "
                                            r"a prompt within the longest sequence reward stage 'reward' trained on "
                                            r"\(stages\.reward\.max_length: 32\)"):
        validate(*_default(reward={"max_length": 32}), verbose=False)  # PPO's line too
    second = {"type": "preferences", "policy": "dpo", "judge": "reward", "generation": {"max_new_tokens": 32},
              "prompts": "../data_cards/movie_review_snippets.yaml"}  # a second round labelled by the reward model
    with pytest.raises(PipelineError, match=r"stages\.again\.generation\.max_new_tokens \(32\) leaves no room for "
                                            r"a prompt within the longest sequence reward stage 'reward' trained on"):
        validate(*_default(again=second, reward={"max_length": 32}), verbose=False)


def test_sampling_whose_every_prompt_leaves_no_room_within_the_reward_models_max_length_is_refused_at_validate():
    """Before, the stage counted that only when it started (after every stage before it trained) and failed there."""
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    tiny = "hh_rlhf_tiny.yaml"  # the gpt2 tokenizer: lengths are counted at validate; the reward model's max_length 192
    evaluate = {"policies": ["sft", "dpo"], "generation": {"max_new_tokens": 170}}  # room for 22 tokens
    validate(*_default(tiny, evaluate=evaluate), verbose=False)  # a few HH prompts are that short
    evaluate["generation"] = {"max_new_tokens": 190}  # room for 2: shorter than any templated HH prompt
    with pytest.raises(PipelineError, match=r"stages\.evaluate: all \d+ prompts are longer than 2 tokens after "
                                            r"templating and tokenisation, so none leaves room for a reply of "
                                            r"generation\.max_new_tokens within the max_length of the reward stage"):
        validate(*_default(tiny, evaluate=evaluate), verbose=False)
    validate(*_default(tiny, evaluate={**evaluate, "reward": None}), verbose=False)  # no reward model scores them
    again = {"type": "preferences", "policy": "dpo", "judge": "reward", "generation": {"max_new_tokens": 190},
             "prompts": "../data_cards/hh_rlhf_harmless_pairs.yaml"}  # a second round labelled by the reward model
    with pytest.raises(PipelineError, match=r"stages\.again: all \d+ prompts are longer than 2 tokens"):
        validate(*_default(tiny, again=again), verbose=False)
    validate(*_default(tiny, again={**again, "judge": "vader"}), verbose=False)


class _WordTokenizer:
    """One token a word (what the counts below are in)."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [t.split() for t in texts]}


def test_prompts_whose_responses_could_pass_a_reward_models_max_length_are_left_out_where_it_scores_samples(
        tmp_path, monkeypatch):
    """evaluate and preferences sample after prompts of any length (no max_prompt_length): the prompts after which a
    response of generation.max_new_tokens could pass the reward stage's max_length are dropped and counted."""
    import json

    import align.stages.preferences as preferences
    from align.runtime.context import StageError
    from align.runtime.rows import prompts_within_reward_models

    (tmp_path / "reward").mkdir()
    (tmp_path / "reward" / "spec.json").write_text(json.dumps({  # as the runner writes it (align/core/rundir.py)
        "stage_name": "reward", "stage_dir": str(tmp_path / "reward"), "fingerprint": "f", "pipeline": {},
        "stage": {"type": "reward", "max_length": 8}}))
    ctx = SimpleNamespace(input_dir=lambda name: tmp_path / name, extra_manifest={}, is_main=True, name="evaluate")
    judge = SimpleNamespace(reward_models={"reward": SimpleNamespace(tokenizer=_WordTokenizer())})
    prompts = ["one", "one two three", "one two three four", "a b c d e f"]  # 1, 3, 4, 6 words: 6, 8, 9, 11
    assert prompts_within_reward_models(ctx, prompts, judge, 5) == prompts[:2]
    assert ctx.extra_manifest["dropped_rows"] == {
        "no room for generation.max_new_tokens (5) within the max_length of reward stage 'reward' (8), the longest "
        "it trained on": 2}
    with pytest.raises(StageError, match=r"every prompt is too long to sample 5 tokens .*reward stage 'reward' \(8\)"
                                         r".*the shortest has 4 tokens"):
        prompts_within_reward_models(ctx, prompts[2:], judge, 5)
    assert prompts_within_reward_models(ctx, prompts, None, 5) == prompts  # a pairwise judge: no reward model

    seen: list = []  # the preferences stage samples only the prompts left (stopped at the engine: nothing loads)
    monkeypatch.setattr(preferences, "stage_judge", lambda ctx, name: judge)
    monkeypatch.setattr(preferences, "make_engine", lambda *a, **k: seen.append(k["max_model_len"]) or 1 / 0)
    monkeypatch.setattr(preferences, "longest_prompt", lambda tok, ps: seen.append(list(ps)) or 0)
    cfg = SimpleNamespace(judge="reward", pairwise=None, samples_per_prompt=2,
                          generation=SimpleNamespace(engine="hf", max_new_tokens=5, batch_size=4, fast=False))
    ctx.load_lm = lambda *a, **k: SimpleNamespace(eval=lambda: None)
    ctx.state = SimpleNamespace(process_index=0, num_processes=1)
    ctx.compute = SimpleNamespace(fast_generation=lambda fast: False, engine_dtype=lambda: None, device="cpu")
    ctx.dir, ctx.seed = tmp_path, 17
    with pytest.raises(ZeroDivisionError):
        preferences.sample_records(ctx, cfg, _WordTokenizer(), prompts, "policy")
    assert seen[0] == prompts[:2]
    (tmp_path / "reward" / "spec.json").unlink()  # a reward stage whose spec names no max_length: nothing to keep to
    assert prompts_within_reward_models(ctx, prompts, judge, 5) == prompts


def test_the_report_says_how_many_prompts_were_left_out_as_too_long():
    from align.config.evaluate import EvaluateStage
    from align.report.markdown import render_report

    cfg = EvaluateStage(policies=["sft", "dpo"], judges=[], reward=None, preferences=None, prompts="x.yaml")
    m = {"eval/prompts": 2, "eval/prompts_too_long": 3}
    for p in cfg.policies:
        m.update({f"eval/{p}/kl": 0.5, f"eval/{p}/ref_perplexity": 3.0, f"eval/{p}/response_length": 7.0})
    samples = {p: {"responses": ["r0", "r1"], "kl": [0.1, 0.2], "scores": {}} for p in cfg.policies}
    assert ("n = 2 held-out prompts (3 more left out: too long for generation.max_new_tokens after them within the "
            "model's positions or the reward stage's max_length") in render_report(cfg, m, ["p0", "p1"], samples, [])
    m["eval/prompts_too_long"] = 0
    assert "n = 2 held-out prompts\n" in render_report(cfg, m, ["p0", "p1"], samples, []) + "\n"
