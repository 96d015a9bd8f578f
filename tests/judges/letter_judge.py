"""A judge a tiny, nearly untrained policy can learn to please within a few optimiser steps: the number of
letters `e` in the response (tests/test_grpo_rloo.py names it as `letter_judge:count_e`)."""


def count_e(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(r.count("e")) for r in responses]


def constant(prompts: list[str], responses: list[str]) -> list[float]:
    """One score for every response: no group of completions can tell its members apart."""
    return [1.0 for _ in responses]


def prompt_length(prompts: list[str], responses: list[str]) -> list[float]:
    """The prompt's length: every completion of a prompt alike, prompts apart (a pass/fail judge on problems each
    always or never solved)."""
    return [float(len(p)) for p in prompts]


def logged_count_e(prompts: list[str], responses: list[str]) -> list[float]:
    """count_e, writing each call's distinct prompts (one JSON line per sampling round) to $LETTER_JUDGE_LOG."""
    import json
    import os

    with open(os.environ["LETTER_JUDGE_LOG"], "a") as f:
        f.write(json.dumps(sorted(set(prompts))) + "\n")
    return count_e(prompts, responses)


def seven_tenths(prompts: list[str], responses: list[str]) -> list[float]:
    """0.7 for every response: constant, but not exactly so in float32 once a group of 8 is averaged."""
    return [0.7 for _ in responses]
