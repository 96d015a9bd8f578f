"""Report figures (matplotlib, Agg backend, PNG). Every axis is labelled with its unit."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib  # heavy: only when a report is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt


def _bars(values: list[float], cis: list) -> list[list[float]]:
    """matplotlib's error bars (below, above) for `values` with their [lo, hi] intervals, none below 0 (it refuses
    one, and an interval rounded a bit past its value would stop the report)."""
    return [[max(0.0, v - lo) for v, (lo, _) in zip(values, cis)], [max(0.0, hi - v) for v, (_, hi) in zip(values, cis)]]


MARKERS = "os^Dv*Pphx"
"""One marker for every ten points of a plot (with matplotlib's ten colours: a hundred points told apart)."""


def reward_vs_kl(m: dict[str, Any], policies: list[str], judge: str, reference: str, out: Path) -> None:
    """DPO-paper style frontier: each policy a point (mean KL to the reference, mean judge score, 95% CI)."""
    plt = _plt()
    many = len(policies) > 4  # a sweep: a legend beside the axes, where labels at the points would overlap
    fig, ax = plt.subplots(figsize=(9 if many else 5.5, 4))
    for i, p in enumerate(policies):  # matplotlib's ten colours repeat: past ten, another marker tells them apart
        x, y = m[f"eval/{p}/kl"], m[f"eval/{p}/{judge}/mean"]
        lo, hi = m[f"eval/{p}/{judge}/mean_ci"]
        ax.errorbar([x], [y], yerr=_bars([y], [(lo, hi)]), fmt=MARKERS[i // 10 % len(MARKERS)], capsize=4, label=p)
        if not many:
            ax.annotate(p, (x, y), textcoords="offset points", xytext=(6, 4))
    if many:
        ax.legend(title="policy", fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.set_xlabel(f"KL(policy || {reference}) per response [nats]")
    ax.set_ylabel(f"mean {judge} score [judge units]")
    ax.set_title(f"{judge} score vs KL on held-out prompts")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]  # matplotlib's default cycle, fixed here so a group keeps its colour in every panel


def frontier_series(m: dict[str, Any], groups: list, judge: str, key: str) -> list[dict[str, Any]]:
    """Per group (in order), its points for one frontier panel, sorted by KL: xs, ys and their 95% CIs, and the
    group's colour, which depends on the group's position only (the baseline has no win rate, so a colour taken
    from the axes' cycle would shift between the panels)."""
    out = []
    for i, g in enumerate(groups):
        pts = sorted((p for p in g.policies if f"eval/{p}/{judge}/{key}" in m), key=lambda p: m[f"eval/{p}/kl"])
        if pts:
            xs = [m[f"eval/{p}/kl"] for p in pts]
            out.append({"group": g, "color": COLORS[i % len(COLORS)], "policies": pts, "xs": xs,
                        "ys": [m[f"eval/{p}/{judge}/{key}"] for p in pts],
                        "xci": [m.get(f"eval/{p}/kl_ci", (x, x)) for p, x in zip(pts, xs)],
                        "yci": [m[f"eval/{p}/{judge}/{key}_ci"] for p in pts]})
    return out


def frontier(m: dict[str, Any], groups: list, judge: str, reference: str, baseline: str, out: Path) -> None:
    """The reward–KL frontier (align/report/frontier.py): one curve per group (algorithm / swept stage) through its
    settings in order of KL, left panel the judge's mean score, right panel the win rate against the baseline;
    95% CIs on both axes."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "mean", f"mean {judge} score [judge units]"),
                           (axes[1], "win_rate", f"{judge} win rate vs {baseline} [fraction, ties = 0.5]")):
        for s in frontier_series(m, groups, judge, key):
            xs, ys, g = s["xs"], s["ys"], s["group"]
            ax.errorbar(xs, ys, xerr=_bars(xs, s["xci"]), yerr=_bars(ys, s["yci"]),
                        fmt="o-" if len(xs) > 1 else "s", color=s["color"], capsize=3, markersize=4,
                        label=f"{g.name} ({g.type})")
        if key == "win_rate":
            ax.axhline(0.5, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel(f"KL(policy || {reference}) per response [nats]")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # the left panel has every group, the baseline too
    axes[1].legend(handles, labels, title="group (type)", fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(f"Reward–KL frontier on held-out prompts ({judge}; 95% CIs on both axes)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def win_rates(m: dict[str, Any], policies: list[str], judges: list[str], baseline: str, out: Path) -> None:
    """Win rate against the baseline per policy and judge, with 95% Wilson CIs; 0.5 = no difference."""
    plt = _plt()
    others = [p for p in policies if p != baseline]
    tilt = len(others) > 3  # a sweep: many policies, long names
    fig, ax = plt.subplots(figsize=(max(5.5, 0.8 * len(others) * len(judges)), 5.5 if tilt else 4))
    width = 0.8 / max(1, len(judges))
    for j_i, j in enumerate(judges):
        xs = [i + j_i * width for i in range(len(others))]
        ys = [m[f"eval/{p}/{j}/win_rate"] for p in others]
        ax.bar(xs, ys, width=width, yerr=_bars(ys, [m[f"eval/{p}/{j}/win_rate_ci"] for p in others]), capsize=4,
               label=j)
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1)
    ax.set_xticks([i + width * (len(judges) - 1) / 2 for i in range(len(others))], others,
                  rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"win rate vs {baseline} [fraction of prompts, ties = 0.5]")
    ax.set_xlabel("policy")
    ax.set_title("Win rate against the baseline (95% CI)")
    ax.legend(title="judge")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def calibration(buckets: list[dict[str, float]], out: Path) -> None:
    """Reward-model pairwise accuracy by |score margin| bucket (a calibrated model is surer when right)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    labels = [f"{b['lo']:.2f}-{b['hi']:.2f}" for b in buckets]
    ax.bar(range(len(buckets)), [b["accuracy"] for b in buckets])
    for i, b in enumerate(buckets):
        ax.annotate(f"n={b['n']}", (i, b["accuracy"]), ha="center", textcoords="offset points", xytext=(0, 3))
    ax.set_xticks(range(len(buckets)), labels)
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("|reward(chosen) - reward(rejected)| bucket [reward units]")
    ax.set_ylabel("pairwise accuracy [fraction of held-out pairs]")
    ax.set_title("Reward-model calibration")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
