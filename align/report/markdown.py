"""The evaluation report's documents: report.md (the headline tables, the reward–KL frontier, length against reward,
the reward model's calibration, samples), metrics.json, the figures and samples.jsonl, written by the evaluate
stage (align/stages/evaluate.py) from the metrics it computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.config.evaluate import EvaluateStage
from align.core.tracking import json_ready
from align.report import frontier, plots, seeds


def reference_label(cfg: EvaluateStage) -> str:
    """The reference as every KL label names it, with the temperature the KL is taken at ("sft (T=0.7)"): at T != 1
    it is another quantity than the DPO paper's frontier's KL."""
    return f"{cfg.reference} (T={cfg.generation.temperature:g})"


def write_report(out: Path, cfg: EvaluateStage, metrics: dict[str, Any], prompts: list[str],
                 samples: dict[str, dict[str, Any]], groups: list, verdicts: dict, buckets: list) -> None:
    """report/: metrics.json, the plots, report.md and samples.jsonl (every prompt, every policy's response)."""
    (out / "metrics.json").write_text(json.dumps(json_ready(metrics), indent=2, sort_keys=True, allow_nan=False) + "\n")
    judge_names, ref = all_judges(cfg), reference_label(cfg)  # the KL of every figure is at the sampling T
    for j in judge_names:
        plots.reward_vs_kl(metrics, cfg.policies, j, ref, out / f"reward_vs_kl_{j}.png")
    if len(cfg.policies) > 1 and judge_names:
        plots.win_rates(metrics, cfg.policies, judge_names, cfg.baseline, out / "win_rates.png")
        for j in judge_names:
            plots.frontier(metrics, groups, j, ref, cfg.baseline, out / f"frontier_{j}.png")
    if buckets:
        plots.calibration(buckets, out / "reward_model_calibration.png")
    (out / "report.md").write_text(render_report(cfg, metrics, prompts, samples, groups))
    with open(out / "samples.jsonl", "w", encoding="utf-8") as fh:
        for i, p in enumerate(prompts):
            row = {"prompt": p, **{n: {"response": s["responses"][i], "kl": s["kl"][i],
                                       **{j: sc[i] for j, sc in s["scores"].items()},
                                       **{j: by[n][i] for j, by in verdicts.items() if i < len(by.get(n, []))}}
                                   for n, s in samples.items()}}
            fh.write(json.dumps(json_ready(row), allow_nan=False) + "\n")


def all_judges(cfg: EvaluateStage) -> list[str]:
    """The judges every sample is scored by: the gold functions, then the reward model if there is one."""
    return [*cfg.judges, *(["reward_model"] if cfg.reward else [])]


def headline(cfg: EvaluateStage, m: dict[str, Any], groups: list[frontier.Group] | None = None) -> str:
    """The report's first tables: every policy's judge means, KL, perplexity and win rates; each pairwise judge's
    verdicts; and, when stages were swept over seeds, their mean and spread (align/report/seeds.py)."""
    judges = all_judges(cfg)  # the KL is the sampled distributions' (at T), as sampled and as PPO's penalty
    lines = _header(["policy", *(f"{j} mean" for j in judges), f"KL to {reference_label(cfg)}",
                     f"perplexity under {cfg.reference}", f"cut at {cfg.generation.max_new_tokens} tokens",
                     *(f"{j} win rate vs {cfg.baseline} [95% CI]" for j in judges)])
    for p in cfg.policies:
        cells = ([f"{m[f'eval/{p}/{j}/mean']:.3f}" for j in judges] + [f"{m[f'eval/{p}/kl']:.2f}"]
                 + [f"{m.get(f'eval/{p}/ref_perplexity', float('nan')):.2f}"]
                 + [f"{m.get(f'eval/{p}/at_max_new_tokens', float('nan')):.1%}"])
        for j in judges:
            if p == cfg.baseline:
                cells.append("(baseline)")
            else:
                lo, hi = m[f"eval/{p}/{j}/win_rate_ci"]
                cells.append(f"{m[f'eval/{p}/{j}/win_rate']:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    unfit = False  # a length-controlled rate stats.length_controlled_win_rate could not give (NaN)
    for judge in cfg.pairwise:  # pairwise judges: win rate vs the baseline, both orders, ties as halves
        lines += ["", *_header(["policy", f"{judge.name} win rate vs {cfg.baseline} [95% CI]", "length-controlled",
                                "ties", "position-consistent", "invalid",
                                f"agreement with {', '.join(cfg.judges) or '-'}"])]
        for p in cfg.policies:
            if p == cfg.baseline:
                continue
            key = f"eval/{p}/{judge.name}"
            lo, hi = m[f"{key}/win_rate_ci"]
            agree = ", ".join(f"{m.get(f'{key}/agreement/{j}', float('nan')):.3f} "
                              f"(n={m.get(f'{key}/agreement/{j}/pairs', 0):.0f})" for j in cfg.judges) or "-"
            lc, none_valid = m[f"{key}/lc_win_rate"], not m.get(f"{key}/valid", 1)
            unfit = unfit or (lc != lc and not none_valid)  # no valid verdict: said in its own cell, not the footnote
            lc_cell = "no valid verdicts" if none_valid else "n/a" if lc != lc else f"{lc:.3f}"
            bounds = m.get(f"{key}/win_rate_bounds")  # invalid pairs as losses / as wins: what leaving them out hides
            invalid = f"{m[f'{key}/invalid_rate']:.3f}" + (f" (win rate {bounds[0]:.3f}-{bounds[1]:.3f} with them as "
                                                            "losses / wins)" if m[f"{key}/invalid_rate"] and bounds
                                                            else "")
            lines.append(f"| {p} | {m[f'{key}/win_rate']:.3f} [{lo:.3f}, {hi:.3f}] | {lc_cell} | "
                         f"{m[f'{key}/tie_rate']:.3f} | {m[f'{key}/consistency']:.3f} | {invalid} | {agree} |")
    if unfit:
        lines += ["", "length-controlled n/a: the lengths cannot be told from the policy (fewer than 10% of the pairs "
                  "on one side of equal length, or every pair the same length apart), and a rate at equal length "
                  "would be an extrapolation; or length alone decides every verdict (no win shorter than a loss, or "
                  "none longer), and the data say nothing of equal length"]
    judged = {j.name: next((int(m[f"eval/{p}/{j.name}/pairs"]) for p in cfg.policies if p != cfg.baseline), 0)
              for j in cfg.pairwise}
    swept = seeds.table(m, groups or [], judges, [j.name for j in cfg.pairwise], reference_label(cfg), cfg.baseline)
    lines += ["", *swept] if swept else []
    too_long = (f" ({m['eval/prompts_too_long']} more left out: too long for generation.max_new_tokens after them "
                "within the model's positions or the reward stage's max_length; the manifest's dropped_rows says which)"
                if m.get("eval/prompts_too_long") else "")
    return "\n".join(lines) + f"\n\nn = {m['eval/prompts']} held-out prompts{too_long}" + "".join(
        f"; {name}: {f'{n} of them (a seeded uniform sample)' if n < m['eval/prompts'] else 'all of them'}, each "
        "pair judged in both orders" for name, n in judged.items())


def _header(cells: list[str]) -> list[str]:
    """A markdown table's header and separator lines, one cell each."""
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]


def render_report(cfg: EvaluateStage, m: dict[str, Any], prompts: list[str], samples: dict[str, Any],
                  groups: list[frontier.Group]) -> str:
    out = ["# Evaluation report", "", headline(cfg, m, groups), ""]
    judges = all_judges(cfg)
    if len(cfg.policies) > 1 and judges:
        out += ["## Reward–KL frontier", "",
                "Policies grouped by the stage they come from (every variant of a sweep is one curve), in order of "
                "KL to the reference. A point is Pareto-optimal when no other policy here has at most its KL and at "
                "least its score; compare the CIs before calling two points different.", ""]
        for j in judges:
            out += [f"### {j}", "", *frontier.frontier_table(m, groups, j, cfg.baseline, reference_label(cfg)), "",
                    frontier.dominance_summary(m, groups, j), "", f"![frontier {j}](frontier_{j}.png)", ""]
    out += ["## Length and reward", "",
            *_header(["policy", "mean response length [tokens]", *(f"corr({j}, length)" for j in judges)])]
    for p in cfg.policies:
        out.append("| " + " | ".join([p, f"{m[f'eval/{p}/response_length']:.1f}", *(
            f"{m.get(f'eval/{p}/{j}/length_corr', float('nan')):.3f}" for j in judges)]) + " |")
    out += ["", "A strong positive correlation of the reward model's score with length, without the same in the "
            "gold judge, is a sign of reward hacking.", ""]
    out += [f"![reward vs KL](reward_vs_kl_{j}.png)" for j in judges]
    if len(cfg.policies) > 1 and judges:
        out.append("![win rates](win_rates.png)")
    out.append("")
    if "eval/reward_model/accuracy" in m:
        out += ["## Reward model", "",
                f"Held-out pairwise accuracy: {m['eval/reward_model/accuracy']:.3f} on "
                f"{m['eval/reward_model/pairs']} pairs (mean margin {m['eval/reward_model/margin']:.3f}"
                + (f"; {m['eval/reward_model/pairs_over_max_length']} longer than the reward stage's max_length left "
                   "out" if m.get("eval/reward_model/pairs_over_max_length") else "") + "). "
                f"Scores: chosen {m['eval/reward_model/chosen_mean']:.3f} ± {m['eval/reward_model/chosen_std']:.3f}, "
                f"rejected {m['eval/reward_model/rejected_mean']:.3f} ± {m['eval/reward_model/rejected_std']:.3f}.",
                "", "| abs margin bucket | pairs | accuracy |", "|---|---|---|"]
        out += [f"| {b['lo']:.2f} - {b['hi']:.2f} | {b['n']} | {b['accuracy']:.3f} |"
                for b in m["eval/reward_model/calibration"]]
        out += ["", "![calibration](reward_model_calibration.png)", ""]
    out += ["## Samples", ""]
    for i in range(min(5, len(prompts))):
        out.append(f"**{prompts[i]}**")
        for name, s in samples.items():
            scores = ", ".join(f"{j} {sc[i]:.2f}" for j, sc in s["scores"].items())
            out.append(f"- {name}: {s['responses'][i]!r}" + (f" ({scores})" if scores else ""))
        out.append("")
    return "\n".join(out)
