"""The reward–KL frontier (align/report/frontier.py, plots.frontier): grouping by swept stage, Pareto optimality against
hand-worked points, the report table and the figure. The end-to-end frontier in a real report is checked in
tests/test_sweeps.py (a run with a swept DPO stage)."""

from __future__ import annotations

import random
import struct

from align.report import frontier

from align.report import plots

VARIANTS = {"dpo-beta_0.1": {"stage": "dpo", "values": {"beta": 0.1}},
            "dpo-beta_0.5": {"stage": "dpo", "values": {"beta": 0.5}},
            "ppo_gold-kl.coef_0.05": {"stage": "ppo_gold", "values": {"kl.coef": 0.05}},
            "ppo_gold-kl.coef_0.2": {"stage": "ppo_gold", "values": {"kl.coef": 0.2}}}
POLICIES = ["sft", "dpo-beta_0.1", "ppo_gold-kl.coef_0.05", "dpo-beta_0.5", "ppo_gold-kl.coef_0.2", "grpo"]
TYPES = {"sft": "sft", "dpo-beta_0.1": "dpo", "dpo-beta_0.5": "dpo", "ppo_gold-kl.coef_0.05": "ppo",
         "ppo_gold-kl.coef_0.2": "ppo", "grpo": "grpo"}


def test_groups_follow_the_swept_stage_in_order_of_first_appearance():
    groups = frontier.group_policies(POLICIES, VARIANTS, TYPES)
    assert [(g.name, g.type, g.policies) for g in groups] == [
        ("sft", "sft", ["sft"]), ("dpo", "dpo", ["dpo-beta_0.1", "dpo-beta_0.5"]),
        ("ppo_gold", "ppo", ["ppo_gold-kl.coef_0.05", "ppo_gold-kl.coef_0.2"]), ("grpo", "grpo", ["grpo"])]
    assert groups[2].settings["ppo_gold-kl.coef_0.2"] == "kl.coef=0.2" and groups[3].settings["grpo"] == ""


def test_pareto_optimal_points_worked_by_hand():
    # (kl, score): a at KL 0 is optimal (nothing has lower KL); b beats c (less KL, more score); d has the top
    # score; e ties d's score at more KL (dominated); f equals b exactly (neither dominates the other).
    pts = {"a": (0.0, 0.1), "b": (1.0, 0.5), "c": (2.0, 0.4), "d": (3.0, 0.9), "e": (4.0, 0.9), "f": (1.0, 0.5)}
    assert frontier.pareto_optimal(pts) == {"a", "b", "d", "f"}
    assert frontier.pareto_optimal({"x": (1.0, 1.0)}) == {"x"}
    assert frontier.pareto_optimal({"lo": (0.5, 0.2), "hi": (0.5, 0.3)}) == {"hi"}  # same KL: the higher score


def _metrics(seed: int) -> dict:
    rng = random.Random(seed)
    m = {}
    for p in POLICIES:
        kl, y = (0.0, 0.3) if p == "sft" else (5 * rng.random(), rng.random())
        m.update({f"eval/{p}/kl": kl, f"eval/{p}/kl_ci": [kl - 0.1 * kl, kl + 0.1 * kl],
                  f"eval/{p}/vader/mean": y, f"eval/{p}/vader/mean_ci": [y - .05, y + .05]})
        if p != "sft":
            m.update({f"eval/{p}/vader/win_rate": y, f"eval/{p}/vader/win_rate_ci": [y - .04, y + .04]})
    return m


def test_table_rows_sorted_by_kl_with_cis_and_pareto_marks():
    seed = 11
    print(f"seed {seed}")
    m = _metrics(seed)
    groups = frontier.group_policies(POLICIES, VARIANTS, TYPES)
    rows = frontier.frontier_table(m, groups, "vader", "sft")
    body = rows[2:]
    assert len(body) == len(POLICIES)
    dpo_rows = [r for r in body if r.startswith("| dpo (dpo)")]
    dpo_kls = [float(r.split("|")[3].split()[0]) for r in dpo_rows]
    assert dpo_kls == sorted(dpo_kls) and len(dpo_kls) == 2
    best = frontier.pareto_optimal(frontier.frontier_points(m, POLICIES, "vader"))
    for p in POLICIES:
        row = next(r for r in body if f"{m[f'eval/{p}/kl']:.2f} [" in r)
        assert row.split("|")[6].strip().startswith("yes" if p in best else "no"), (p, row)
    sft = next(r for r in body if r.startswith("| sft (sft)"))
    assert "(baseline)" in sft and sft.rstrip(" |").endswith("/ -")
    # the baseline (KL 0) is always on the frontier: nothing has less KL
    assert "sft" in best
    summary = frontier.dominance_summary(m, groups, "vader")
    assert summary.startswith("Pareto-optimal points for vader") and "sft 1 of 1 (KL 0.00)" in summary


def test_a_policy_that_lost_to_the_baseline_at_more_kl_is_not_on_the_win_rate_frontier():
    """The baseline logs no win rate, and was left out of the win-rate frontier: a lone policy with more KL that
    lost to it (win rate 0.3) was marked Pareto-optimal there, dominated by nothing, beside "no" on the mean axis
    (a review of the report, 2026-12-02). The baseline is the point (its KL, 0.5) now."""
    m = {"eval/sft/kl": 0.0, "eval/sft/vader/mean": 0.5, "eval/sft/vader/mean_ci": [0.45, 0.55],
         "eval/dpo/kl": 2.0, "eval/dpo/kl_ci": [1.8, 2.2], "eval/dpo/vader/mean": 0.3,
         "eval/dpo/vader/mean_ci": [0.25, 0.35], "eval/dpo/vader/win_rate": 0.3, "eval/dpo/vader/win_rate_ci": [0.25, 0.35]}
    groups = frontier.group_policies(["sft", "dpo"], {}, {"sft": "sft", "dpo": "dpo"})
    rows = frontier.frontier_table(m, groups, "vader", "sft")
    assert next(r for r in rows if r.startswith("| dpo")).endswith("| no / no |"), rows
    assert next(r for r in rows if r.startswith("| sft")).endswith("| yes / - |"), rows
    m["eval/dpo/vader/win_rate"] = 0.7  # won: on the frontier (more KL, more wins)
    assert next(r for r in frontier.frontier_table(m, groups, "vader", "sft") if r.startswith("| dpo")).endswith(
        "| no / yes |")


def test_frontier_figure_has_two_panels_and_draws_every_group(tmp_path):
    seed = 5
    print(f"seed {seed}")
    m = _metrics(seed)
    groups = frontier.group_policies(POLICIES, VARIANTS, TYPES)
    plots.frontier(m, groups, "vader", "sft", "sft", tmp_path / "f.png")
    head = (tmp_path / "f.png").read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 2 * height  # two panels side by side and a legend


def test_a_group_keeps_its_colour_in_both_panels():
    """The baseline is in the score panel but not in the win-rate panel (it has no win rate against itself); a
    colour taken from the axes' cycle would then shift every later group's colour between the panels and the
    legend would name the wrong curves."""
    seed = 7
    print(f"seed {seed}")
    m = _metrics(seed)
    groups = frontier.group_policies(POLICIES, VARIANTS, TYPES)
    mean = {s["group"].name: s["color"] for s in plots.frontier_series(m, groups, "vader", "mean")}
    win = {s["group"].name: s["color"] for s in plots.frontier_series(m, groups, "vader", "win_rate")}
    assert "sft" in mean and "sft" not in win
    assert all(win[g] == mean[g] for g in win) and len(set(mean.values())) == len(mean)


def test_every_kl_label_names_the_temperature_it_is_taken_at(tmp_path):
    """Only the headline said the KL was taken at the sampling temperature: the frontier table, the seed table and
    both figures' axes said "KL" alone, and the frontier figure is the one cited beside the DPO paper's (KL at T=1)."""
    from align.config.evaluate import EvaluateStage
    from align.config.settings import Generation
    from align.report import frontier
    from align.report.markdown import reference_label

    cfg = EvaluateStage(policies=["sft", "dpo"], baseline="sft", generation=Generation(temperature=0.7))
    assert reference_label(cfg) == "sft (T=0.7)"
    rows = frontier.frontier_table({}, [], "vader", "sft", reference_label(cfg))
    assert "KL to sft (T=0.7) [nats per response] [95% CI]" in rows[0]


def test_eleven_policies_on_one_plot_are_told_apart(tmp_path, monkeypatch):
    """matplotlib's ten colours repeat: with eleven policies the baseline and the tenth swept variant were the same
    mark in the reward-vs-KL plot's legend. Past ten, the marker changes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from align.report import plots

    policies = ["sft", *(f"dpo-beta_{i}" for i in range(11))]
    m = {k: v for i, p in enumerate(policies) for k, v in {f"eval/{p}/kl": float(i), f"eval/{p}/vader/mean": 0.1 * i,
                                                          f"eval/{p}/vader/mean_ci": [0.1 * i - 0.05, 0.1 * i + 0.05]}.items()}
    seen = []
    real = plt.Axes.errorbar

    def errorbar(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        seen.append((kwargs["label"], out.lines[0].get_color(), out.lines[0].get_marker()))
        return out

    monkeypatch.setattr(plt.Axes, "errorbar", errorbar)
    plots.reward_vs_kl(m, policies, "vader", "sft (T=1)", tmp_path / "r.png")
    marks = [(color, marker) for _, color, marker in seen]
    assert len(set(marks)) == len(policies), seen
