"""A judge a tiny, nearly untrained policy can learn to please within a few optimiser steps: the number of
letters `e` in the response (tests/test_grpo_rloo.py names it as `letter_judge:count_e`)."""


def count_e(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(r.count("e")) for r in responses]


def constant(prompts: list[str], responses: list[str]) -> list[float]:
    """One score for every response: no group of completions can tell its members apart."""
    return [1.0 for _ in responses]
