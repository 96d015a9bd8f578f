"""Judges that a stage builds: a trained reward model as a judge, weighted sums, and `make_judge`, which turns a
pipeline's judge setting into one callable (the Python judges and the setting's rules are align/core/judges.py)."""

from __future__ import annotations

from typing import Any, Callable

from align.core.judges import Judge, judge_weights, python_judge


class RewardModelJudge:
    """A trained reward model as a judge (scores prompt + response + EOS, as it was trained)."""

    def __init__(self, model_dir: str, batch_size: int = 64, load: Callable[[str, int | None], Any] | None = None):
        """`load(path, pad_token_id)` loads the model (a stage passes its own: device, dtype, attention kernel)."""
        from align.modeling.models import load_scalar_model, load_tokenizer  # heavy (torch)

        self.tokenizer = load_tokenizer(model_dir)
        self.model = (load or load_scalar_model)(model_dir, self.tokenizer.pad_token_id).eval()
        self.batch_size = batch_size

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        from align.modeling.generation import sequence_scores  # heavy (torch)

        return sequence_scores(self.model, self.tokenizer, [p + r for p, r in zip(prompts, responses)],
                               self.batch_size)


class WeightedJudge:
    """sum_i w_i * judge_i(prompts, responses)."""

    def __init__(self, parts: dict[str, tuple[float, Judge]]):
        self.parts = parts

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        total = [0.0] * len(prompts)
        for weight, judge in self.parts.values():
            total = [t + weight * s for t, s in zip(total, judge(prompts, responses))]
        return total


def make_judge(spec: str | dict[str, float], reward_model_dir: Callable[[str], str | None],
               load: Callable[[str, int | None], Any] | None = None) -> Any:
    """The judge a stage uses: `reward_model_dir(name)` gives a reward stage's model/ (None for non-stages);
    `load` loads a reward model (RewardModelJudge)."""
    parts: dict[str, tuple[float, Judge]] = {}
    for name, weight in judge_weights(spec).items():
        path = reward_model_dir(name)
        parts[name] = (weight, RewardModelJudge(path, load=load) if path else python_judge(name))
    if len(parts) == 1 and next(iter(parts.values()))[0] == 1.0:
        return next(iter(parts.values()))[1]
    return WeightedJudge(parts)
