"""Evaluate stage: every policy samples the same held-out prompts with the same seed and decoding; each
sample is scored by every judge (gold functions and the reward model); KL to the reference is measured on
the policy's own samples; win rates against the baseline come with 95% Wilson CIs (means and KL with bootstrap CIs).

Writes `<run>/report/metrics.json` and `<run>/report/report.md` atomically.
"""

from __future__ import annotations

import time
from contextlib import closing
from typing import Any

import numpy as np
import torch

from align.report import frontier, seeds

from align.report.markdown import all_judges, headline, write_report
from align.config.evaluate import EvaluateStage, scoring_rows
from align.data.lengths import pairs_within
from align.runtime.rows import (load_prompts, load_rows, prompts_within_positions, prompts_within_reward_models,
                                trained_length)
from align.engines import make_engine
from align.engines.base import (RolloutEngine, all_gather_objects, check_gap, free_cached_memory, logprob_gap,
                                nan_max, release)
from align.modeling.generation import by_length, longest_prompt, sequence_logprobs
from align.modeling.losses import sequence_kl
from align.modeling.packing import unwrapped_model
from align.judges.pointwise import WeightedJudge, pairwise_accuracy, stage_judge
from align.judges import JudgeError
from align.judges.pairwise import build_pairwise, check_invalid
from align.core.rundir import read_manifest
from align.runtime.context import StageContext
from align.report.stats import calibration_buckets, mean_ci, pairwise_summary, perplexity, win_rate

OUTPUTS = ["../report"]


@torch.no_grad()
def scored_logprobs(model, rollout, temperature: float = 1.0) -> torch.Tensor:
    """`response_logprobs` of a whole generation batch, with no graph kept, in slices of rows whose logits stay
    within SCORING_BYTES (align/config/evaluate.py; the memory estimate counts the same bound)."""
    vocab = unwrapped_model(model).get_output_embeddings().weight.size(0)
    rows = scoring_rows(rollout.response_ids.size(1), vocab)
    ids, mask, lq = rollout.input_ids, rollout.attention_mask, rollout.query_ids.size(1)
    with torch.no_grad():
        return torch.cat([sequence_logprobs(model, ids[i:i + rows], mask[i:i + rows], lq, temperature)
                          for i in range(0, ids.size(0), rows)])


def sample_with_kl(engine: RolloutEngine, policy, reference, tokenizer, prompts: list[str], cfg: EvaluateStage,
                   seed: int, on_batch=lambda done: None, judges: dict[str, WeightedJudge] | None = None,
                   rank: int = 0, world: int = 1):
    """Responses (text), sequence-level KL(policy || reference) = sum_t log pi - log ref on them, their lengths,
    the sum of their tokens' log-probs under the reference at temperature 1 (for its perplexity), and each judge's
    scores of them (`WeightedJudge.score_rollout`: align/judges/pointwise.py), in the order of `prompts` (sampled in
    length-sorted batches: every policy gets the same batches and seeds). `engine` samples (synced to `policy`); the
    log-probs are the policy's own, and with an engine that reports its own (vllm) the largest gap between the two
    is returned too (None otherwise).

    Over several processes (`rank` of `world`), each samples every world-th batch of the same length-sorted batches
    with the same seeds as one process would, and the results are gathered: every process returns all of them, the
    same as one process at the same seed with an engine that takes a seed per call (hf); one seeded once (vllm)
    draws from a stream of its own on each process."""
    n = len(prompts)
    texts, kls, lengths, ref_sums = [""] * n, [0.0] * n, [0.0] * n, [0.0] * n
    scores = {name: [0.0] * n for name in judges or {}}
    gen = cfg.generation
    order = by_length(tokenizer, prompts)
    gap, sampling = None, 0.0
    for start in list(range(0, n, gen.batch_size))[rank::world]:
        on_batch(start)
        idx = order[start:start + gen.batch_size]
        t0 = time.perf_counter()
        r = engine.generate([prompts[i] for i in idx], gen, seed=seed + start)
        sampling += time.perf_counter() - t0
        lp = scored_logprobs(policy, r, gen.temperature)
        if r.engine_logprobs is not None:  # several processes: checked once gathered, on all of them alike (below)
            gap = nan_max([gap or 0.0, logprob_gap(r.engine_logprobs, lp, r.response_mask)["max"]])
            if world == 1:
                check_gap(gap, gen.max_logprob_gap, f"evaluation batch {start}", engine.log_path)
        ref_lp = scored_logprobs(reference, r, gen.temperature)
        mask = r.response_mask.float()
        ref_plain = ref_lp if gen.temperature == 1.0 else scored_logprobs(reference, r, 1.0)
        for i, kl, length, text, ref_sum in zip(idx, sequence_kl(lp, ref_lp, mask).tolist(), mask.sum(1).tolist(),
                                                r.texts(tokenizer), (ref_plain * mask).sum(1).tolist()):
            texts[i], kls[i], lengths[i], ref_sums[i] = text, kl, length, ref_sum
        for name, judge in (judges or {}).items():
            for i, s in zip(idx, judge.score_rollout(r, [prompts[i] for i in idx], tokenizer).tolist()):
                scores[name][i] = s
    if world > 1:
        texts, kls, lengths, ref_sums, scores, gap, sampling = _gathered(order, gen.batch_size, rank, world, texts,
                                                                         kls, lengths, ref_sums, scores, gap, sampling)
        if gap is not None:
            check_gap(gap, gen.max_logprob_gap, f"evaluation (every process's batches, {n} prompts)", engine.log_path)
    return texts, kls, lengths, ref_sums, scores, gap, sampling


def _gathered(order: list[int], batch_size: int, rank: int, world: int, *columns):
    """Every process's share of sample_with_kl's results, merged by prompt index (a collective)."""
    texts, kls, lengths, ref_sums, scores, gap, sampling = columns
    mine = [i for start in list(range(0, len(order), batch_size))[rank::world] for i in order[start:start + batch_size]]
    local = {"rows": {i: (texts[i], kls[i], lengths[i], ref_sums[i], {j: s[i] for j, s in scores.items()})
                      for i in mine}, "gap": gap, "sampling": sampling}
    shares = all_gather_objects(local)
    for share in shares:
        for i, (text, kl, length, ref_sum, judged) in share["rows"].items():
            texts[i], kls[i], lengths[i], ref_sums[i] = text, kl, length, ref_sum
            for j, s in judged.items():
                scores[j][i] = s
    gaps = [s["gap"] for s in shares if s["gap"] is not None]
    return (texts, kls, lengths, ref_sums, scores, (nan_max(gaps) if gaps else None),
            max(s["sampling"] for s in shares))  # the processes sample side by side: the slowest's time


def sample_policies(ctx: StageContext, cfg: EvaluateStage, engine: RolloutEngine, reference, tokenizer,
                    prompts: list[str], judges: dict[str, WeightedJudge]):
    """Each policy's samples (sample_with_kl) through `engine`, synced to the policy first; the seconds the engine
    took to sample (loading, syncing, the log-prob passes and scoring not in it: what the throughput is over), the
    response tokens generated, and each policy's largest engine-vs-policy log-prob gap (vllm only)."""
    sampling, generated = 0.0, 0
    samples: dict[str, dict[str, Any]] = {}
    gaps: dict[str, float] = {}
    total = len(cfg.policies) * len(prompts)
    for i, name in enumerate(cfg.policies):
        if ctx.is_main:
            print(f"[align] {ctx.name}: sampling {len(prompts)} prompts from '{name}'", flush=True)
        policy = ctx.load_lm(ctx.input_model(name), device=True, frozen=True).eval()
        engine.sync_weights(policy)
        if i == 0:
            ctx.note_engine(engine, synced=True)  # again: now it says how the weights travelled
        with ctx.compute.autocast():
            texts, kls, lengths, ref_sums, scores, gap, seconds = sample_with_kl(
                engine, policy, reference, tokenizer, prompts, cfg, ctx.seed,
                lambda done: ctx.progress(i * len(prompts) + done, total, policy=name),  # noqa: B023 (called now)
                judges=judges,
                rank=ctx.state.process_index, world=ctx.state.num_processes)
            ctx.progress((i + 1) * len(prompts), total, policy=name)
        generated, sampling = generated + int(sum(lengths)), sampling + seconds
        del policy
        release(engine)  # an engine that maps the policy's weights lets them go before the next policy loads
        if not engine.holds_own_weights:  # the hf engine samples from the policy itself: let it go before the next
            engine.sync_weights(None)  # loads (two 8B policies on one GPU otherwise), the reference cycle a compiled
            free_cached_memory()  # generate() leaves (fast generation: model._compiled_call) collected with it
        samples[name] = {"responses": texts, "kl": kls, "length": lengths, "ref_logprob": ref_sums, "scores": scores}
        if gap is not None:
            gaps[name] = gap
    return samples, sampling, generated, gaps


def check_scores(samples: dict[str, dict[str, Any]]) -> None:
    """Every judge's score of every sample is a finite number, checked once sampling is done, before any pairwise
    judging is paid for (a win rate would count a NaN a loss, an agreement a baseline's win, a mean would be NaN)."""
    for name, s in samples.items():
        for j, sc in s["scores"].items():
            bad = next((i for i, v in enumerate(sc) if not np.isfinite(v)), None)
            if bad is not None:
                raise JudgeError(f"judge '{j}' scored policy '{name}' {sc[bad]} on held-out prompt {bad} (and "
                                 f"{sum(not np.isfinite(v) for v in sc) - 1} more): every score must be a finite "
                                 "number; a reward model that scores so has non-finite weights or overflowed (score "
                                 "it in float32)")


def policy_metrics(cfg: EvaluateStage, samples: dict[str, dict[str, Any]], seed: int) -> dict[str, Any]:
    """Per policy: KL to the reference (mean, spread, bootstrap CI), response length, perplexity under the reference,
    and per judge the mean score (CI), its correlation with length and the win rate against the baseline (CI)."""
    metrics: dict[str, Any] = {}
    for name, s in samples.items():
        metrics[f"eval/{name}/kl"] = float(np.mean(s["kl"]))
        metrics[f"eval/{name}/kl_std"] = float(np.std(s["kl"]))
        kl = mean_ci(s["kl"], cfg.bootstrap_samples, seed)
        metrics[f"eval/{name}/kl_ci"] = [kl["ci_low"], kl["ci_high"]]
        metrics[f"eval/{name}/response_length"] = float(np.mean(s["length"]))
        # responses that reached generation.max_new_tokens (cut, unless EOS came exactly there): their lengths, length
        # differences and scores are of unfinished text
        metrics[f"eval/{name}/at_max_new_tokens"] = float(np.mean(np.asarray(s["length"]) >= cfg.generation.max_new_tokens))
        # fluency: a policy that buys reward with text its reference finds unlikely shows it here, beside its KL
        metrics[f"eval/{name}/ref_perplexity"] = perplexity(s["ref_logprob"], s["length"])
        for j, sc in s["scores"].items():
            m = mean_ci(sc, cfg.bootstrap_samples, seed)
            metrics[f"eval/{name}/{j}/mean"] = m["mean"]
            metrics[f"eval/{name}/{j}/mean_ci"] = [m["ci_low"], m["ci_high"]]
            if np.std(sc) > 0 and np.std(s["length"]) > 0:
                metrics[f"eval/{name}/{j}/length_corr"] = float(np.corrcoef(sc, s["length"])[0, 1])
            if name != cfg.baseline:
                w = win_rate(sc, samples[cfg.baseline]["scores"][j])
                metrics[f"eval/{name}/{j}/win_rate"] = w["win_rate"]
                metrics[f"eval/{name}/{j}/win_rate_ci"] = [w["ci_low"], w["ci_high"]]
    return metrics


def reward_model_metrics(ctx: StageContext, cfg: EvaluateStage, judges: dict[str, WeightedJudge],
                         tokenizer) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """The reward model on the preference stage's held-out pairs: accuracy, margin, score spreads and calibration
    buckets (none without a reward model and preference pairs). Over several processes each scores a share of the
    pairs (a collective: every process calls this)."""
    if not (cfg.reward and cfg.preferences):
        return {}, []
    pairs = load_rows(ctx, cfg.preferences, "test", tokenizer=tokenizer)
    judge = judges["reward_model"].reward_models[cfg.reward]
    trained = trained_length(ctx, cfg.reward)  # scored as the reward stage scored its own: within its max_length,
    within = pairs if trained is None else pairs_within(pairs, judge.tokenizer, trained)  # in its own tokens
    longer, pairs = len(pairs) - len(within), within
    if not pairs:
        return {}, []
    with ctx.compute.autocast():
        acc = pairwise_accuracy(judge, pairs, ctx.state.process_index, ctx.state.num_processes)
    buckets = calibration_buckets(acc["margins"])
    return {"eval/reward_model/accuracy": acc["accuracy"], "eval/reward_model/ties": acc["ties"],
            "eval/reward_model/margin": acc["margin"],
            "eval/reward_model/pairs": len(pairs), "eval/reward_model/pairs_over_max_length": longer,
            "eval/reward_model/calibration": buckets,
            "eval/reward_model/chosen_mean": acc["chosen"], "eval/reward_model/rejected_mean": acc["rejected"],
            "eval/reward_model/chosen_std": float(np.std(acc["chosen_scores"])),
            "eval/reward_model/rejected_std": float(np.std(acc["rejected_scores"]))}, buckets


def policy_groups(ctx: StageContext, cfg: EvaluateStage, metrics: dict[str, Any]) -> list:
    """The policies grouped by recipe (align/report/frontier.py); a seed sweep's group gets its mean and spread over
    seeds (align/report/seeds.py), added to `metrics`."""
    types = {p: (read_manifest(ctx.input_dir(p)) or {}).get("type", "?") for p in cfg.policies}
    groups = frontier.group_policies(cfg.policies, ctx.pipeline.variants, types)
    metrics["eval/groups"] = {g.name: {"type": g.type, "policies": g.policies} for g in groups}
    for g in seeds.seed_sweeps(groups):
        metrics.update(seeds.aggregate(metrics, g, all_judges(cfg), [j.name for j in cfg.pairwise], cfg.reference,
                                       cfg.baseline))
    return groups


def track_report(ctx: StageContext, cfg: EvaluateStage, metrics: dict[str, Any], n_prompts: int) -> None:
    """The report's plots and headline table to the tracker (W&B)."""
    report = ctx.run_dir / "report"
    ctx.tracker.images({f"report/{p.stem}": p for p in sorted(report.glob("*.png"))}, step=0)
    ctx.tracker.table("report/headline", HEADLINE_COLUMNS,
                      [[p, j, metrics[f"eval/{p}/{j}/mean"], *(metrics.get(f"eval/{p}/{j}/mean_ci") or [None, None]),
                        metrics[f"eval/{p}/kl"], metrics.get(f"eval/{p}/{j}/win_rate"),
                        *(metrics.get(f"eval/{p}/{j}/win_rate_ci") or [None, None]), n_prompts]
                       for p in cfg.policies for j in all_judges(cfg)], step=0)


HEADLINE_COLUMNS = ["policy", "judge", "mean", "mean_ci_low", "mean_ci_high", "kl_nats_per_response", "win_rate",
                    "win_rate_ci_low", "win_rate_ci_high", "prompts"]
"""The W&B headline table's columns: each interval named by what it bounds (`ci_low` read as the mean's, and was
the win rate's), the KL's unit (at the sampling temperature, as the report's)."""


def run(ctx: StageContext) -> dict[str, Any]:
    """Evaluate: sample every policy on the held-out prompts, score (judges, KL, perplexity, pairwise), report."""
    cfg: EvaluateStage = ctx.cfg  # type: ignore[assignment]
    ref_path = ctx.input_model(cfg.reference)
    tokenizer = ctx.load_tokenizer(ref_path)
    plain: dict[str, str] = {}  # each prompt without the chat template: what an LLM judge reads
    prompts = load_prompts(ctx, cfg.prompts, cfg.split, tokenizer, plain, (cfg.max_prompts, ctx.seed))  # conversations: rendered
    sampled = len(prompts)
    prompts = prompts_within_positions(ctx, prompts, tokenizer, ref_path, cfg.generation.max_new_tokens)
    judges: dict[str, WeightedJudge] = {name: stage_judge(ctx, name) for name in cfg.judges}
    if cfg.reward:
        judges["reward_model"] = stage_judge(ctx, cfg.reward)
        prompts = prompts_within_reward_models(ctx, prompts, judges["reward_model"], cfg.generation.max_new_tokens)
    reference = ctx.load_lm(ref_path, device=True, frozen=True).eval()
    max_model_len = longest_prompt(tokenizer, prompts) + cfg.generation.max_new_tokens + 1
    rank = ctx.state.process_index  # an engine seeded once (vllm) gets a stream of its own on each process
    engine = make_engine(cfg.generation, model=reference, tokenizer=tokenizer, model_dir=ref_path,
                         fast=ctx.compute.fast_generation(cfg.generation.fast), seed=ctx.seed + 1_000_003 * rank,
                         dtype=ctx.compute.engine_dtype(), max_model_len=max_model_len,
                         log_path=ctx.dir / f"engine.rank{rank}.log", rank=rank, device=ctx.compute.device)
    t0 = time.perf_counter()
    with closing(engine):
        ctx.note_engine(engine)
        samples, seconds, generated, gaps = sample_policies(ctx, cfg, engine, reference, tokenizer, prompts, judges)
    wall = time.perf_counter() - t0
    engine_name = engine.name
    del engine, reference  # freed (the hf engine samples with the reference) before a local pairwise judge loads
    free_cached_memory()
    check_scores(samples)
    judged: dict[str, Any] = {}
    verdicts = judge_pairwise(ctx, cfg, [plain.get(p, p) for p in prompts], samples, judged)  # a share each
    rm_metrics, buckets = reward_model_metrics(ctx, cfg, judges, tokenizer)  # and scores a share of the held-out pairs
    if not ctx.is_main:  # the other processes sampled, judged and scored their shares; the main process reports
        ctx.publish("../report", lambda out: None)
        return {"eval/prompts": len(prompts)}
    metrics: dict[str, Any] = {"eval/prompts": len(prompts), "eval/prompts_too_long": sampled - len(prompts),
                               "perf/generated_tokens": generated,
                               "perf/generation_seconds": seconds, "perf/sampling_seconds": wall,
                               "perf/tokens_per_s": generated / seconds if seconds else None,
                               "eval/engine": engine_name}
    metrics.update({f"eval/{name}/logprob_gap_max": gap for name, gap in gaps.items()})
    metrics.update(policy_metrics(cfg, samples, ctx.seed))
    metrics.update(judged)
    metrics.update(rm_metrics)
    groups = policy_groups(ctx, cfg, metrics)
    ctx.publish("../report", lambda out: write_report(out, cfg, metrics, prompts, samples, groups, verdicts, buckets))
    ctx.extra_manifest["summary"] = headline(cfg, metrics, groups)  # what `align run` prints at the end of the run
    ctx.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=0)
    if ctx.tracker is not None:
        track_report(ctx, cfg, metrics, len(prompts))
    print(headline(cfg, metrics, groups), flush=True)
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def judge_pairwise(ctx: StageContext, cfg: EvaluateStage, prompts: list[str], samples: dict[str, dict[str, Any]],
                   metrics: dict[str, Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each pairwise judge on each policy against the baseline (align/judges/pairwise.py): its summary in `metrics`
    (eval/<policy>/<judge>/win_rate, _ci, lc_win_rate, tie_rate, consistency, invalid_rate, lengths, agreement with
    each gold judge); the verdicts per judge and policy are returned for samples.jsonl. A judge whose invalid answers
    exceed its max_invalid_fraction fails the stage, with examples in the log. Over several processes each judges
    every world-th prompt (its own answer cache, align/judges/pairwise.py JudgeCache) and the verdicts are gathered
    back in prompt order on every process."""
    from accelerate.utils import gather_object  # heavy: stage processes only

    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    base = samples[cfg.baseline]
    rank, world = ctx.state.process_index, ctx.state.num_processes
    for settings in cfg.pairwise:
        judge = build_pairwise(ctx, settings)
        n = min(len(prompts), settings.max_prompts or len(prompts))
        out[settings.name] = {}
        for name in cfg.policies:
            if name == cfg.baseline:
                continue
            if ctx.is_main:
                print(f"[align] {ctx.name}: judging {name} against {cfg.baseline} on {n} prompts with "
                      f"{settings.name} ({judge.backend.name}, both orders)", flush=True)
            mine, share = samples[name], list(range(n))[rank::world]
            results = judge.compare([prompts[i] for i in share], [mine["responses"][i] for i in share],
                                    [base["responses"][i] for i in share])
            if world > 1:
                parts = gather_object([list(zip(share, results))])
                results = [r for _, r in sorted((pair for part in parts for pair in part), key=lambda p: p[0])]
            gold = {j: (mine["scores"][j][:n], base["scores"][j][:n]) for j in cfg.judges}
            summary = pairwise_summary(results, mine["length"][:n], base["length"][:n], gold)
            metrics.update({f"eval/{name}/{settings.name}/{k}": v for k, v in summary.items()})
            out[settings.name][name] = results
            check_invalid(results, settings, ctx.name, f"pairs of {name} vs {cfg.baseline}", show=ctx.is_main)
        asked = [judge.backend.requests]
        metrics[f"eval/{settings.name}/requests"] = sum(gather_object(asked) if world > 1 else asked)
        del judge
    return out
