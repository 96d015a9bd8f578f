"""Seed sweeps in the report (align/report/seeds.py): which groups are repeats over seeds, their mean and spread
worked by hand, and the table the evaluation report prints above its per-seed rows."""

from __future__ import annotations

import pytest

from align.report import frontier, seeds

VARIANTS = {"ppo-seed_1": {"stage": "ppo", "values": {"seed": 1}},
            "ppo-seed_2": {"stage": "ppo", "values": {"seed": 2}},
            "ppo-seed_3": {"stage": "ppo", "values": {"seed": 3}},
            "dpo-beta_0.1": {"stage": "dpo", "values": {"beta": 0.1}},
            "dpo-beta_0.3": {"stage": "dpo", "values": {"beta": 0.3}},
            "kto-seed_1-beta_0.1": {"stage": "kto", "values": {"seed": 1, "beta": 0.1}},
            "kto-seed_2-beta_0.1": {"stage": "kto", "values": {"seed": 2, "beta": 0.1}}}
POLICIES = ["sft", "ppo-seed_1", "ppo-seed_2", "ppo-seed_3", "dpo-beta_0.1", "dpo-beta_0.3", "kto-seed_1-beta_0.1",
            "kto-seed_2-beta_0.1"]


def _groups():
    return frontier.group_policies(POLICIES, VARIANTS, {p: p.split("-")[0] for p in POLICIES})


def test_only_groups_swept_over_seed_alone_are_seed_sweeps():
    assert [g.name for g in seeds.seed_sweeps(_groups())] == ["ppo"]  # dpo: beta; kto: seed and beta


def test_mean_and_spread_over_seeds_by_hand():
    """KL 4, 5, 6 -> mean 5, sample std 1, min 4, max 6. VADER win rates 0.80, 0.90, 0.85 -> mean 0.85,
    std sqrt(((-0.05)^2 + 0.05^2 + 0) / 2) = 0.05; CI lower bounds 0.76, 0.86, 0.80 -> lowest 0.76."""
    m = {}
    for p, kl, w, lo in (("ppo-seed_1", 4.0, 0.80, 0.76), ("ppo-seed_2", 5.0, 0.90, 0.86), ("ppo-seed_3", 6.0, 0.85, 0.80)):
        m.update({f"eval/{p}/kl": kl, f"eval/{p}/vader/mean": w / 2, f"eval/{p}/vader/win_rate": w,
                  f"eval/{p}/vader/win_rate_ci": [lo, w + 0.04]})
    (ppo,) = seeds.seed_sweeps(_groups())
    agg = seeds.aggregate(m, ppo, ["vader"], ["smollm2"])  # the pairwise judge has no numbers here: left out
    assert agg["eval/ppo/seeds/n"] == 3
    assert [agg[f"eval/ppo/seeds/kl/{k}"] for k in ("mean", "std", "min", "max")] == pytest.approx([5, 1, 4, 6])
    assert [agg[f"eval/ppo/seeds/vader/win_rate/{k}"] for k in ("mean", "std", "min", "max")] == pytest.approx(
        [0.85, 0.05, 0.80, 0.90])
    assert agg["eval/ppo/seeds/vader/mean/mean"] == pytest.approx(0.425)
    assert agg["eval/ppo/seeds/vader/win_rate/ci_low_min"] == 0.76
    assert not any("smollm2" in k for k in agg)
    m.update(agg)
    lines = seeds.table(m, _groups(), ["vader"], ["smollm2"], "sft", "sft")
    row = next(x for x in lines if x.startswith("| ppo |"))
    assert row == "| ppo | 3 | 5.00 ± 1.00 [4.00, 6.00] | 0.850 ± 0.050 [0.800, 0.900], lowest CI bound 0.760 | - |"
    assert seeds.table(m, [g for g in _groups() if g.name != "ppo"], ["vader"], [], "sft", "sft") == []


def test_a_seed_sweep_holding_the_reference_and_baseline_leaves_them_out_where_they_have_no_measure():
    """policies sft-seed_1..3 with sft-seed_1 the reference and the baseline: its KL to itself (0 by construction)
    was averaged in as a measured seed ("0.93 ± 0.93 [0.00, 1.86]"), and the baseline's missing win rate dropped the
    group's win-rate cell without a word."""
    group = frontier.Group("sft", "sft", ["sft-seed_1", "sft-seed_2", "sft-seed_3"],
                           {f"sft-seed_{i}": f"seed={i}" for i in (1, 2, 3)})
    m = {"eval/sft-seed_1/kl": 0.0, "eval/sft-seed_2/kl": 1.0, "eval/sft-seed_3/kl": 2.0}
    for p, w in (("sft-seed_2", 0.6), ("sft-seed_3", 0.4)):
        m.update({f"eval/{p}/vader/win_rate": w, f"eval/{p}/vader/win_rate_ci": [w - 0.1, w + 0.1]})
    for p in group.policies:
        m[f"eval/{p}/vader/mean"] = 0.5
    agg = seeds.aggregate(m, group, ["vader"], [], "sft-seed_1", "sft-seed_1")
    assert [agg[f"eval/sft/seeds/kl/{k}"] for k in ("mean", "min", "max")] == pytest.approx([1.5, 1.0, 2.0])
    assert agg["eval/sft/seeds/vader/win_rate/mean"] == pytest.approx(0.5)
    assert agg["eval/sft/seeds/vader/win_rate/ci_low_min"] == pytest.approx(0.3)
    assert agg["eval/sft/seeds/vader/mean/mean"] == 0.5 and agg["eval/sft/seeds/left_out"] == ["sft-seed_1"]
    m.update(agg)
    row = next(x for x in seeds.table(m, [group], ["vader"], [], "sft-seed_1", "sft-seed_1") if x.startswith("| sft |"))
    assert "3 (sft-seed_1: the reference or baseline, left out where it has no measure)" in row
