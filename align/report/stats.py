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
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of `values`."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(samples, len(v)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def win_rate(scores: list[float], baseline: list[float], samples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Win rate against a baseline on the same prompts (ties count half), its 95% CI and n."""
    w = win_indicators(scores, baseline)
    lo, hi = bootstrap_ci(w, samples, seed=seed)
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
    the outcomes are all wins (or all losses) with the policy always longer (or always shorter): equal length is
    then outside the data and any sigmoid(a) fits it, the penalty alone would choose one."""
    y = np.asarray(values, dtype=float)
    d = np.asarray(length_diff, dtype=float)
    if len(y) == 0:
        return float("nan")
    sd = d.std()
    if sd == 0 and d.any():
        return float("nan")
    if (np.all(y == 1) or np.all(y == 0)) and (np.all(d > 0) or np.all(d < 0)):
        return float("nan")
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
                     samples: int = 2000, seed: int = 0,
                     gold: dict[str, tuple[list[float], list[float]]] | None = None) -> dict[str, float]:
    """A pairwise judge's verdicts on a policy against the baseline, prompt by prompt (`results`: each with
    `outcome` win / loss / tie / invalid and `verdicts` [with the policy as A, as B]):

    - win_rate (wins + ties / 2 over valid pairs) with its 95% bootstrap CI, tie_rate, invalid_rate (over all);
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
    if not valid:
        return {**out, "win_rate": float("nan"), "win_rate_ci": [float("nan"), float("nan")],
                "tie_rate": float("nan"), "consistency": float("nan"), "lc_win_rate": float("nan")}
    lo, hi = bootstrap_ci(values, samples, seed=seed)
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
    """Accuracy by |margin| quantile bucket: a calibrated reward model is more often right when it is surer."""
    ordered = sorted(margins, key=abs)
    if not ordered:
        return []
    out = []
    for chunk in np.array_split(np.asarray(ordered, dtype=float), min(n_buckets, len(ordered))):  # sizes differ by 1
        out.append({"lo": float(abs(chunk[0])), "hi": float(abs(chunk[-1])), "n": len(chunk),
                    "accuracy": float((chunk > 0).mean())})
    return out
