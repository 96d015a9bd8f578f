"""Win rates and confidence intervals for paired evaluations (pure Python + numpy)."""

from __future__ import annotations

import numpy as np


def win_indicators(scores: list[float], baseline: list[float]) -> np.ndarray:
    """Per prompt: 1 if the policy's score beats the baseline's, 0.5 for a tie, 0 for a loss."""
    a, b = np.asarray(scores, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need equal lengths, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):  # a NaN compares false both ways: it would be a loss
        raise ValueError(f"paired scores must be finite: pair {int(np.flatnonzero(~np.isfinite(a - b))[0])} is not")
    return np.where(a > b, 1.0, np.where(a == b, 0.5, 0.0))


def bootstrap_ci(values: np.ndarray | list[float], samples: int = 2000, level: float = 0.95,
                 seed: int = 0, chunk_elements: int = 1 << 22) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of `values`. Resamples are drawn in chunks of about
    `chunk_elements` indices (32 MB), so memory does not grow as samples x n (2,000 x 100k prompts would be
    3.2 GB); the generator's stream is the same, so chunking changes no figure."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    rows = max(1, chunk_elements // max(1, len(v)))
    means = np.concatenate([v[rng.integers(0, len(v), size=(min(rows, samples - start), len(v)))].mean(axis=1)
                            for start in range(0, samples, rows)])
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def outcome_ci(outcomes: np.ndarray | list[float], z: float = 1.959964) -> tuple[float, float]:
    """95% CI of a win rate from its per-prompt outcomes (1 win, 0.5 tie, 0 loss): Wilson's score interval at the
    mean outcome p over n prompts (Wilson 1927, "Probable inference...", JASA 22: the centre (p + z^2/2n) /
    (1 + z^2/n), the half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)), a tie half a win (its variance is below
    p(1-p): the interval is then a little wide, never narrow). [0.886, 1] for 30 wins of 30, [0.833, 0.994] for 29
    and a loss. The percentile bootstrap, used before, is too narrow near 0 and 1 and not monotone there: 29 wins
    and a loss got [0.90, 1], a higher lower bound than 30 wins; with every outcome alike it had nothing to
    resample ([1, 1] for 30 of 30). NaN for no outcomes. The interval holds p, exactly 1 for 512 wins of 512: in
    floating point centre + half fell a bit below 1 (centre - half above 0) for some n, and the report's error bars,
    negative by 1e-16, stopped evaluate after every policy was sampled and judged (matplotlib refuses them)."""
    v = np.asarray(outcomes, dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan")
    n, p = len(v), float(v.mean())
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(min(p, max(0.0, centre - half))), float(max(p, min(1.0, centre + half)))


def win_rate(scores: list[float], baseline: list[float]) -> dict[str, float]:
    """Win rate against a baseline on the same prompts (ties count half), its 95% CI (`outcome_ci`) and n."""
    w = win_indicators(scores, baseline)
    lo, hi = outcome_ci(w)
    return {"win_rate": float(w.mean()), "ci_low": lo, "ci_high": hi, "n": int(len(w))}


def mean_ci(values: list[float], samples: int = 2000, seed: int = 0) -> dict[str, float]:
    lo, hi = bootstrap_ci(values, samples, seed=seed)
    return {"mean": float(np.mean(values)), "ci_low": lo, "ci_high": hi, "std": float(np.std(values))}


def perplexity(logprob_sums: list[float], token_counts: list[float]) -> float:
    """Token-level perplexity of a set of responses under a model: exp(-sum of token log-probs / tokens), over
    all responses together (each token counts once, so long responses weigh by their length). Jelinek et al.
    1977 / Jurafsky & Martin, Speech and Language Processing (3rd ed.), eq. 3.14: PP(W) = P(w_1..w_N)^(-1/N).
    NaN when there are no tokens."""
    tokens = float(np.sum(token_counts))
    if tokens <= 0:
        return float("nan")
    return float(np.exp(-float(np.sum(logprob_sums)) / tokens))


# --------------------------------------------------------------------------------------------- pairwise judges
OUTCOME_VALUE = {"win": 1.0, "tie": 0.5, "loss": 0.0}
MIN_SIDE = 0.1  # the length-controlled win rate: the least share of pairs on each side of equal length


def length_controlled_win_rate(values: list[float], length_diff: list[float], ridge: float = 1e-3,
                               steps: int = 100) -> float:
    """The win rate at equal length: a logistic regression of the outcome (1 win, 0.5 tie, 0 loss) on the length
    difference (policy minus baseline, divided by its standard deviation), P(win) = sigmoid(a + b x), read at x = 0:
    sigmoid(a). The idea of AlpacaEval's length-controlled win rate (Dubois et al. 2024, "Length-Controlled
    AlpacaEval", eq. 2 without the instruction term): judges prefer longer answers, and a policy that wins by
    writing more shows a lower rate here. Fitted by Newton's method on the Bernoulli log-likelihood (fractional
    targets for ties) with a small L2 penalty on (a, b), so a perfectly separated sample still has a finite fit.
    With no length difference at all, it is the plain win rate. NaN where the data cannot tell length from the
    policy: every pair differs in length by the same amount (the length term and the intercept are one column), or
    equal length lies outside the data: fewer than `MIN_SIDE` of the pairs have the policy no longer, or fewer no
    shorter, than the baseline. sigmoid(a) is then an extrapolation to where there are no pairs (with the policy
    always 40-50 tokens longer and outcomes that do not depend on length, 0.04 to 0.99 over seeds where the truth is
    0.70; before, only all wins or all losses with the policy always longer or shorter was refused); and where
    length alone decides every verdict (every win no shorter than every loss, or no longer: a judge that picks the
    longer answer, even flipping a coin at equal length), where the fit's slope runs off and sigmoid(a) is whatever
    the penalty leaves (0.22 to 0.97 over seeds where the truth at equal length is 0.5)."""
    y = np.asarray(values, dtype=float)
    d = np.asarray(length_diff, dtype=float)
    if len(y) == 0:
        return float("nan")
    sd = d.std()
    if sd == 0 and d.any():
        return float("nan")
    if sd > 0 and min(np.mean(d <= 0), np.mean(d >= 0)) < MIN_SIDE:
        return float("nan")
    wins, losses = d[y == 1], d[y == 0]
    if sd > 0 and len(wins) and len(losses) and (wins.min() >= losses.max() or wins.max() <= losses.min()):
        return float("nan")  # length alone decides every verdict: no intercept is identified
    x = d / sd if sd > 0 else np.zeros_like(d)  # not centred: x = 0 is equal length
    X = np.stack([np.ones_like(x), x], axis=1)
    w = np.zeros(2)
    for _ in range(steps):
        p = 1 / (1 + np.exp(-X @ w))
        grad = X.T @ (y - p) - ridge * w
        hess = -(X.T * (p * (1 - p))) @ X - ridge * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w = w - step
        if np.abs(step).max() < 1e-10:
            break
    return float(1 / (1 + np.exp(-w[0])))


def pairwise_summary(results: list[dict], policy_lengths: list[float], baseline_lengths: list[float],
                     gold: dict[str, tuple[list[float], list[float]]] | None = None) -> dict[str, float]:
    """A pairwise judge's verdicts on a policy against the baseline, prompt by prompt (`results`: each with
    `outcome` win / loss / tie / invalid and `verdicts` [with the policy as A, as B]):

    - win_rate (wins + ties / 2 over valid pairs) with its 95% CI (`outcome_ci`), tie_rate, invalid_rate (over all),
      and win_rate_bounds, the rate over all pairs with every invalid one a loss, and a win: invalid pairs are not
      missing at random (an endpoint's content filter refuses what a policy wrote), and leaving them out moves the
      rate anywhere between the two;
    - consistency: the share of valid pairs whose verdict did not flip with the order (both orders name the same
      response, or both say tie);
    - mean response lengths, and the length-controlled win rate (`length_controlled_win_rate`);
    - per gold judge (`gold`: name -> (policy scores, baseline scores)): agreement, the share of pairs that both
      the LLM judge and the gold judge decide (no tie) on which they decide alike, and how many that was."""
    valid = [i for i, r in enumerate(results) if r["outcome"] != "invalid"]
    values = [OUTCOME_VALUE[results[i]["outcome"]] for i in valid]
    out: dict[str, float] = {"pairs": float(len(results)), "valid": float(len(valid)),
                             "invalid_rate": 1 - len(valid) / len(results) if results else float("nan"),
                             "policy_length": float(np.mean(policy_lengths)) if policy_lengths else float("nan"),
                             "baseline_length": float(np.mean(baseline_lengths)) if baseline_lengths else float("nan")}
    invalid = len(results) - len(valid)
    if results:  # every invalid pair a loss, and a win: [0, 1] when every pair is invalid
        out["win_rate_bounds"] = [sum(values) / len(results), (sum(values) + invalid) / len(results)]
    if not valid:
        return {**out, "win_rate": float("nan"), "win_rate_ci": [float("nan"), float("nan")],
                "tie_rate": float("nan"), "consistency": float("nan"), "lc_win_rate": float("nan")}
    lo, hi = outcome_ci(values)
    flips = sum(1 for i in valid if {"A": "B", "B": "A", "tie": "tie"}[results[i]["verdicts"][0]] !=
                results[i]["verdicts"][1])
    out.update({"win_rate": float(np.mean(values)), "win_rate_ci": [lo, hi],
                "tie_rate": sum(results[i]["outcome"] == "tie" for i in valid) / len(valid),
                "consistency": 1 - flips / len(valid),
                "lc_win_rate": length_controlled_win_rate(
                    values, [policy_lengths[i] - baseline_lengths[i] for i in valid])})
    for name, (mine, theirs) in (gold or {}).items():
        decided = [(results[i]["outcome"], mine[i] > theirs[i]) for i in valid
                   if results[i]["outcome"] != "tie" and mine[i] != theirs[i]]
        out[f"agreement/{name}"] = (sum((o == "win") == better for o, better in decided) / len(decided)
                                    if decided else float("nan"))
        out[f"agreement/{name}/pairs"] = float(len(decided))
    return out


def calibration_buckets(margins: list[float], n_buckets: int = 4) -> list[dict[str, float]]:
    """Accuracy by |margin| quantile bucket (a tie, margin 0, counts half, as in every win rate): a calibrated reward
    model is more often right when it is surer."""
    ordered = sorted(margins, key=abs)
    if not ordered:
        return []
    out = []
    for chunk in np.array_split(np.asarray(ordered, dtype=float), min(n_buckets, len(ordered))):  # sizes differ by 1
        out.append({"lo": float(abs(chunk[0])), "hi": float(abs(chunk[-1])), "n": len(chunk),
                    "accuracy": float(((chunk > 0) + 0.5 * (chunk == 0)).mean())})
    return out
