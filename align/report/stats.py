"""Win rates and confidence intervals for paired evaluations (pure Python + numpy)."""

from __future__ import annotations

import numpy as np


def win_indicators(scores: list[float], baseline: list[float]) -> np.ndarray:
    """Per prompt: 1 if the policy's score beats the baseline's, 0.5 for a tie, 0 for a loss."""
    a, b = np.asarray(scores, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need equal lengths, got {a.shape} and {b.shape}")
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
