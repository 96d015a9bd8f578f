"""Hostile evaluation inputs (a probe of the judges and the report, 2026-11-29): a seed sweep whose pairwise win rate is
NaN crashed evaluate after all its sampling; metrics.json held bare NaN (no JSON reader but Python's takes it); a
report without pointwise judges had tables whose rows and headers disagreed; a pairwise judge named `response`
replaced the policy's text in samples.jsonl; a pairwise judge with only the baseline completed judging nothing; the
length-controlled win rate reported the penalty's choice where the data could not tell length from the policy."""

from __future__ import annotations

from contextlib import nullcontext
import json
import math

import numpy as np

import pytest

from align.report import frontier, seeds
from conftest import REPO

SEED = 20261129


def test_a_seed_without_a_pairwise_win_rate_leaves_the_spread_out_instead_of_crashing():
    policies = ["sft", "ppo-seed_1", "ppo-seed_2", "ppo-seed_3"]
    variants = {p: {"stage": "ppo", "values": {"seed": int(p[-1])}} for p in policies[1:]}
    (ppo,) = seeds.seed_sweeps(frontier.group_policies(policies, variants, {p: p.split("-")[0] for p in policies}))
    m = {}
    for p, kl, w in zip(policies[1:], (4.0, 5.0, 6.0), (0.3, float("nan"), 0.6)):
        m.update({f"eval/{p}/kl": kl, f"eval/{p}/ep/win_rate": w, f"eval/{p}/ep/win_rate_ci": [w - 0.1, w + 0.1]})
    agg = seeds.aggregate(m, ppo, [], ["ep"])  # statistics.stdev on a NaN raised AttributeError: 'numerator'
    assert agg["eval/ppo/seeds/kl/mean"] == 5.0 and not any("/ep/" in k for k in agg)


def test_the_length_controlled_win_rate_is_nan_where_length_and_policy_cannot_be_told_apart():
    from align.report.stats import length_controlled_win_rate as lc

    assert math.isnan(lc([1] * 19 + [0], [5] * 20))  # a constant gap: was 0.95, the plain win rate
    for ridge in (1e-1, 1e-3, 1e-6):  # all wins, always longer: was 0.548 / 0.591 / 0.662 by the penalty alone
        assert math.isnan(lc([1, 1, 1, 1], [5, 6, 7, 8], ridge=ridge))
    assert lc([1, 1, 0, 0.5], [0, 0, 0, 0]) == pytest.approx(0.625, abs=1e-3)  # no gap at all: the plain rate
    assert 0 < lc([1, 1, 0, 1, 0], [3, -1, 2, 0, -2]) < 1  # length varies, outcomes too: a fit
    # the policy always 40-50 tokens longer, outcomes that do not depend on length: equal length is outside the
    # data, and sigmoid(a) was anything from 0.01 to 0.99 over seeds (the truth 0.70); one pair in 20 on the other
    # side is not enough either (MIN_SIDE: 10%)
    seed = 30
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    wins = (rng.random(256) < 0.7).astype(float).tolist()
    assert math.isnan(lc(wins, rng.uniform(40, 50, 256).tolist()))
    assert math.isnan(lc(wins[:20], [-3.0] + rng.uniform(40, 50, 19).tolist()))
    assert 0 < lc(wins[:20], [-3.0, -5.0] + rng.uniform(40, 50, 18).tolist()) < 1
    # a judge that always picks the longer response and flips a coin at equal length (integer token lengths): the
    # truth at equal length is 0.5, the fit gave 0.22 to 0.97 over seeds (its slope runs off; the penalty set sigmoid(a))
    for n in (32, 128):
        diff = rng.integers(-6, 7, n).astype(float)
        verdicts = np.where(diff > 0, 1.0, np.where(diff < 0, 0.0, (rng.random(n) < 0.5).astype(float)))
        assert math.isnan(lc(verdicts.tolist(), diff.tolist())), n
    mixed = verdicts.copy()
    mixed[np.argmax(diff)] = 0.0  # one loss where the policy was longest: overlap, a fit again
    assert 0 < lc(mixed.tolist(), diff.tolist()) < 1


def _cfg(**kw):
    from align.config.evaluate import EvaluateStage
    from align.config.settings import PairwiseJudge

    base = dict(policies=["sft", "dpo"], reference="sft", baseline="sft", prompts="x.yaml", judges=[], reward=None,
                pairwise=[PairwiseJudge(name="ep", model="m", base_url="http://127.0.0.1:9/v1")])
    return EvaluateStage(**{**base, **kw})


def _metrics():
    m = {"eval/prompts": 2}
    for p in ("sft", "dpo"):
        m.update({f"eval/{p}/kl": 0.5, f"eval/{p}/ref_perplexity": 3.0, f"eval/{p}/response_length": 7.0})
    key = "eval/dpo/ep"
    m.update({f"{key}/win_rate": float("nan"), f"{key}/win_rate_ci": [float("nan"), float("nan")],
              f"{key}/lc_win_rate": float("nan"), f"{key}/tie_rate": 0.0, f"{key}/consistency": float("nan"),
              f"{key}/invalid_rate": 1.0, f"{key}/pairs": 2})
    return m


def test_a_report_without_pointwise_judges_has_whole_tables_and_json_without_nan(tmp_path):
    from align.report.markdown import headline, render_report, write_report

    cfg, m = _cfg(), _metrics()
    samples = {p: {"responses": ["r0", "r1"], "kl": [0.1, float("nan")], "scores": {}} for p in cfg.policies}
    text = render_report(cfg, m, ["p0", "p1"], samples, [])
    for table in (headline(cfg, m).split("\n\n")[0], text.split("## Length and reward")[1].split("\n\n")[1]):
        widths = {line.count("|") for line in table.splitlines() if line.startswith("|")}
        assert len(widths) == 1, table  # header, separator and rows: one cell count
    assert "Reward–KL frontier" not in text and "- sft: 'r0'\n" in text + "\n"
    head = headline(cfg, m)  # a length-controlled rate that could not be fitted: n/a, and why under the table
    assert "| dpo | nan [nan, nan] | n/a |" in head and "length-controlled n/a: the lengths cannot be told" in head
    m["eval/dpo/ep/lc_win_rate"] = 0.61
    assert "| 0.610 |" in headline(cfg, m) and "length-controlled n/a" not in headline(cfg, m)
    m["eval/dpo/ep/lc_win_rate"] = float("nan")
    assert "ep: all of them, each pair judged in both orders" in head
    from align.report.stats import pairwise_summary  # every pair invalid: the rate could be anything

    m["eval/dpo/ep/win_rate_bounds"] = pairwise_summary([{"outcome": "invalid", "verdicts": [None, None]}] * 2,
                                                        [1, 1], [1, 1])["win_rate_bounds"]
    assert "| 1.000 (win rate 0.000-1.000 with them as losses / wins) |" in headline(cfg, m)
    write_report(tmp_path, cfg, m, ["p0", "p1"], samples, [], {}, [])
    def refuse(constant):  # what JSON.parse and every non-Python reader refuse
        pytest.fail(f"bare {constant} written")

    for line in (tmp_path / "samples.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    stored = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=refuse)
    assert stored["eval/dpo/ep/win_rate"] == "nan" and not (tmp_path / "win_rates.png").exists()


def test_a_manifest_with_a_nan_final_metric_is_json_every_reader_takes(tmp_path):
    from align.core.rundir import headline, read_manifest, write_manifest

    write_manifest(tmp_path, {"status": "completed", "final_metrics": {"eval/ppo/ep/win_rate": float("nan"),
                                                                       "eval/ppo/kl": [1.5, float("inf")]}})
    def refuse(constant):
        pytest.fail(f"bare {constant} written")

    stored = json.loads((tmp_path / "manifest.json").read_text(), parse_constant=refuse)
    assert stored["final_metrics"] == {"eval/ppo/ep/win_rate": "nan", "eval/ppo/kl": [1.5, "inf"]}
    assert headline(read_manifest(tmp_path), ("eval/ppo/ep/win_rate",)) == "eval/ppo/ep/win_rate nan"


def test_pairwise_judges_that_would_hide_a_sample_or_judge_nothing_are_refused(monkeypatch):
    from align.config.settings import PairwiseJudge

    ctx = type("Ctx", (), {"pipeline": type("P", (), {"stages": {}})(), "base_dir": None,
                           "check_judge": lambda *a: None})()
    for name in ("response", "kl"):
        with pytest.raises(ValueError, match=rf"pairwise\[0\].name: '{name}' is taken .* a sample's own fields"):
            _cfg(pairwise=[PairwiseJudge(name=name, model="m", base_url="http://127.0.0.1:9/v1")]).check(ctx)
    monkeypatch.setattr(PairwiseJudge, "check", lambda self, where, base: None)  # its endpoint probe: not the rule here
    with pytest.raises(ValueError, match=r"pairwise: each policy is judged against the baseline 'sft', and policies "
                                         r"lists no other"):
        _cfg(policies=["sft"]).check(ctx)


def test_every_stage_that_samples_prompts_drops_empty_ones_and_counts_them(monkeypatch):
    """PPO, GRPO and RLOO read their prompts with unique_prompts(load_rows(...)), which keeps an empty one (evaluate
    and preferences went through load_prompts, which drops it): a prompt of nothing, left-padded, is a row with no
    token to attend to. Every stage that samples now reads its prompts through load_prompts."""
    import ast
    from types import SimpleNamespace

    from align.runtime import rows

    monkeypatch.setattr(rows, "load_rows", lambda ctx, ref, split, tokenizer=None: [
        {"prompt": "Rate this film:"}, {"prompt": ""}, {"prompt": " \u200b\n"}, {"prompt": "Rate this film:"},
        {"prompt": "Go on:"}])
    ctx = SimpleNamespace(name="ppo", extra_manifest={})
    assert rows.load_prompts(ctx, "card.yaml", "train") == ["Rate this film:", "Go on:"]
    assert ctx.extra_manifest["dropped_rows"] == {"card.yaml split 'train': empty prompt": 2}
    for module in ("ppo/__init__.py", "online_rl.py", "evaluate.py", "preferences.py"):
        tree = ast.parse((REPO / "align" / "stages" / module).read_text())
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "load_prompts" in called and "unique_prompts" not in called, module


def test_a_limit_on_prompts_takes_a_seeded_uniform_sample_not_the_files_head(monkeypatch):
    """The default pipeline's held-out movie reviews are stored positive first: `max_prompts: 512` took the first
    512 of 966 (89% positive, against 3% in the rest), and the report described them, not the split. Evaluate and
    preferences now take a seeded random sample, drawn after the drops (an empty prompt no longer costs one), in an
    order whose every prefix is a sample too (a pairwise judge's max_prompts takes one)."""
    from types import SimpleNamespace

    from align.runtime import rows

    seed = 1234
    print("seed", seed)
    data = [{"prompt": f"good review {i}:"} for i in range(300)] + [{"prompt": ""}] * 40 + \
        [{"prompt": f"bad review {i}:"} for i in range(300)]
    monkeypatch.setattr(rows, "load_rows", lambda ctx, ref, split, tokenizer=None: data)
    ctx = SimpleNamespace(name="evaluate", extra_manifest={})
    picked = rows.load_prompts(ctx, "card.yaml", "test", sample=(100, seed))
    assert len(picked) == 100 and len(set(picked)) == 100 and "" not in picked
    good = sum(p.startswith("good") for p in picked)
    assert 35 <= good <= 65, good  # binomial(100, 0.5): outside [35, 65] once in ~600 seeds; the head held 100
    assert 5 <= sum(p.startswith("good") for p in picked[:20]) <= 15  # a prefix is a sample as well
    assert rows.load_prompts(ctx, "card.yaml", "test", sample=(100, seed)) == picked  # the same on a rerun
    assert rows.load_prompts(ctx, "card.yaml", "test", sample=(100, seed + 1)) != picked
    assert rows.load_prompts(ctx, "card.yaml", "test", sample=(None, seed))[:100] == picked  # one order, cut
    assert rows.load_prompts(ctx, "card.yaml", "test")[:3] == ["good review 0:", "good review 1:", "good review 2:"]


def test_evaluate_scores_the_reward_model_on_pairs_within_the_reward_stages_max_length(tmp_path, monkeypatch):
    """Held-out pairs longer than the reward stage's max_length ran past a small model's positions (an IndexError,
    after every policy was sampled) or were scored at lengths it never trained at; they are left out and counted,
    as the reward stage leaves out its own (a probe of the preference stages, 2026-11-30)."""
    import json
    from types import SimpleNamespace

    import align.stages.evaluate as evaluate

    (tmp_path / "reward").mkdir()
    (tmp_path / "reward" / "spec.json").write_text(json.dumps({  # as the runner writes it (align/core/rundir.py)
        "stage_name": "reward", "stage_dir": str(tmp_path / "reward"), "fingerprint": "f", "pipeline": {},
        "stage": {"type": "reward", "max_length": 8}}))
    pairs = [{"prompt": "a", "chosen": " b", "rejected": " c"},
             {"prompt": "a " * 20, "chosen": " b", "rejected": " c"}]  # 20 words of prompt: past 8 tokens
    scored: list = []
    monkeypatch.setattr(evaluate, "load_rows", lambda *a, **k: pairs)
    monkeypatch.setattr(evaluate, "pairwise_accuracy", lambda judge, rows, *a: scored.extend(rows) or {
        "accuracy": 1.0, "ties": 0, "margin": 1.0, "chosen": 1.0, "rejected": 0.0, "margins": [1.0],
        "chosen_scores": [1.0], "rejected_scores": [0.0]})

    class Tok:
        eos_token, eos_token_id = "</s>", 0

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [t.split() for t in texts]}

    ctx = SimpleNamespace(input_dir=lambda name: tmp_path / name, compute=SimpleNamespace(autocast=lambda: nullcontext()),
                          state=SimpleNamespace(process_index=0, num_processes=1))
    cfg = SimpleNamespace(reward="reward", preferences="preferences")
    judges = {"reward_model": SimpleNamespace(reward_models={"reward": SimpleNamespace(tokenizer=Tok())})}
    metrics, _ = evaluate.reward_model_metrics(ctx, cfg, judges, None)  # counted in the reward model's own tokens
    assert scored == pairs[:1]
    assert (metrics["eval/reward_model/pairs"], metrics["eval/reward_model/pairs_over_max_length"]) == (1, 1)


def test_the_report_says_how_many_held_out_pairs_were_longer_than_the_reward_stage_trained_on():
    from align.report.markdown import render_report

    cfg, m = _cfg(), _metrics()
    m.update({"eval/reward_model/accuracy": 0.75, "eval/reward_model/pairs": 40, "eval/reward_model/margin": 0.5,
              "eval/reward_model/chosen_mean": 1.0, "eval/reward_model/chosen_std": 0.1,
              "eval/reward_model/rejected_mean": 0.5, "eval/reward_model/rejected_std": 0.1,
              "eval/reward_model/calibration": [], "eval/reward_model/pairs_over_max_length": 3})
    samples = {p: {"responses": ["r0", "r1"], "kl": [0.1, 0.2], "scores": {}} for p in cfg.policies}
    text = render_report(cfg, m, ["p0", "p1"], samples, [])
    assert ("0.750 on 40 pairs (mean margin 0.500; 3 longer than the reward stage's max_length left out). Scores: "
            "chosen 1.000") in text
    m["eval/reward_model/pairs_over_max_length"] = 0
    assert "40 pairs (mean margin 0.500). Scores:" in render_report(cfg, m, ["p0", "p1"], samples, [])


def test_an_llm_judge_reads_a_conversational_prompt_without_the_policys_chat_template(monkeypatch):
    """Evaluate and preferences gave a pairwise LLM judge the prompt as the policy reads it, chat template and all:
    wrapped in the judge's own template, a judge of the same format (SmolLM2 judging SmolLM2, Llama-3-70B judging
    Llama-3-8B) read the policy's `<|im_start|>` text as its own control tokens (its user turn ended after
    "Prompt:"). load_prompts gives each rendered prompt's plain text too: one user turn's words, or the turns with
    their roles."""
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from align.runtime import rows

    repo = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(repo / "tokenizers" / "gpt2")
    tok.chat_template = (repo / "tests" / "chat_templates" / "llama3_1.jinja").read_text()
    tok.add_special_tokens({"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"})
    one = [{"role": "user", "content": "Is it on?"}]
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    monkeypatch.setattr(rows, "load_rows", lambda ctx, ref, split, tokenizer=None: [
        {"prompt": one}, {"prompt": two}, {"prompt": "Plain text:"}])
    plain: dict[str, str] = {}
    prompts = rows.load_prompts(SimpleNamespace(name="evaluate", extra_manifest={}), "card.yaml", "test", tok,
                                plain)
    assert all("<|start_header_id|>" in p for p in prompts[:2])  # the policy samples from the rendered prompt
    assert [plain[p] for p in prompts] == ["Is it on?", "System: Be brief.\n\nUser: Why?", "Plain text:"]


def test_the_report_says_how_many_responses_were_cut_and_at_what_temperature_its_kl_is():
    """A policy that rambles had its responses cut at generation.max_new_tokens, its length, length difference and
    scores read on unfinished text, and nothing in the report said so; its KL is the sampled distributions' (at the
    sampling temperature), labelled "KL to ref" alone. The headline gives both now."""
    from align.config import Generation
    from align.report.markdown import headline
    from align.stages.evaluate import policy_metrics

    cfg = _cfg(generation=Generation(max_new_tokens=8, temperature=0.7))
    samples = {p: {"kl": [0.1, 0.3, 0.2, 0.4], "length": lengths, "ref_logprob": [-4.0] * 4, "scores": {}}
               for p, lengths in (("sft", [3, 8, 8, 5]), ("dpo", [8, 8, 8, 2]))}
    m = {**_metrics(), **policy_metrics(cfg, samples, seed=0)}
    assert (m["eval/sft/at_max_new_tokens"], m["eval/dpo/at_max_new_tokens"]) == (0.5, 0.75)
    head = headline(cfg, m)
    assert "KL to sft (T=0.7)" in head and "cut at 8 tokens" in head and "| 75.0% |" in head, head


def test_a_reply_holding_a_special_tokens_text_does_not_cost_a_stage_that_samples_its_own_replies_the_prompt(
        monkeypatch):
    """load_prompts rendered whole rows: a prompt was dropped because its card's chosen reply held a special token's
    text, and PPO or evaluate refused a card where more than 1% of replies did, though they sample replies of their
    own. Only the prompts are read now; a prompt that holds such text is still dropped and counted."""
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from align.runtime import rows

    repo = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(repo / "tokenizers" / "gpt2")
    tok.chat_template = (repo / "tests" / "chat_templates" / "llama3_1.jinja").read_text()
    tok.add_special_tokens({"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"})

    def row(i, reply="Fine."):
        return {"prompt": [{"role": "user", "content": f"Question {i}?"}],
                "chosen": [{"role": "assistant", "content": reply}], "rejected": [{"role": "assistant", "content": "No."}]}

    data = [row(i, "Sure <|eot_id|> then more" if i % 10 == 0 else "Fine.") for i in range(50)]  # 10% of replies
    data[7]["prompt"][0]["content"] = "Say <|eot_id|> please"
    monkeypatch.setattr(rows, "load_rows", lambda ctx, ref, split, tokenizer=None: data)
    ctx = SimpleNamespace(name="evaluate", extra_manifest={})
    prompts = rows.load_prompts(ctx, "card.yaml", "test", tok)
    assert len(prompts) == 49 and not any("Say" in p for p in prompts)
    assert ctx.extra_manifest["dropped_rows"] == {"card.yaml split 'test': holds a special token's text": 1}


def test_sfts_evaluation_rows_are_a_seeded_sample_of_the_split_not_the_files_head():
    """SFT's `eval/loss` read the first `eval_max_examples` rows of its eval split: the movie reviews are stored
    positive first, so the default pipeline's 256 were 250 positive reviews (mean rating 1.76) of a split whose mean
    is about 0 (a data review, 2026-12-02). They are a seeded sample now, drawn after the drops, as evaluate's prompts."""
    import ast

    from align.data.cards import load_split
    from align.runtime.rows import seeded_sample

    seed = 4321
    print("seed", seed)
    split = load_split(str(REPO / "data_cards" / "movie_review_snippets.yaml"), "test").rows
    share = sum(float(r["score"]) > 0 for r in split) / len(split)
    assert 0.4 < share < 0.6, share
    assert sum(float(r["score"]) > 0 for r in split[:256]) / 256 > 0.9  # the head, as SFT read it
    picked = seeded_sample(split, 256, seed)
    assert len(picked) == 256 and len({r["id"] for r in picked}) == 256
    assert abs(sum(float(r["score"]) > 0 for r in picked) / 256 - share) < 0.1
    assert seeded_sample(split, 256, seed) == picked and seeded_sample(split, 256, seed + 1) != picked
    assert seeded_sample(split, 10_000, seed) != split and len(seeded_sample(split, 10_000, seed)) == len(split)
    import datetime  # a column JSON cannot hold (a parquet timestamp a card passes through) is no crash
    assert len(seeded_sample([{**r, "at": datetime.datetime(2026, 1, 1)} for r in split[:5]], 3, seed)) == 3
    tree = ast.parse((REPO / "align" / "stages" / "sft.py").read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "seeded_sample" in called


def test_a_policy_with_no_valid_verdict_says_so_not_that_lengths_cannot_be_told(tmp_path):
    """Every pair invalid (max_invalid_fraction: 1.0) made lc_win_rate NaN, and the footnote explained it by the
    lengths; the cell now says there was no valid verdict, and the footnote is for a fit that failed."""
    from align.report.markdown import headline

    cfg, m = _cfg(), _metrics()
    m["eval/dpo/ep/valid"] = 0.0
    head = headline(cfg, m)
    assert "| dpo | nan [nan, nan] | no valid verdicts |" in head and "length-controlled n/a" not in head
    m["eval/dpo/ep/valid"] = 2.0
    assert "length-controlled n/a: the lengths cannot be told" in headline(cfg, m)


def test_a_policy_named_prompt_is_refused_as_it_would_replace_the_prompt_in_samples_jsonl(capsys):
    """report/samples.jsonl rows are {"prompt": ..., <policy>: {...}}: a stage named `prompt` (a plain, legal name)
    replaced every row's prompt with its sample, without a word."""
    from conftest import REPO, refused, validate

    rc, out = validate(capsys, str(REPO / "pipelines" / "default.yaml"), "stages.prompt={type: dpo, policy: sft}",
                       "evaluate.policies=[sft, prompt]")
    refused(out, rc, "stages.evaluate: policies: a stage named 'prompt' would replace the prompt in "
                     "report/samples.jsonl")


def test_the_wandb_headline_table_names_each_interval_by_what_it_bounds(tmp_path):
    """The W&B table's `ci_low` / `ci_high` sat beside `mean` and bounded the win rate: read as the mean's interval.
    Each interval is named now, the mean's is there too, and the KL says its unit."""
    import types

    from align.stages.evaluate import HEADLINE_COLUMNS, track_report

    cfg, m = _cfg(), _metrics()
    m.update({"eval/dpo/vader/mean": 0.4, "eval/dpo/vader/mean_ci": [0.3, 0.5], "eval/dpo/vader/win_rate": 0.6,
              "eval/dpo/vader/win_rate_ci": [0.55, 0.65], "eval/sft/vader/mean": 0.2, "eval/sft/vader/mean_ci": [0.1, 0.3]})
    cfg.judges = ["vader"]
    tables = []
    tracker = types.SimpleNamespace(images=lambda paths, step: None,
                                    table=lambda name, columns, rows, step: tables.append((columns, rows)))
    track_report(types.SimpleNamespace(run_dir=tmp_path, tracker=tracker), cfg, m, 2)
    [(columns, rows)] = tables
    row = dict(zip(columns, next(r for r in rows if r[:2] == ["dpo", "vader"])))
    assert columns == HEADLINE_COLUMNS and row["mean_ci_low"] == 0.3 and row["win_rate_ci_low"] == 0.55
    assert row["kl_nats_per_response"] == 0.5 and row["prompts"] == 2
