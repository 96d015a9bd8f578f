"""One process of a two-process job (gloo) scoring held-out pairs with align/judges/pointwise.py `pairwise_accuracy`
and a stand-in reward model: `python heldout_probe.py RANK STORE SEED OUT`; writes the result and the batches this
process scored to OUT (JSON)."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from align.judges.pointwise import pairwise_accuracy


class StandInJudge:
    """Scores a text by its length, plus a term that depends on how many texts share its batch: a share scored in
    batches other than one process's would give other floats."""

    batch_size = 3

    def __init__(self):
        self.batches: list[list[str]] = []

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        self.batches.append(list(responses))
        return [len(p) * 0.1 + len(r) + 0.01 * len(responses) for p, r in zip(prompts, responses)]


def pairs(seed: int, n: int = 10) -> list[dict]:
    import random

    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 9)))  # noqa: E731
    return [{"prompt": f"p{i} {word()}", "chosen": word(), "rejected": word()} for i in range(n)]


def main(rank: int, store: str, seed: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    judge = StandInJudge()
    result = pairwise_accuracy(judge, pairs(seed), rank, 2)
    with open(out, "w") as f:
        json.dump({"result": result, "batches": judge.batches}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
