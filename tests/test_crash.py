"""SIGKILL every trainable stage (sft, reward, dpo, ppo) during training, at two deterministic points each.

Each trial starts the stage through `align run` (the first on a fresh stage, the second with --force over the
previous completed output) and kills the whole process group at a point defined by what is on disk, not by
the clock: (1) as soon as the first complete checkpoint of this attempt exists, (2) as soon as training has
started (before any checkpoint). Then: the killed attempt is never recorded as completed, so no later stage
can consume it; `model/` is either the previous complete output (byte-identical) or absent, never a partial
directory; and the next `align run` completes with a model/ that loads, resuming from exactly the newest
complete checkpoint that existed at the kill (in trial 1 there always is one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, align_cmd, complete_checkpoints, run_align

pytestmark = pytest.mark.slow

ARGS = ["run", "pipelines/default.yaml", "--run-id", "crash", "tracking.wandb=disabled", *TINY,
        "sft.max_steps=80", "sft.save_steps=20", "sft.logging_steps=10", "sft.eval_split=null",
        "reward.max_steps=160", "reward.save_steps=40", "reward.logging_steps=20",
        "dpo.max_steps=100", "dpo.save_steps=20", "dpo.logging_steps=10",
        "ppo.iterations=16", "ppo.save_every=2"]
FINAL = {"sft": 80, "reward": 160, "dpo": 100, "ppo": 16}  # 4 checkpoints each: room for the kill before the end
KILL_POINTS = ("first_checkpoint", "training_started")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    return root, root / "runs" / "default" / "crash"


def _manifest(stage_dir: Path) -> dict:
    p = stage_dir / "manifest.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _digest(model_dir: Path) -> str | None:
    if not model_dir.exists():
        return None
    h = hashlib.sha256()
    for f in sorted(model_dir.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(model_dir).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _training_started(stage_dir: Path, since: float) -> bool:
    stamp = stage_dir / "checkpoints" / "FINGERPRINT"  # written just before the first training step
    try:
        return stamp.stat().st_mtime >= since
    except FileNotFoundError:
        return False


def _ensure(root: Path, run: Path, stage: str) -> None:
    if _manifest(run / stage).get("status") != "completed":
        proc = run_align(*ARGS, "--only", stage, cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _kill_trials(project, stage: str, load) -> list[dict]:
    root, run = project
    stage_dir = run / stage
    done: list[dict] = []
    for point in KILL_POINTS:
        before = _digest(stage_dir / "model")
        force = ["--force"] if _manifest(stage_dir).get("status") == "completed" else []
        t_launch = time.time() - 1  # filesystem mtimes can be coarse
        proc = subprocess.Popen(align_cmd(*ARGS, "--only", stage, *force), cwd=root, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
        try:
            while not _training_started(stage_dir, t_launch) or (
                    point == "first_checkpoint" and not complete_checkpoints(stage_dir / "checkpoints")):
                assert proc.poll() is None, f"{stage}: the stage exited before the kill point {point}"
                assert time.time() - t_launch < 180, f"{stage}: kill point {point} not reached in 180 s"
                time.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):  # exited already: the assertion above says why
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        m = _manifest(stage_dir)
        assert m.get("status") == "running", f"{stage}: a killed attempt must not look completed: {m.get('status')}"
        after = _digest(stage_dir / "model")
        assert after == before, f"{stage}: model/ changed although the attempt was killed"
        ckpts = complete_checkpoints(stage_dir / "checkpoints")
        if point == "first_checkpoint":
            assert ckpts, f"{stage}: no complete checkpoint survived the kill"
        again = run_align(*ARGS, "--only", stage, cwd=root)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        m = _manifest(stage_dir)
        assert m["status"] == "completed"
        assert m["process"]["start"] == "fresh"  # one stage per run: a fresh process (align/orchestrator/warm.py)
        assert m.get("global_step", m["final_metrics"].get("ppo/iterations_run")) == FINAL[stage]  # ran to the end
        resumed = m.get("resumed_from_step", m.get("resumed_from_iteration", 0))
        assert resumed == (max(ckpts) if ckpts else 0), (stage, point, ckpts, resumed)
        load(stage_dir / "model")
        done.append({"kill": point, "checkpoints": ckpts, "resumed": resumed})
    print(f"{stage}: {done}")
    return done


def _lm(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path)


def _scalar(path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(path)


def test_sft_survives_kills(project):
    assert [t["kill"] for t in _kill_trials(project, "sft", _lm)] == list(KILL_POINTS)


def test_reward_survives_kills(project):
    root, run = project
    for dep in ("sft", "preferences"):
        _ensure(root, run, dep)
    assert [t["kill"] for t in _kill_trials(project, "reward", _scalar)] == list(KILL_POINTS)


def test_dpo_survives_kills(project):
    root, run = project
    for dep in ("sft", "preferences"):
        _ensure(root, run, dep)
    assert [t["kill"] for t in _kill_trials(project, "dpo", _lm)] == list(KILL_POINTS)


def test_ppo_survives_kills(project):
    root, run = project
    for dep in ("sft", "preferences", "reward"):
        _ensure(root, run, dep)
    assert [t["kill"] for t in _kill_trials(project, "ppo", _lm)] == list(KILL_POINTS)
