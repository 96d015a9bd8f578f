"""Preferences stage: sample several completions per prompt from a policy, judge them, keep ordered pairs.

For each prompt: `samples_per_prompt` completions are sampled; the best and the worst by the judge form a (chosen,
rejected) pair, of the samples that ended (`drop_unfinished`: TRL appends EOS to a text reply, so a sample cut at
max_new_tokens would be trained as one that ends there). Pairs whose scores differ by less than `min_margin`, or
whose texts are identical, are ties: dropped and counted. Pairs are split by prompt into `train` and `test`
(held-out prompts) and written atomically to `data/{train,test}.jsonl`, with every scored sample in
`data/samples.jsonl`, and every pair of a training prompt's samples that is not a tie in
`data/train_all_pairs.jsonl` (up to k(k-1)/2 per prompt from k samples: more comparisons for a reward model at no
extra sampling; a reward stage reads them with `split: train_all_pairs`). InstructGPT also trains on all of a
prompt's comparisons (Ouyang et al. 2022 sec. 3.5), but as one batch element per prompt, all its pairs together:
shuffled as separate rows, a prompt's correlated comparisons made the reward model overfit within a single epoch.
Here each pair is its own row, shuffled like any other (TRL's reward trainer reads pairs), and a prompt weighs by its
count of pairs that are not ties: the setup InstructGPT found to overfit, which one epoch does not avoid; `train`
(one pair per prompt) is the safer default.

Each process appends every batch it has sampled and scored to its file in checkpoints/ (synced): a killed attempt's
rerun of the same fingerprint samples only the batches it had not done. With a pairwise judge the samples are judged
after all of them are drawn; they are kept first, per process, in
`sampled/` (keyed by what drew them: the policy's publication, the prompts, the generation settings, the seed and the
code), so a judging that fails (a deadline, a rate limit, invalid verdicts) costs no sampling on the rerun, even with
another judge or judge settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
import zlib
from contextlib import closing
from pathlib import Path
from typing import Any, Callable


from align.config.preferences import PreferencesStage
from align.data.cards import held_out_prompts
from align.runtime.rows import load_prompts, prompts_within_positions, prompts_within_reward_models
from align.engines import holds_own_copy, make_engine
from align.engines.base import free_cached_memory
from align.modeling.generation import by_length, longest_prompt, sample_texts
from align.judges.pointwise import stage_judge
from align.core.fsutil import atomic_write_text
from align.runtime.context import StageContext, StageError

OUTPUTS = ["data"]
SAMPLED = "sampled"
"""The stage directory's folder of samples drawn for a pairwise judge, kept until they are judged (`sampled_records`)."""


def _tie(responses: list[str], scores: list[float], hi: int, lo: int, min_margin: float) -> bool:
    """Samples `hi` and `lo` make no comparison: scores closer than min_margin, equal scores whatever min_margin (at
    `min_margin: 0` an exact tie was a pair, its chosen side picked by sample order alone), a NaN, or the same text."""
    margin = scores[hi] - scores[lo]
    return not (margin > 0 and margin >= min_margin) or responses[hi] == responses[lo]


def pair_up(prompt: str, responses: list[str], scores: list[float], min_margin: float) -> dict[str, Any] | None:
    """(chosen, rejected) = (best, worst) by score; None for a tie (margin < min_margin or same text, or fewer than
    two samples)."""
    if len(scores) < 2:
        return None
    best = max(range(len(scores)), key=scores.__getitem__)
    worst = min(range(len(scores)), key=scores.__getitem__)
    if _tie(responses, scores, best, worst, min_margin):
        return None
    return {"prompt": prompt, "chosen": responses[best], "rejected": responses[worst],
            "score_chosen": scores[best], "score_rejected": scores[worst]}


def all_pairs(prompt: str, responses: list[str], scores: list[float], min_margin: float) -> list[dict[str, Any]]:
    """Every (chosen, rejected) pair of one prompt's distinct samples, the higher-scored chosen, in sample order;
    pairs whose scores differ by less than min_margin, or whose texts are identical, are ties and left out. A text
    sampled twice counts once, as first sampled (from [A, A, B] the pair of A and B was written twice, weighing it
    double; a judge scoring the copies apart could write it both ways round)."""
    first = [i for i, text in enumerate(responses) if text not in responses[:i]]
    responses, scores = [responses[i] for i in first], [scores[i] for i in first]
    out = []
    for i in range(len(scores)):
        for j in range(i + 1, len(scores)):
            hi, lo = (i, j) if scores[i] >= scores[j] else (j, i)
            if _tie(responses, scores, hi, lo, min_margin):
                continue
            out.append({"prompt": prompt, "chosen": responses[hi], "rejected": responses[lo],
                        "score_chosen": scores[hi], "score_rejected": scores[lo]})
    return out


def judge_pairwise(ctx: StageContext, cfg: PreferencesStage, records: list[dict[str, Any]],
                   plain: dict[str, str] | None = None) -> None:
    """RLAIF: the two responses of each prompt (samples_per_prompt is 2) judged by the pairwise LLM judge in both
    orders (align/judges/pairwise.py), when both ended (or drop_unfinished is off; else the outcome is `unfinished`,
    with no scores, and nothing is asked); the first one scores 1 and the second 0 when the judge prefers the first in
    both orders, the reverse when it prefers the second, 0.5 each for a tie or a verdict that flips. Each record
    keeps the answers and the outcome; invalid ones are counted once every process's records are gathered (run).
    The judge reads each prompt as `plain` gives it (without the policy's chat template), else as rendered."""
    from align.judges.pairwise import build_pairwise

    judge = build_pairwise(ctx, cfg.pairwise)
    judged = [r for r in records if len(usable(cfg, r)) >= 2]  # a cut sample is not judged (drop_unfinished)
    results = judge.compare([(plain or {}).get(r["prompt"], r["prompt"]) for r in judged],
                            [r["responses"][0] for r in judged],
                            [r["responses"][1] for r in judged])
    value = {"win": [1.0, 0.0], "loss": [0.0, 1.0], "tie": [0.5, 0.5], "invalid": [0.5, 0.5]}
    for r in records:
        r["responses"], r["scores"], r["ended"] = r["responses"][:2], [], r["ended"][:2]
        r["outcome"], r["verdicts"] = "unfinished", []
    for r, res in zip(judged, results):
        r["scores"], r["verdicts"], r["outcome"] = value[res["outcome"]], res["answers"], res["outcome"]


def sampling_seed(ctx: StageContext) -> int:
    """The seed the stage's sampling starts from: its seed and its name. Iterated DPO's rounds (pairs1, pairs2, ... on
    one pipeline seed) drew every round's samples with round 1's random numbers, so where DPO moved a token's
    distribution little the same token came out again; the held-out prompts stay the seed's alone (the same ones
    every round)."""
    return (ctx.seed * 1_000_003 + zlib.crc32(ctx.name.encode())) % 2 ** 31  # vLLM and numpy take 32-bit seeds: room
    # for the rank and a batch's first prompt index added to it


def _sampled_paths(ctx: StageContext, cfg: PreferencesStage, prompts: list[str]) -> list[Path]:
    """Where each process of the stage keeps its samples before a pairwise judge sees them: named by what drew them
    (not by the judge, so another judge or judge setting reuses them): the policy's publication (its tokenizer
    too), the rendered prompts, the generation settings, the seed, how the engine computes (dtype, precision,
    attention, fast generation, device) and the code (align's, torch's, transformers')."""
    import torch  # heavy: stage processes only
    import transformers

    gen, p = cfg.generation, ctx.pipeline
    drew = [ctx.spec.input_digests.get(cfg.policy), prompts, dataclasses.asdict(gen), cfg.samples_per_prompt,
            sampling_seed(ctx), p.dtype, p.precision, p.attn_implementation, ctx.compute.engine_dtype(),
            ctx.compute.fast_generation(gen.fast), ctx.compute.device.type, ctx.spec.code_version,
            torch.__version__, transformers.__version__]
    key = hashlib.sha256(json.dumps(drew, sort_keys=True, default=str).encode()).hexdigest()[:16]  # once: every prompt
    world = ctx.state.num_processes
    return [ctx.dir / SAMPLED / f"{key}.rank{rank}of{world}.json" for rank in range(world)]


def sampled_records(ctx: StageContext, cfg: PreferencesStage, tokenizer, prompts: list[str], path: str,
                    plain: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """`sample_records`, or, with a pairwise judge, every process's samples an earlier attempt kept (its judging
    failed) judged again without sampling; the main process decides for all of them (one view of the folder)."""
    if cfg.pairwise is None:
        return sample_records(ctx, cfg, tokenizer, prompts, path)
    rank, world = ctx.state.process_index, ctx.state.num_processes
    paths = _sampled_paths(ctx, cfg, prompts)
    mine = paths[rank]
    if ctx.main_decides(lambda: all(p.is_file() for p in paths)):
        saved = json.loads(mine.read_text(encoding="utf-8"))
        ctx.note(samples_drawn_by_an_earlier_attempt=str(mine.parent))
        if ctx.is_main:
            print(f"[align] {ctx.name}: judging the samples an earlier attempt drew ({mine.parent}): no sampling",
                  flush=True)
        t0 = time.perf_counter()
        judge_pairwise(ctx, cfg, saved["records"], plain)
        return saved["records"], saved["counts"], t0

    def keep(records: list[dict[str, Any]], counts: dict[str, float]) -> None:
        mine.parent.mkdir(parents=True, exist_ok=True)
        for old in mine.parent.glob(f"*.rank{rank}of{world}.json"):  # drawn by another policy, prompts or settings
            old.unlink(missing_ok=True)
        atomic_write_text(mine, json.dumps({"records": records, "counts": counts}))

    return sample_records(ctx, cfg, tokenizer, prompts, path, keep=keep, plain=plain)


def sample_records(ctx: StageContext, cfg: PreferencesStage, tokenizer, prompts: list[str], path: str,
                   keep: Callable[[list[dict[str, Any]], dict[str, float]], None] | None = None,
                   plain: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """`samples_per_prompt` responses to every prompt (this process's share) with their judge's scores (pairwise
    judges give theirs after sampling); returns this process's records, its counts (the tokens it generated and the
    seconds its engine took: sample_texts) and when sampling began (perf_counter: model loading and the engine's
    start-up are not in it). `keep` is given this process's records and counts before a pairwise judge sees them;
    `plain`: each prompt without the chat template, as the pairwise judge reads it."""
    gen = cfg.generation
    # an engine with its own copy of the policy (vllm) starts from `path`: the stage then loads none
    policy = None if holds_own_copy(gen.engine) else ctx.load_lm(path, device=True, frozen=True).eval()
    judge = stage_judge(ctx, cfg.judge) if cfg.pairwise is None else None
    prompts = prompts_within_reward_models(ctx, prompts, judge, gen.max_new_tokens)
    n = cfg.samples_per_prompt
    per_batch = max(1, gen.batch_size // n)
    rank = ctx.state.process_index
    engine = make_engine(gen, model=policy, tokenizer=tokenizer, model_dir=path,
                         fast=ctx.compute.fast_generation(gen.fast), seed=sampling_seed(ctx) + rank,
                         dtype=ctx.compute.engine_dtype(),
                         max_model_len=longest_prompt(tokenizer, prompts) + gen.max_new_tokens + 1,
                         log_path=ctx.dir / f"engine.rank{rank}.log", device=ctx.compute.device)
    # Prompts of similar length share a batch (less padding); each process takes every world-th batch (long and
    # short alike: contiguous shares gave the longest prompts to one process, the others waiting for it at the
    # gather); pairs are put back in prompt order by the caller.
    ordered = [(i, prompts[i]) for i in by_length(tokenizer, prompts)]
    mine = [ordered[s:s + per_batch] for s in range(0, len(ordered), per_batch)][rank::ctx.state.num_processes]
    journal = ctx.checkpoints / f"samples.rank{rank}of{ctx.state.num_processes}.jsonl"
    done = journaled(journal, mine)  # the perf counts are this attempt's: its batches alone
    records, counts, t0 = [], {"generated_tokens": 0, "resumed_batches": len(done)}, time.perf_counter()
    if done and ctx.is_main:
        print(f"[align] {ctx.name}: {len(done)} of {len(mine)} batches were sampled by an interrupted attempt "
              f"({journal.parent}): sampling the rest", flush=True)
    with closing(engine):
        ctx.note_engine(engine)
        for k, batch in enumerate(mine):
            ctx.progress(k, len(mine))
            if k in done:
                records.extend(done[k])
                continue
            flat, ended = [p for _, p in batch for _ in range(n)], []
            with ctx.compute.autocast():
                texts, scores = sample_texts(engine, tokenizer, flat, cfg.generation,
                                             seed=sampling_seed(ctx) + batch[0][0], counts=counts,
                                             score=None if judge is None else
                                             lambda r, ps: judge.score_rollout(r, ps, tokenizer), ended=ended)
            drawn = [{"index": idx, "prompt": prompt, "responses": texts[j * n:(j + 1) * n],
                      "scores": scores[j * n:(j + 1) * n], "ended": ended[j * n:(j + 1) * n]}
                     for j, (idx, prompt) in enumerate(batch)]
            append_synced(journal, {"batch": k, "records": drawn})
            records.extend(drawn)
        ctx.progress(len(mine), len(mine))
    if cfg.pairwise is not None:  # the policy freed (closing(engine) held it until here) before a local judge loads
        del policy, engine
        free_cached_memory()
        if keep is not None:  # before the judge: a judging that fails costs no sampling on the rerun
            keep(records, counts)
        judge_pairwise(ctx, cfg, records, plain)
    return records, counts, t0


def journaled(path: Path, batches: list[list[tuple[int, str]]]) -> dict[int, list[dict[str, Any]]]:
    """The batches an interrupted attempt of this stage (same fingerprint: checkpoints/ is stamped with it) sampled
    and scored on this process, by their place in `batches`: each line of `path` one batch, written as it was done
    (a torn last line, or a batch whose prompts are not that place's, is sampled again)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    done = {}
    for line in lines:
        try:
            entry = json.loads(line)
            k, drawn = entry["batch"], entry["records"]
            if [(r["index"], r["prompt"]) for r in drawn] == [tuple(b) for b in batches[k]]:
                done[k] = drawn
        except (ValueError, KeyError, TypeError, IndexError):
            continue
    return done


def append_synced(path: Path, entry: dict[str, Any]) -> None:
    """One line appended and synced: an attempt killed after it keeps the batch."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def usable(cfg: PreferencesStage, record: dict[str, Any]) -> list[int]:
    """The samples of a prompt that may go into a pair: those that ended (EOS sampled), or all of them with
    drop_unfinished: false."""
    return [i for i, done in enumerate(record["ended"]) if done or not cfg.drop_unfinished]


def split_pairs(ctx: StageContext, cfg: PreferencesStage, records: list[dict[str, Any]]):
    """Best-vs-worst pairs per prompt of its usable samples (ties dropped; a prompt with fewer than two usable
    samples makes none), a seeded held-out share of the prompts for `test`, and every non-tied pair of the
    training prompts' samples (`train_all_pairs`). Returns (splits, pairs, ties, unfinished prompts)."""
    pairs, ties, cut, other = [], 0, 0, {"invalid": 0, "unscored": 0}
    margin = 0.5 if cfg.pairwise is not None else cfg.min_margin  # pairwise: 1 vs 0 decides, 0.5 vs 0.5 ties
    kept = {id(r): usable(cfg, r) for r in records}
    for r in records:
        if len(kept[id(r)]) < 2:
            cut += 1
            continue
        pair = pair_up(r["prompt"], *_picked(r, kept[id(r)]), margin)
        scored = sum(r["scores"][i] is not None for i in kept[id(r)]) if r["scores"] else 0
        if pair is not None:
            pairs.append(pair)
        elif r.get("outcome") == "invalid" or scored < 2:  # no verdict, or no two finite scores: not a tie
            other["invalid" if r.get("outcome") == "invalid" else "unscored"] += 1
        else:
            ties += 1
    if not pairs:
        unfinished = (f"; {cut} had fewer than two samples that ended within generation.max_new_tokens "
                      f"({cfg.generation.max_new_tokens}): raise it, or set drop_unfinished: false" if cut else "")
        if other["invalid"]:
            unfinished += f"; {other['invalid']} had no valid verdict from the pairwise judge (see its answers)"
        if bad := sum(s is None for r in records for s in r["scores"]):
            unfinished += (f"; the judge gave {bad} samples no finite score (NaN or inf), leaving {other['unscored']} "
                           "prompts without two to compare: check the judge")
        raise StageError(f"stage '{ctx.name}': none of {len(records)} prompts made a pair: {ties} were ties " + (
            "(the pairwise judge preferred neither response in both orders; see its answers in samples.jsonl)"
            if cfg.pairwise is not None else f"(min_margin {cfg.min_margin}: sample more per prompt or lower "
            "min_margin)") + unfinished)
    # by the stage's seed (the pipeline's unless set), over every prompt sampled, whether it paired or not: iterated
    # DPO's rounds hold out the same prompts (drawn from those that paired, a tie moved the one-prompt floor of a
    # small set onto a prompt an earlier round trained on)
    test_prompts = held_out_prompts([r["prompt"] for r in records], cfg.test_fraction, ctx.seed)
    splits = {"train": [p for p in pairs if p["prompt"] not in test_prompts],
              "test": [p for p in pairs if p["prompt"] in test_prompts],
              "train_all_pairs": [p for r in records if r["prompt"] not in test_prompts
                                  for p in all_pairs(r["prompt"], *_picked(r, kept[id(r)]), margin)]}
    if not splits["test"] and getattr(ctx, "is_main", True):  # said, not refused: the sampling stands (a reward
        print(f"[align] {ctx.name}: warning: no held-out pair: the {len(test_prompts)} held-out prompts (test_fraction "
              f"{cfg.test_fraction}) made none (ties, unfinished or unscored samples); a reward stage reading this "
              "data refuses it, DPO and KTO report no eval/ metrics. Raise test_fraction or max_prompts", flush=True)
    if not splits["train"]:  # every pair's prompt held out (ties took the rest): nothing for a stage to train on
        raise StageError(f"stage '{ctx.name}': no training pairs: {len(splits['test'])} pairs are held out "
                         f"(test_fraction {cfg.test_fraction} of {len(records)} prompts), {ties} prompts tied and {cut} "
                         "had fewer than two finished samples; lower test_fraction or raise max_prompts")
    return splits, pairs, ties, cut


def _picked(record: dict[str, Any], idx: list[int]) -> tuple[list[str], list[float]]:
    """The samples `idx` of a record that may be compared: with a score (`finite_or_none` left a judge's NaN or inf
    as None: no comparison, whatever its position among the samples), each text once, in the order first sampled,
    at the mean of its copies' scores (the best and the worst of one text were a tie where a distinct sample lay
    between them; the first copy's score alone would let sample order pick the side)."""
    scores: dict[str, list[float]] = {}
    for i in idx if record["scores"] else []:  # (a pairwise judge's unfinished prompt has no scores)
        if record["scores"][i] is not None:
            scores.setdefault(record["responses"][i], []).append(record["scores"][i])
    return list(scores), [sum(v) / len(v) for v in scores.values()]


def finite_or_none(records: list[dict[str, Any]]) -> int:
    """A judge's scores that are not finite (a reward model's NaN, an fp16 overflow's inf) made None in place (they
    pair with nothing, and samples.jsonl stays strict JSON); returns how many there were."""
    bad = 0
    for r in records:
        for i, score in enumerate(r["scores"]):
            if score is not None and not math.isfinite(score):
                r["scores"][i], bad = None, bad + 1
    return bad


def run(ctx: StageContext) -> dict[str, Any]:
    """Sample several responses per prompt from the policy, judge them, keep (chosen, rejected) pairs."""
    from accelerate.utils import gather_object  # heavy: stage processes only

    cfg: PreferencesStage = ctx.cfg  # type: ignore[assignment]
    path = ctx.input_model(cfg.policy)
    tokenizer = ctx.load_tokenizer(path)
    plain: dict[str, str] = {}  # each prompt without the chat template: what a pairwise judge reads
    prompts = load_prompts(ctx, cfg.prompts, cfg.split, tokenizer, plain, (cfg.max_prompts, ctx.seed))  # conversations: rendered
    prompts = prompts_within_positions(ctx, prompts, tokenizer, path, cfg.generation.max_new_tokens)
    ctx.prepare_checkpoints()  # each process's sampled batches, kept as they are done (`journaled`)
    records, mine, t0 = sampled_records(ctx, cfg, tokenizer, prompts, path, plain)
    records = sorted(gather_object(records), key=lambda r: r["index"])
    nonfinite = finite_or_none(records)
    if cfg.pairwise is not None:  # over every process's prompts: all of them stop here together, or none does
        from align.judges.pairwise import check_invalid

        check_invalid([{"outcome": r["outcome"], "answers": r["verdicts"]} for r in records
                       if r["outcome"] != "unfinished"], cfg.pairwise, ctx.name, "prompts", show=ctx.is_main)
    seconds = time.perf_counter() - t0  # sampling, scoring and judging; the engine's own time below
    generated, resumed = (sum(gather_object([mine.get(k, 0)])) for k in ("generated_tokens", "resumed_batches"))
    sampling = max(gather_object([mine.get("generation_seconds", 0.0)]))  # the processes sample side by side
    splits, pairs, ties, cut = split_pairs(ctx, cfg, records)

    def write(out: Path) -> None:
        if not ctx.is_main:
            return
        for name, rows in {**splits, "samples": records}.items():
            with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)

    ctx.publish("data", write)
    if ctx.is_main:  # judged and published (samples.jsonl holds them): a forced rerun draws anew
        shutil.rmtree(ctx.dir / SAMPLED, ignore_errors=True)
    all_scores = [s for r in records for s in r["scores"] if s is not None]
    margins = [p["score_chosen"] - p["score_rejected"] for p in pairs]
    final = {"preferences/prompts": len(records), "preferences/pairs_train": len(splits["train"]),
             "preferences/pairs_test": len(splits["test"]), "preferences/ties_dropped": ties,
             "preferences/unfinished_samples": sum(not e for r in records for e in r["ended"]),
             "preferences/prompts_unfinished": cut, "preferences/nonfinite_scores": nonfinite,
             "preferences/all_pairs_train": len(splits["train_all_pairs"]),
             "perf/generated_tokens": generated, "perf/generation_seconds": sampling, "perf/batches_resumed": resumed,
             "perf/sampling_seconds": seconds, "perf/tokens_per_s": generated / sampling if sampling else None}
    if cfg.pairwise is None:
        final.update({"preferences/mean_margin": sum(margins) / len(margins),
                      "objective/scores": sum(all_scores) / len(all_scores)})
    else:  # 1 vs 0 or 0.5 each: a margin of 1 and a mean score of 0.5 always; what the judge decided instead
        judged = [r["outcome"] for r in records if r["outcome"] != "unfinished"]
        final.update({f"preferences/pairwise_{k}": sum(o in kinds for o in judged) / len(judged) for k, kinds in
                      (("decided", ("win", "loss")), ("ties", ("tie",)), ("invalid", ("invalid",)))})
    ctx.log(final, step=0)
    return final
