"""Judges score (prompt, response) pairs. A judge is a Python function (a gold scorer such as VADER) or a
trained reward model; both return one float per pair, higher = better."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

Judge = Callable[[list[str], list[str]], list[float]]


@lru_cache(maxsize=1)
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound sentiment (-1..1) of the whole review, prompt + response (Hutto & Gilbert 2014)."""
    analyzer = _vader()
    return [analyzer.polarity_scores(p + r)["compound"] for p, r in zip(prompts, responses)]


def response_length(prompts: list[str], responses: list[str]) -> list[float]:
    """Number of words in the response (a diagnostic judge: length-hacking shows up here)."""
    return [float(len(r.split())) for r in responses]


PYTHON_JUDGES: dict[str, Judge] = {"vader": vader, "length": response_length}


class RewardModelJudge:
    """A trained reward model as a judge (scores prompt + response + EOS, as it was trained)."""

    def __init__(self, model_dir: str, batch_size: int = 64):
        from align.models import load_scalar_model, load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_scalar_model(model_dir, self.tokenizer.pad_token_id).eval()
        self.batch_size = batch_size

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        from align.generation import sequence_scores

        return sequence_scores(self.model, self.tokenizer, [p + r for p, r in zip(prompts, responses)],
                               self.batch_size)
