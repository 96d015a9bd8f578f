"""Seed sweeps: the variants of a stage swept over `seed` alone (`sweep: {seed: [1, 2, 3]}`) are repeats of one
recipe, not policies to tell apart: the report gives each such group's mean, its spread over seeds (sample std,
min and max) and the weakest seed's lower CI bound, above the per-seed rows.

Pure functions over evaluate's metrics dict (align/stages/evaluate.py) and its groups (align/report/frontier.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from align.report.frontier import Group


def swept_keys(group: Group, policy: str) -> set[str]:
    """The keys a variant was swept over (its settings string is `key=value ...`)."""
    return {kv.split("=", 1)[0] for kv in group.settings.get(policy, "").split()}


def seed_sweeps(groups: list[Group]) -> list[Group]:
    """The groups of two or more variants that differ by `seed` alone."""
    return [g for g in groups if len(g.policies) > 1 and all(swept_keys(g, p) == {"seed"} for p in g.policies)]


def spread(values: list[float]) -> dict[str, float]:
    """mean, sample std (n - 1; 0 for one value), min, max."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def aggregate(m: dict[str, Any], group: Group, judges: list[str], pairwise: list[str], reference: str = "",
              baseline: str = "") -> dict[str, Any]:
    """`eval/<group>/seeds/...` metrics of a seed sweep: its number of seeds, and for the KL to the reference, each
    judge's mean and win rate, and each pairwise judge's win rate: mean, std, min, max over the seeds, with the lowest
    lower CI bound of a win rate among them (`win_rate_ci_low_min`). A seed that is the `reference` is left out of
    the KL (0 by construction), one that is the `baseline` out of the win rates (it has none): `left_out` names them."""
    ps = group.policies
    key = f"eval/{group.name}/seeds"
    out: dict[str, Any] = {f"{key}/n": len(ps), f"{key}/policies": list(ps)}
    if left := [p for p in ps if p in (reference, baseline)]:
        out[f"{key}/left_out"] = left
    kls = [m[f"eval/{p}/kl"] for p in ps if p != reference]
    out.update({f"{key}/kl/{k}": v for k, v in spread(kls).items()} if kls else {})
    for j in [*judges, *pairwise]:
        for stat in ("mean", "win_rate"):
            vals = [m.get(f"eval/{p}/{j}/{stat}") for p in ps if stat == "mean" or p != baseline]
            if not vals or any(v is None or not math.isfinite(v) for v in vals):  # a seed without one (NaN: no
                continue  # valid verdict) is no spread: the row shows '-' and each seed's own row says why
            out.update({f"{key}/{j}/{stat}/{k}": v for k, v in spread(vals).items()})
            if stat == "win_rate":
                out[f"{key}/{j}/win_rate/ci_low_min"] = min(m[f"eval/{p}/{j}/win_rate_ci"][0] for p in ps
                                                            if p != baseline)
    return out


def cell(m: dict[str, Any], prefix: str, digits: int = 3) -> str:
    """`mean ± std [min, max]` of one aggregated quantity (`-` when it is missing)."""
    if f"{prefix}/mean" not in m:
        return "-"
    f = f"{{:.{digits}f}}"
    return (f"{f.format(m[f'{prefix}/mean'])} ± {f.format(m[f'{prefix}/std'])} "
            f"[{f.format(m[f'{prefix}/min'])}, {f.format(m[f'{prefix}/max'])}]")


def table(m: dict[str, Any], groups: list[Group], judges: list[str], pairwise: list[str], reference: str,
          baseline: str) -> list[str]:
    """Markdown: one row per seed sweep, mean ± std [min, max] over its seeds (its per-seed rows are in the table
    above); empty when the run has no seed sweep."""
    sweeps = seed_sweeps(groups)
    if not sweeps:
        return []
    rated = [*judges, *pairwise]
    lines = ["Seed sweeps: each row is one recipe run with several seeds, mean ± std [min, max] over them, and the "
             "lowest lower 95% CI bound of any seed's win rate (the per-seed rows are above).", "",
             f"| stage | seeds | KL to {reference} | " + " | ".join(f"{j} win rate vs {baseline}" for j in rated) + " |",
             "|" + "---|" * (3 + len(rated))]
    for g in sweeps:
        key = f"eval/{g.name}/seeds"
        cells = []
        for j in rated:
            low = m.get(f"{key}/{j}/win_rate/ci_low_min")
            cells.append(cell(m, f"{key}/{j}/win_rate") + (f", lowest CI bound {low:.3f}" if low is not None else ""))
        left = m.get(f"{key}/left_out") or []  # the reference's KL and the baseline's win rate are not measured
        note = f" ({', '.join(left)}: the reference or baseline, left out where it has no measure)" if left else ""
        lines.append(f"| {g.name} | {m[f'{key}/n']}{note} | {cell(m, f'{key}/kl', 2)} | " + " | ".join(cells) + " |")
    return lines
