"""The reward–KL frontier: policies grouped by the stage (or sweep) that produced them, one curve per group of
judge score (and win rate) against KL to the reference, and which points no other policy beats.

Rafailov et al. 2023 (DPO), Fig. 2 left: the frontier of expected reward vs KL to the reference, one curve per
algorithm over its KL-strength settings. A point is *Pareto-optimal* when no other evaluated policy has at most
its KL and at least its score, one of them strictly (point estimates; the table gives the CIs beside them, so a
reader sees where two points are within noise of each other).

Pure functions over evaluate's metrics dict (align/stages/evaluate.py); the figure is drawn in align/report/plots.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Group:
    """The policies of one curve: every variant of a swept stage, or one stage on its own."""

    name: str
    """The swept stage's name (`dpo` for `dpo-beta_0.1`, ...), or the stage's own name."""
    type: str
    """Its stage type (ppo, dpo, grpo, ...): two groups of one type differ in other settings (e.g. the reward)."""
    policies: list[str] = field(default_factory=list)
    """The group's policies in the pipeline's order (sweep order)."""
    settings: dict[str, str] = field(default_factory=dict)
    """Policy -> its swept values as `key=value ...` ("" for an unswept stage)."""


def group_policies(policies: list[str], variants: dict[str, dict[str, Any]], types: dict[str, str]) -> list[Group]:
    """Group `policies` by the stage they are variants of (pipeline `variants`, align/config/sweeps.py), in order of first
    appearance. `types`: policy -> its stage type (from its manifest)."""
    groups: dict[str, Group] = {}
    for p in policies:
        v = variants.get(p)
        name = v["stage"] if v else p
        g = groups.setdefault(name, Group(name, types.get(p, "?")))
        g.policies.append(p)
        g.settings[p] = " ".join(f"{k}={val}" for k, val in v["values"].items()) if v else ""
    return list(groups.values())


def pareto_optimal(points: dict[str, tuple[float, float]]) -> set[str]:
    """Names of the points (kl, score) that no other point dominates: lower-or-equal KL and higher-or-equal score,
    one strictly. Equal points do not dominate each other."""
    best = set()
    for p, (kl, score) in points.items():
        if not any((k2 <= kl and s2 >= score) and (k2 < kl or s2 > score)
                   for q, (k2, s2) in points.items() if q != p):
            best.add(p)
    return best


def frontier_points(m: dict[str, Any], policies: list[str], judge: str, key: str = "mean",
                    baseline: str | None = None) -> dict[str, tuple[float, float]]:
    """Policy -> (mean KL, judge `key`) from evaluate's metrics. The baseline logs no win rate; its rate against
    itself is 0.5 (ties count half), and it is a point of the win-rate frontier at that: left out, a policy with
    more KL that lost to it was marked Pareto-optimal, dominated by nothing."""
    points = {p: (m[f"eval/{p}/kl"], m[f"eval/{p}/{judge}/{key}"]) for p in policies if f"eval/{p}/{judge}/{key}" in m}
    if key == "win_rate" and baseline in policies and f"eval/{baseline}/kl" in m:
        points[baseline] = (m[f"eval/{baseline}/kl"], 0.5)
    return points


def _ci(m: dict[str, Any], key: str, fmt: str = ".3f") -> str:
    lo, hi = m[key]
    return f"[{lo:{fmt}}, {hi:{fmt}}]"


def frontier_table(m: dict[str, Any], groups: list[Group], judge: str, baseline: str, reference: str = "the "
                   "reference") -> list[str]:
    """Markdown rows: per group and setting, KL, judge mean and win rate against the baseline with 95% CIs, and
    whether the point is Pareto-optimal for the mean score and for the win rate."""
    policies = [p for g in groups for p in g.policies]
    best_mean = pareto_optimal(frontier_points(m, policies, judge, "mean"))
    best_win = pareto_optimal(frontier_points(m, policies, judge, "win_rate", baseline))
    rows = [f"| group (type) | setting | KL to {reference} [nats per response] [95% CI] | {judge} mean [95% CI] | "
            f"{judge} win rate vs {baseline} "
            "[95% CI] | Pareto-optimal (mean / win rate) |", "|---|---|---|---|---|---|"]
    for g in groups:
        for p in sorted(g.policies, key=lambda q: m[f"eval/{q}/kl"]):
            kl = f"{m[f'eval/{p}/kl']:.2f} " + (_ci(m, f"eval/{p}/kl_ci", ".2f") if f"eval/{p}/kl_ci" in m else "")
            mean = f"{m[f'eval/{p}/{judge}/mean']:.3f} {_ci(m, f'eval/{p}/{judge}/mean_ci')}"
            win = ("(baseline)" if p == baseline else
                   f"{m[f'eval/{p}/{judge}/win_rate']:.3f} {_ci(m, f'eval/{p}/{judge}/win_rate_ci')}")
            marks = " / ".join("yes" if p in best else "no" for best in (best_mean, best_win)) \
                if p != baseline else ("yes" if p in best_mean else "no") + " / -"
            rows.append(f"| {g.name} ({g.type}) | {g.settings[p] or '-'} | {kl.strip()} | {mean} | {win} | {marks} |")
    return rows


def dominance_summary(m: dict[str, Any], groups: list[Group], judge: str) -> str:
    """One sentence: how many Pareto-optimal points (mean score vs KL) each group holds, and over which KL range."""
    policies = [p for g in groups for p in g.policies]
    best = pareto_optimal(frontier_points(m, policies, judge, "mean"))
    parts = []
    for g in groups:
        mine = sorted((m[f"eval/{p}/kl"] for p in g.policies if p in best))
        if mine:
            span = f"KL {mine[0]:.2f}" if len(mine) == 1 else f"KL {mine[0]:.2f}-{mine[-1]:.2f}"
            parts.append(f"{g.name} {len(mine)} of {len(g.policies)} ({span})")
    return (f"Pareto-optimal points for {judge} mean vs KL, by group: " + "; ".join(parts) + "."
            if parts else "")
