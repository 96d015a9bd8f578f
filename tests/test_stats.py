import numpy as np
import pytest

from align.report.stats import bootstrap_ci, perplexity, win_indicators, win_rate


def test_known_win_rate_with_ties_counted_half():
    # wins, loss, tie, win -> (1 + 0 + 0.5 + 1) / 4
    r = win_rate([3, 1, 2, 5], [1, 2, 2, 4], samples=500)
    assert r["win_rate"] == pytest.approx(0.625)
    assert r["n"] == 4
    assert r["ci_low"] <= 0.625 <= r["ci_high"]


def test_identical_policies_give_one_half():
    scores = list(np.random.default_rng(0).normal(size=300))
    assert win_rate(scores, scores)["win_rate"] == 0.5
    a = np.random.default_rng(1).normal(size=2000)
    b = np.random.default_rng(2).normal(size=2000)
    r = win_rate(list(a), list(b))
    assert r["ci_low"] < 0.5 < r["ci_high"]
    assert abs(r["win_rate"] - 0.5) < 0.03


def test_unequal_lengths_are_an_error():
    with pytest.raises(ValueError, match="equal lengths"):
        win_indicators([1, 2], [1])


def test_bootstrap_ci_covers_truth_at_about_nominal_rate():
    """Draw 200 synthetic experiments with true win probability 0.6; the 95% CI should cover 0.6 in roughly
    95% of them (percentile bootstrap, n = 100: allow 88-99%)."""
    rng = np.random.default_rng(123)
    covered = 0
    for i in range(200):
        w = (rng.random(100) < 0.6).astype(float)
        lo, hi = bootstrap_ci(w, samples=1000, seed=i)
        covered += lo <= 0.6 <= hi
    assert 0.88 <= covered / 200 <= 0.99


def test_perplexity_is_token_weighted_over_all_responses():
    # two responses: 1 token with log-prob -2, 3 tokens summing to -4 -> exp(6 / 4) = e^1.5, not the mean of
    # the per-response perplexities (e^2 + e^(4/3)) / 2 = 5.59
    assert perplexity([-2.0, -4.0], [1, 3]) == pytest.approx(4.4816891)
    assert perplexity([0.0], [5]) == 1.0  # every token certain
    assert np.isnan(perplexity([], []))  # no tokens: undefined, not 1
