"""Held-out pairs scored over several processes (the reward stage's held-out accuracy and evaluate's reward-model
metrics): each process scores every world-th batch of pairs and the scores are gathered, so both processes return
exactly what one process returns (tests/probes/heldout_probe.py, 2 processes over gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

PROBE = REPO / "tests" / "probes" / "heldout_probe.py"
SEED = 20261128


def test_two_processes_score_disjoint_batches_and_return_what_one_process_returns(tmp_path):
    sys.path.insert(0, str(PROBE.parent))
    from heldout_probe import StandInJudge, pairs

    from align.judges.pointwise import pairwise_accuracy

    print(f"seed {SEED}")
    rows = pairs(SEED)
    one = StandInJudge()
    alone = pairwise_accuracy(one, rows)
    # by hand: the stand-in's scores, batch by batch of 3 (the last batch holds one pair)
    chosen = [len(r["prompt"]) * 0.1 + len(r["chosen"]) + 0.01 * len(rows[i - i % 3:i - i % 3 + 3])
              for i, r in enumerate(rows)]
    rejected = [len(r["prompt"]) * 0.1 + len(r["rejected"]) + 0.01 * len(rows[i - i % 3:i - i % 3 + 3])
                for i, r in enumerate(rows)]
    assert alone["chosen_scores"] == pytest.approx(chosen, abs=1e-12)
    assert alone["accuracy"] == sum((c > r) + 0.5 * (c == r) for c, r in zip(chosen, rejected)) / len(rows)  # tie: half
    assert alone["ties"] == sum(c == r for c, r in zip(chosen, rejected)) == 1  # the seed gives one
    assert 0 < alone["accuracy"] < 1  # the seed gives both outcomes

    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(PROBE), str(r), str(store), str(SEED), str(outs[r])], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    for p in procs:
        log = p.communicate(timeout=120)[0].decode()
        assert p.returncode == 0, log[-3000:]
    shares = [json.loads(o.read_text()) for o in outs]
    for share in shares:
        assert share["result"] == json.loads(json.dumps(alone))  # every field, exactly
    # each process scored its own batches (0-2 and 6-8; 3-5 and 9), chosen then rejected, and nothing twice
    scored = [s["batches"] for s in shares]
    assert scored[0] == [[r["chosen"] for r in rows[0:3]], [r["rejected"] for r in rows[0:3]],
                         [r["chosen"] for r in rows[6:9]], [r["rejected"] for r in rows[6:9]]]
    assert scored[1] == [[r["chosen"] for r in rows[3:6]], [r["rejected"] for r in rows[3:6]],
                         [rows[9]["chosen"]], [rows[9]["rejected"]]]
