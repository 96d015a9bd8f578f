"""Judges score (prompt, response) pairs: one interface for preference labelling, PPO rewards and evaluation.

A judge is a callable ``(prompts: list[str], responses: list[str]) -> list[float]``, higher = better. Kinds:

- a built-in Python function (``vader``, ``length``);
- a user's function named ``module:function`` (imported from the Python path, e.g. a module beside the
  pipeline file when align runs from that directory, or an installed package). This is the user's own
  local code, named explicitly in the pipeline; nothing is downloaded;
- a trained reward-model stage (``RewardModelJudge``, in align/judges/pointwise.py: it loads a model);
- a weighted sum of any of these (``{reward: 1.0, vader: 0.5}`` in a pipeline); align/judges/pointwise.py
  ``build_judge`` is the one builder every stage uses.

This module loads no model and imports nothing of align but align.core (torch-free): config checks use it in the
orchestrator.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable

from align.core.userfunc import import_function

Judge = Callable[[list[str], list[str]], list[float]]


@lru_cache(maxsize=1)
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer  # optional: only when vader judges

    return SentimentIntensityAnalyzer()


def vader(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound sentiment (-1..1) of the whole review, prompt + response (Hutto & Gilbert 2014)."""
    analyzer = _vader()
    return [analyzer.polarity_scores(p + r)["compound"] for p, r in zip(prompts, responses)]


def response_length(prompts: list[str], responses: list[str]) -> list[float]:
    """Number of words in the response (a diagnostic judge: length-hacking shows up here)."""
    return [float(len(r.split())) for r in responses]


PYTHON_JUDGES: dict[str, Judge] = {"vader": vader, "length": response_length}


class JudgeError(ValueError):
    """A judge name that is neither built in, nor an importable `module:function`, nor a reward stage."""


def judge_weights(spec: str | dict[str, float]) -> dict[str, float]:
    """A judge setting as {name: weight}: a single name has weight 1."""
    return {spec: 1.0} if isinstance(spec, str) else {str(k): float(v) for k, v in spec.items()}


def python_judge(name: str) -> Judge:
    """A built-in judge, or `module:function` imported from the Python path."""
    if name in PYTHON_JUDGES:
        return PYTHON_JUDGES[name]
    if ":" not in name:
        raise JudgeError(f"'{name}' is not a judge: use a reward stage of this pipeline, a built-in judge "
                         f"({', '.join(sorted(PYTHON_JUDGES))}), or your own function as module:function")
    cwd = os.getcwd()  # the user's own module beside where align runs (searched last)
    fn = import_function(name, "judge", [cwd], JudgeError,
                         lambda path: f"looked in the working directory ({cwd}) and on the Python path: run align from "
                                      f"the directory that holds {path}, or add that directory to PYTHONPATH")
    return CheckedJudge(name, fn)


def judge_source(name: str) -> Path | None:
    """The file of a user's `module:function` judge (its content is part of the stage's fingerprint: editing the
    judge reruns the stage), or None: a built-in judge, a reward stage, or one that does not import (validation
    says why)."""
    if ":" not in name or name in PYTHON_JUDGES:
        return None
    try:
        python_judge(name)
    except JudgeError:
        return None
    file = getattr(sys.modules.get(name.partition(":")[0]), "__file__", None)
    return Path(file) if file else None


class JudgeFault(ValueError):
    """A judge that raised, or returned something other than one finite number per response."""


FLOAT32_MAX = 3.4028234663852886e38  # a larger score is inf once rewards become float32 tensors


class CheckedJudge:
    """A user's judge, called as any judge is, with what it returns checked: one real, finite number per
    response. A fault names the judge and what it did, instead of surfacing later as a NaN loss or a tensor
    error."""

    def __init__(self, name: str, fn: Judge):
        self.name, self.fn = name, fn

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        try:
            scores = self.fn(prompts, responses)
        except Exception as exc:  # the user's code: any exception is its fault, reported as the judge's
            raise JudgeFault(f"judge '{self.name}' raised {type(exc).__name__}: {exc} (called with "
                             f"{len(responses)} responses); fix the judge, or remove it from the pipeline") from exc
        if hasattr(scores, "tolist"):  # numpy array or torch tensor
            scores = scores.tolist()
        if not isinstance(scores, (list, tuple)):
            raise JudgeFault(f"judge '{self.name}' returned a {type(scores).__name__}; it must return a list of "
                             f"{len(responses)} numbers, one per response")
        if len(scores) != len(responses):
            raise JudgeFault(f"judge '{self.name}' returned {len(scores)} scores for {len(responses)} responses; "
                             "it must return one number per response, in order")
        scores = [s.item() if hasattr(s, "item") and not isinstance(s, str) else s for s in scores]  # numpy/torch
        bad = next(((i, s) for i, s in enumerate(scores)
                    if isinstance(s, bool) or not isinstance(s, numbers.Real)), None)
        if bad:
            raise JudgeFault(f"judge '{self.name}' returned {bad[1]!r} ({type(bad[1]).__name__}) for response "
                             f"{bad[0]}; every score must be a number")
        bad = next(((i, s) for i, s in enumerate(scores) if abs(s) > FLOAT32_MAX or not math.isfinite(s)), None)
        if bad:
            raise JudgeFault(f"judge '{self.name}' returned {bad[1]} for response {bad[0]} "
                             f"({responses[bad[0]][:60]!r}); every score must be a finite number within float32's "
                             f"range (±{FLOAT32_MAX:.3g}), in which rewards are computed")
        return [float(s) for s in scores]


def check_judges(spec: str | dict[str, float], reward_stages: set[str], other_stages: dict[str, str]) -> None:
    """Validation: every name is a reward stage or a Python judge; weights are finite numbers."""
    weights = judge_weights(spec)
    if not weights:
        raise JudgeError("no judge given: name a reward stage or a judge such as vader")
    for name, w in weights.items():
        if w != w or w in (float("inf"), float("-inf")):
            raise JudgeError(f"judge '{name}': weight {w} is not a finite number")
        if name in reward_stages:
            continue
        if name in other_stages:
            raise JudgeError(f"'{name}' is a {other_stages[name]} stage, not a reward stage; a judge is a reward "
                             f"stage ({', '.join(sorted(reward_stages)) or 'none in this pipeline'}) or a Python "
                             "judge")
        python_judge(name)
    if all(w == 0 for w in weights.values()):
        raise JudgeError(f"every weight of {dict(weights)} is 0: the reward would be a constant and nothing would "
                         "be learned; give at least one judge a non-zero weight")
