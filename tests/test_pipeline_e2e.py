"""The default pipeline end to end, at smoke size, through the CLI as a user runs it.

One module-scoped run serves several tests (each stage: parameters changed, loss fell; offline W&B; no
secrets on disk); then re-runs check skipping by fingerprint and downstream-only reruns.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, TINY, run_align

pytestmark = pytest.mark.slow

FAKE_WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
FAKE_HF_TOKEN = "hf_DoNotLeakThisTokenAnywhere12345"
STAGES = ["sft", "preferences", "reward", "ppo", "dpo", "evaluate"]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    # PPO with the fused LM head (auto keeps it off on a CPU; every other PPO run in the suite takes the logits path)
    args = ["run", "pipelines/default.yaml", "--run-id", "e2e", "tracking.wandb=offline", *TINY, "ppo.fused_head=on"]
    t0 = time.time()
    proc = run_align(*args, cwd=root, env={"WANDB_API_KEY": FAKE_WANDB_KEY, "HF_TOKEN": FAKE_HF_TOKEN})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, "run": root / "runs" / "default" / "e2e", "args": args, "first": proc,
            "seconds": time.time() - t0}


@pytest.fixture
def private(e2e, tmp_path):
    """A copy of the shared run in a project of its own, for tests that rerun or rewrite stages: the tests of
    this module then pass in any order."""
    import shutil

    root = tmp_path / "project"
    root.mkdir()
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    shutil.copytree(e2e["run"], root / "runs" / "default" / "e2e")
    return {**e2e, "root": root, "run": root / "runs" / "default" / "e2e"}


def _manifest(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


def _metrics(run: Path, stage: str) -> list[dict]:
    return [json.loads(x) for x in (run / stage / "metrics.jsonl").read_text().splitlines()]


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_every_stage_completed_with_outputs(e2e):
    run = e2e["run"]
    for stage in STAGES:
        m = _manifest(run, stage)
        assert m["status"] == "completed" and m["fingerprint"]
        for out in m["outputs"]:
            assert (run / stage / out).exists()
    assert "[align] stage 1/6 sft (sft): running" in e2e["first"].stdout
    report = json.loads((run / "report" / "metrics.json").read_text())
    for key in ("eval/sft/vader/mean", "eval/dpo/vader/mean", "eval/dpo/kl", "eval/dpo/vader/win_rate",
                "eval/dpo/reward_model/win_rate", "eval/reward_model/accuracy"):
        assert key in report


def test_sft_learned_from_a_fresh_model(e2e):
    from transformers import AutoTokenizer

    from align.config import BuiltinModel
    from align.modeling.models import build_builtin

    run = e2e["run"]
    losses = [r["train/loss"] for r in _metrics(run, "sft") if "train/loss" in r]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5
    tok = AutoTokenizer.from_pretrained(run / "sft" / "model")
    size = BuiltinModel(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96)
    initial = build_builtin(size, tok, seed=17).state_dict()
    trained = _state(run / "sft" / "model")
    changed = [k for k, v in trained.items() if not torch.equal(v, initial[k])]
    assert len(changed) == len(trained), "every parameter should have moved"


@pytest.mark.parametrize("stage", ["reward", "ppo", "dpo"])
def test_stage_changed_parameters_of_its_sft_start(e2e, stage):
    run = e2e["run"]
    sft, after = _state(run / "sft" / "model"), _state(run / stage / "model")
    shared = [k for k in after if k in sft and after[k].shape == sft[k].shape]
    assert shared
    assert all(not torch.equal(after[k], sft[k]) for k in shared if "layers" in k)
    rows = _metrics(run, stage)
    assert any("train/loss" in r for r in rows)


def test_preference_pairs_are_ordered_by_the_judge(e2e):
    data = e2e["run"] / "preferences" / "data"
    pairs = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert pairs
    assert all(p["score_chosen"] - p["score_rejected"] >= 0.05 for p in pairs)
    m = _manifest(e2e["run"], "preferences")["final_metrics"]
    assert m["preferences/pairs_train"] + m["preferences/pairs_test"] + m["preferences/ties_dropped"] == 128
    # every non-tied pair of the training prompts' samples: the best-vs-worst pairs among them, and more
    every = [json.loads(x) for x in (data / "train_all_pairs.jsonl").read_text().splitlines()]
    assert len(every) == m["preferences/all_pairs_train"] > len(pairs)
    assert all(p["score_chosen"] - p["score_rejected"] >= 0.05 for p in every)
    key = lambda p: (p["prompt"], p["chosen"], p["rejected"])  # noqa: E731
    assert {key(p) for p in pairs} <= {key(p) for p in every}
    test_prompts = {json.loads(x)["prompt"] for x in (data / "test.jsonl").read_text().splitlines()}
    assert not test_prompts & {p["prompt"] for p in every}  # held-out prompts stay held out


@pytest.mark.distributed
def test_preferences_on_two_processes_sample_what_one_process_samples(private):
    """The preference stage over 2 processes (plain data parallel, gloo): each takes every other length-sorted batch
    and the records are gathered back in prompt order; each batch is sampled with its own seed (its first prompt's
    index), so the samples, their scores and the pairs equal the one-process run's."""
    run = private["run"]
    data = run / "preferences" / "data"
    one = {name: (data / f"{name}.jsonl").read_text() for name in ("samples", "train", "test")}
    two = run_align(*private["args"], "--only", "preferences", "preferences.accelerate=ddp",
                    "preferences.num_processes=2", cwd=private["root"])
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    manifest = _manifest(run, "preferences")
    assert manifest["status"] == "completed" and manifest["world_size"] == 2, manifest
    for name, text in one.items():
        assert (data / f"{name}.jsonl").read_text() == text, name


def test_ppo_logs_every_iteration_with_shared_metric_names(e2e):
    rows = [r for r in _metrics(e2e["run"], "ppo") if "objective/kl" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("objective/scores", "objective/kl", "objective/kl_coef", "objective/rlhf_reward",
                "policy/approx_kl", "policy/clipfrac", "policy/entropy", "value/loss", "value/clipfrac",
                "rollout/response_length", "rollout/eos_fraction", "perf/episodes_per_s", "perf/tokens_per_s",
                "objective/penalties", "policy/grad_norm", "value/grad_norm", "perf/generation_fraction"):
        assert all(key in r for r in rows), key
    for r in rows:  # NeMo-RL's split of an iteration: every phase took time, together no more than the iteration
        phases = [r[f"perf/{p}_seconds"] for p in ("weight_sync", "generation", "scoring", "training", "heldout")]
        assert phases[0] == 0 and all(x > 0 for x in phases[1:]), phases  # the hf engine has nothing to sync
        elapsed = r["perf/generation_seconds"] / r["perf/generation_fraction"]  # one process: the iteration
        assert sum(phases) <= elapsed * 1.001, (phases, elapsed)
        assert sum(phases) >= 0.8 * elapsed, (phases, elapsed)  # the split accounts for most of the iteration
    final = _manifest(e2e["run"], "ppo")["final_metrics"]
    assert final["ppo/iterations_run"] == 4 and "objective/scores_last" in final
    # what the policy ran with, as resolved: SDPA (attn_implementation auto), fp32 here (no autocast on this CPU)
    assert _manifest(e2e["run"], "ppo")["kernels"] == {"fused_head": {"policy": True, "reference": True},
                                                        "attention": "sdpa", "autocast": "no"}


def test_offline_wandb_run_per_stage(e2e):
    for stage in STAGES:
        runs = list((e2e["run"] / stage / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, stage
        assert any(f.suffix == ".wandb" and f.stat().st_size > 0 for f in runs[0].iterdir())
        assert _manifest(e2e["run"], stage)["wandb"]["mode"] == "offline"
        assert _manifest(e2e["run"], stage)["process"]["start"] == "warm"  # six one-process stages: forked


def test_no_secret_written_anywhere(e2e):
    leaked = []
    for path in e2e["root"].joinpath("runs").rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            if FAKE_WANDB_KEY.encode() in blob or FAKE_HF_TOKEN.encode() in blob:
                leaked.append(str(path))
    assert leaked == []


def test_align_status_lists_every_stage_and_notices_a_stale_one(e2e, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(e2e["run"], copy)  # a copy, as this test edits it
    proc = run_align("status", str(copy), cwd=e2e["root"])
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "stage" not in line}
    assert list(rows) == STAGES
    for stage, (kind, state, fingerprint, attempts, duration, _headline) in rows.items():
        assert (kind, state, fingerprint, attempts) == (stage, "completed", "current", "1"), stage
        assert duration.endswith("s")
    scores_last = _manifest(copy, "ppo")["final_metrics"]["objective/scores_last"]
    assert f"objective/scores_last {scores_last:.4g}" in rows["ppo"][5]
    m = _manifest(copy, "dpo")
    m["fingerprint"] = "0" * 20  # as if trained under another config or code version
    (copy / "dpo" / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(copy / "reward" / "model")
    out = run_align("status", str(copy), cwd=e2e["root"]).stdout
    assert "| dpo | dpo | completed | stale (config, data or code changed) |" in out
    assert "| reward | reward | completed, output missing |" in out
    bad = run_align("status", str(tmp_path / "nowhere"), cwd=e2e["root"])
    assert bad.returncode == 2 and "not a readable run directory" in bad.stderr and "Traceback" not in bad.stderr


def test_rerun_skips_everything_then_beta_reruns_only_downstream(private):
    run = private["run"]
    before = {s: _manifest(run, s)["attempts"] for s in STAGES}
    again = run_align(*private["args"], cwd=private["root"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("skipped") == 6 and "running" not in again.stdout
    assert {s: _manifest(run, s)["attempts"] for s in STAGES} == before

    changed = run_align(*private["args"], "dpo.beta=0.3", cwd=private["root"])
    assert changed.returncode == 0, changed.stderr[-2000:]
    ran = {s for s in STAGES if f"{s} ({s}): running" in changed.stdout}
    assert ran == {"dpo", "evaluate"}
    assert _manifest(run, "dpo")["config"]["beta"] == 0.3


@pytest.mark.parametrize("override, message", [
    ("sft.data=../data_cards/missing.yaml", "neither a stage nor a data card"),
    ("dpo.policy=sfft", "did you mean 'sft'"),
    ("sft.model=dpo", "dependency cycle"),
    ("dpo.bta=0.1", "did you mean 'beta'"),
    ("preferences.samples_per_prompt=1", "stages.preferences.samples_per_prompt: 1 is not allowed: must be >= 2"),
    ("reward.split=train_all", "stages.reward: reads split 'train_all' of stage 'preferences' (data)"),
])
def test_bad_input_fails_fast_and_keeps_completed_stages(e2e, override, message):
    run = e2e["run"]
    snapshot = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    proc = run_align(*e2e["args"], override, cwd=e2e["root"])
    assert proc.returncode == 2
    assert message in proc.stderr and "running" not in proc.stdout  # refused before any stage started
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == snapshot


def test_a_refused_only_run_leaves_the_runs_record_as_it_was(private):
    """`--only evaluate` with an upstream setting changed is refused (dpo is not completed with that config), but
    pipeline.json was rewritten first: `align status` then called every stage stale, a sweep's variants vanished
    from it, and `align report` rebuilt the report from the refused command's config."""
    record = private["run"] / "pipeline.json"
    before = record.read_bytes()
    proc = run_align(*private["args"], "--only", "evaluate", "dpo.beta=0.3", cwd=private["root"])
    assert proc.returncode == 2 and "stage 'evaluate' needs stage 'dpo' completed" in proc.stderr, proc.stderr[-2000:]
    assert record.read_bytes() == before


def test_from_a_stage_whose_other_input_was_made_under_other_overrides_is_refused_before_anything_trains(private):
    """`align run p --from ppo` after a run with dpo.beta=0.2 (the README's own sequence, without the override): ppo
    retrained, then evaluate refused, as dpo was not completed with this command's config. Every input this command
    does not produce is checked before any stage starts, and the message gives the command that would run it."""
    run = private["run"]
    snapshot = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".align.lock"}
    proc = run_align(*private["args"], "--from", "ppo", "dpo.beta=0.3", cwd=private["root"])
    assert proc.returncode == 2 and "stage 'evaluate' needs stage 'dpo' completed" in proc.stderr, proc.stderr[-2000:]
    assert "dpo.beta=0.3 --from dpo`" in proc.stderr and "running" not in proc.stdout, proc.stdout[-2000:]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".align.lock"} == snapshot


def test_a_run_that_launches_nothing_keeps_the_runs_record(private):
    """`align run p --only sft dpo.beta=0.3` skipped sft (up to date) and rewrote pipeline.json with its command and
    config: `align status` then called dpo and evaluate stale though no file had changed, its resume hint lost the
    run's own command, and `align report` would rebuild from a config dpo was not trained with."""
    record = private["run"] / "pipeline.json"
    before = record.read_bytes()
    proc = run_align(*private["args"], "--only", "sft", "dpo.beta=0.3", cwd=private["root"])
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc.stderr[-2000:]
    assert record.read_bytes() == before
    status = run_align("status", str(private["run"]), cwd=private["root"])
    assert "stale" not in status.stdout, status.stdout


def test_report_has_plots_and_tables(e2e):
    report = e2e["run"] / "report"
    for name in ("metrics.json", "report.md", "win_rates.png", "reward_vs_kl_vader.png",
                 "reward_vs_kl_reward_model.png"):
        assert (report / name).is_file(), name
    assert (report / "win_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (report / "report.md").read_text()
    assert "| policy |" in text and "| ppo |" in text and "| dpo |" in text
    assert "| perplexity under sft |" in text
    metrics = json.loads((report / "metrics.json").read_text())
    for policy in ("sft", "ppo", "dpo"):  # of ~12-token samples of a barely trained 512-token model: > 1, finite
        assert 1.0 < metrics[f"eval/{policy}/ref_perplexity"] < 512, policy
    assert "[align] headline" in e2e["first"].stdout


def test_align_report_rebuilds_without_training_and_refuses_incomplete_models(private, tmp_path):
    import shutil

    run = private["run"]
    before = {s: _manifest(run, s)["attempts"] for s in ("sft", "reward", "ppo", "dpo")}
    old = (run / "report" / "metrics.json").stat().st_mtime_ns
    proc = run_align("report", str(run), cwd=private["root"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (run / "report" / "metrics.json").stat().st_mtime_ns > old
    assert {s: _manifest(run, s)["attempts"] for s in before} == before  # nothing retrained

    copy = tmp_path / "runs" / "default" / "e2e"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "dpo" / "model")
    proc = run_align("report", str(copy), cwd=private["root"])
    assert proc.returncode == 2
    assert "dpo" in proc.stderr and "missing or incomplete" in proc.stderr


def test_ppo_killed_mid_run_resumes_iteration_beta_and_statistics(private):
    """Retrains ppo with a longer config in a private copy of the run, kills it after its first complete
    checkpoint, and resumes."""
    e2e = private
    import os
    import signal
    import subprocess

    from conftest import align_cmd

    args = [*e2e["args"], "--only", "ppo", "ppo.iterations=120", "ppo.save_every=3", "ppo.kl.controller=ziegler",
            "ppo.kl.horizon=50", "tracking.wandb=disabled"]
    stage = e2e["run"] / "ppo"
    proc = subprocess.Popen(align_cmd(*args), cwd=e2e["root"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        def new_checkpoint() -> bool:  # of this run (every 3 iterations), not the finished run's iter-2
            m = json.loads((stage / "manifest.json").read_text())
            return m["status"] == "running" and any(
                (p / "COMPLETE").is_file() and int(p.name[5:]) % 3 == 0 for p in (stage / "checkpoints").glob("iter-*"))

        while not new_checkpoint():
            assert proc.poll() is None, "ppo finished before it could be killed"
            assert time.time() - t0 < 300
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = _manifest(e2e["run"], "ppo")
    assert killed["status"] == "running"
    fitted = killed["reward_normalization"]  # fixed once, from initial-policy rollouts, before iteration 1
    assert fitted["fitted_at_iteration"] == 0 and fitted["gain"] > 0
    before = [r for r in _metrics(e2e["run"], "ppo") if "objective/kl_coef" in r]

    again = run_align(*args, cwd=e2e["root"])
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    m = _manifest(e2e["run"], "ppo")
    start = m["resumed_from_iteration"]
    assert m["status"] == "completed" and start >= 3 and start % 3 == 0
    all_rows = [r for r in _metrics(e2e["run"], "ppo") if "objective/kl_coef" in r]
    assert [r["step"] for r in all_rows] == list(range(1, 121))  # one row per iteration, none twice
    rows = [r for r in all_rows if r["step"] > start]
    restored = m["reward_normalization"]  # restored from the checkpoint, not refitted on the trained policy
    assert restored["restored_at_iteration"] == start
    assert (restored["gain"], restored["bias"]) == (fitted["gain"], fitted["bias"])
    assert "reward normalisation from" not in again.stdout + again.stderr
    assert m["final_metrics"]["ppo/iterations_run"] == 120
    beta_at_start = next(r["objective/kl_coef"] for r in before if r["step"] == start)
    assert abs(beta_at_start / 0.05 - 1) > 0.05  # beta had moved away from its initial value...
    assert abs(rows[0]["objective/kl_coef"] / beta_at_start - 1) <= 16 / 50 * 0.2 + 1e-9  # ...and continued


def test_ppo_pushed_hard_ends_inside_kl_max_where_the_old_controller_ends_far_outside(private):
    """Issue 39: PPO pushed hard (learning rate 4e-2, beta 0.001, 8 iterations) on the tiny run. With Ziegler's
    controller and no budget, the KL after the last update, on held-out prompts, ends far outside 15 nats; with
    kl.max 15 (and the PI controller) the stage undoes the update that left the budget, stops, publishes the last
    policy inside it, and the evaluation (other prompts: the test split) measures that policy inside 15 too.
    (Until 2026-11-27 this ran at 3e-2 and kl.max 8; padding-free forwards changed the float rounding, and this
    chaotic trajectory with it. Until 2026-11-29 kl.max was 10: splits by each prompt's hash changed the tiny run's
    data, and the first update then reached 11.3 nats. Until 2026-11-30 it ran at 3.5e-2: each preferences stage's
    own sampling seed changed the tiny run's pairs, and that trajectory peaked at 12.7 nats and came back to 7.1; at
    6e-2 the next seed's peaked at 23.7 and came back to 7.7. Until 2026-12-01 it ran at 5e-2: prompts held out by
    their hash in the preferences stage changed the tiny run's pairs, and that trajectory ended at 17.6 nats, inside
    1.25 x 15; at 4e-2 it climbs to 26.0, and the budget stops it at iteration 3.)"""
    e2e, kl_max = private, 15.0
    seed = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())["seed"]
    print(f"seed {seed} (the pipeline's)")
    hard = ["ppo.iterations=8", "ppo.learning_rate=4e-2", "ppo.kl.coef=0.001", "tracking.wandb=disabled"]
    old = run_align(*e2e["args"], "--only", "ppo", *hard, "ppo.kl.controller=ziegler", cwd=e2e["root"])
    assert old.returncode == 0, old.stdout[-2000:] + old.stderr[-2000:]
    old_rows = [r for r in _metrics(e2e["run"], "ppo") if "heldout/kl" in r]
    assert [r["step"] for r in old_rows] == list(range(1, 9))
    print("old controller, held-out KL per iteration:", [round(r["heldout/kl"], 2) for r in old_rows])
    assert old_rows[-1]["heldout/kl"] > 1.25 * kl_max

    budget = [*hard, f"ppo.kl.max={kl_max}", "ppo.kl.target=5"]
    new = run_align(*e2e["args"], "--only", "ppo", *budget, cwd=e2e["root"])
    assert new.returncode == 0, new.stdout[-2000:] + new.stderr[-2000:]
    rows = [r for r in _metrics(e2e["run"], "ppo") if "heldout/kl" in r]
    final = _manifest(e2e["run"], "ppo")["final_metrics"]
    print(f"kl.max {kl_max}, held-out KL per iteration:", [round(r["heldout/kl"], 2) for r in rows], final)
    published = final["kl_budget/published_iteration"]
    assert final["kl_budget/stopped"] is True and 1 <= published < len(rows) == final["kl_budget/undone_iteration"]
    assert rows[-1]["heldout/kl_upper"] > kl_max and rows[-1]["heldout/over_budget"] == 1.0
    assert all(r["heldout/kl_upper"] <= kl_max for r in rows[:-1])
    assert final["heldout/kl_last"] == rows[published - 1]["heldout/kl"] <= kl_max
    # beta as the published policy left it (the undone iteration ran with it), not moved by the KL of an undone update
    assert final["objective/kl_coef_final"] == rows[-1]["objective/kl_coef"] != rows[-2]["objective/kl_coef"]
    assert "kl_budget/undone_iteration" in new.stdout  # the console's result line says it stopped
    assert f"Publishing the policy after iteration {published}" in (e2e["run"] / "ppo" / "stage.log").read_text()

    ev = run_align(*e2e["args"], "--only", "evaluate", *budget, cwd=e2e["root"])
    assert ev.returncode == 0, ev.stdout[-2000:] + ev.stderr[-2000:]
    evaluated = _manifest(e2e["run"], "evaluate")["final_metrics"]["eval/ppo/kl"]
    print(f"evaluation KL of the published policy: {evaluated:.2f}")
    assert 0 < evaluated <= kl_max


def test_ppo_vs_rloo_benchmark_runs_on_the_tiny_run(e2e, tmp_path):
    """benchmarks/ppo_vs_rloo.py on this module's sft and reward models, in a tiny mode (2 iterations of 8
    episodes, the first a warm-up): the four trainers (align's PPO twice: separate value model, shared value
    head) time their second iteration and the table prints, with PPO's share of time generating."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ppo_vs_rloo.py"), "--run-dir", str(e2e["run"]),
                           "--iterations", "2", "--batch", "8", "--mini-batch", "4", "--epochs", "1",
                           "--max-new-tokens", "6", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"align PPO", "align PPO, shared value head", "TRL RLOO", "TRL GRPO"}
    for name, r in results.items():
        assert r["episodes"] == 8 and r["seconds"] > 0 and r["tokens"] > 0, (name, r)
    assert 0 < results["align PPO"]["generation_fraction"] < 1
    assert 0 < results["align PPO, shared value head"]["generation_fraction"] < 1
    for name in results:
        assert f"| {name} |" in proc.stdout, name


ENGINETYPES = Path(__file__).resolve().parent / "enginetypes"


def test_a_third_engine_from_outside_align_samples_for_ppo_and_evaluate(private):
    """Adding a rollout engine touches no file under align/: tests/enginetypes/copy_engine.py (its kind and its
    class, one file) is found through ALIGN_ENGINE_MODULES; `align validate` accepts it where every engine is, PPO
    starts it from the SFT model, syncs it after every update and checks its log-probs against the trainer's, and
    evaluate samples every policy through it; with generation.sleep it sleeps while the policy trains (the suite's CPU
    twin of vLLM's sleep mode). Without the module the name is refused before anything runs."""
    import os

    overrides = ["ppo.generation.engine=copy", "evaluate.generation.engine=copy", "ppo.iterations=2"]
    unknown = run_align(*private["args"], *overrides, cwd=private["root"])
    assert unknown.returncode == 2 and "generation.engine: 'copy' is not allowed: must be one of hf, vllm" \
        in unknown.stderr, unknown.stderr[-2000:]
    env = {"ALIGN_ENGINE_MODULES": "copy_engine",
           "PYTHONPATH": os.pathsep.join([str(ENGINETYPES), str(REPO), os.environ.get("PYTHONPATH", "")])}
    refused = run_align("validate", "pipelines/online_rl.yaml", "grpo.generation.engine=copy", cwd=private["root"],
                        env=env)
    assert refused.returncode == 2 and "'copy' is not available for stage type 'grpo'" in refused.stderr, \
        refused.stdout + refused.stderr

    ran = run_align(*private["args"], *overrides, "ppo.generation.sleep=true", cwd=private["root"], env=env)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    run = private["run"]
    ppo = _manifest(run, "ppo")
    assert ppo["engine"] == {"kind": "copy", "parameters": sum(v.numel() for v in _state(run / "sft" / "model").values())}
    log = (run / "ppo" / "engine.rank0.log").read_text().splitlines()
    assert log[0] == f"start {run / 'sft' / 'model'}" and log[-1] == "close"
    assert log.count("sync") >= 2  # before the first rollout and after each of the two updates' rollouts
    # generation.sleep: the engine put its weights away whenever it had sampled, before any model computed on the
    # samples (the reward scale's rollouts once, then each iteration's rollout and its held-out samples), and was
    # woken by the next sync (its weights back before the sync loads the update into them) or sampling
    calls = [line.split()[0] for line in log]
    assert calls.count("sleep") == 1 + 2 * 2 and calls.index("sleep") > calls.index("generate"), log
    after = [calls[i + 1:i + 3] for i, x in enumerate(calls) if x == "sleep"]
    assert all(a in (["wake", "sync"], ["wake", "generate"], ["close"]) for a in after), log
    assert after[0] == ["wake", "generate"] and ["wake", "sync"] in after and after[-1] == ["close"], log
    final = ppo["final_metrics"]
    # the engine's own log-probs of its samples equal the trainer's after every sync: the updates reached it
    assert final["ppo/iterations_run"] == 2 and 0 <= final["rollout/logprob_gap_max"] < 1e-3, final
    rows = [r for r in _metrics(run, "ppo") if "rollout/logprob_gap_max" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert _manifest(run, "evaluate")["status"] == "completed"
    evaluate = json.loads((run / "report" / "metrics.json").read_text())
    assert evaluate["eval/engine"] == "copy"
    assert all(0 <= evaluate[f"eval/{p}/logprob_gap_max"] < 1e-3 for p in ("sft", "ppo", "dpo")), evaluate
    assert (run / "evaluate" / "engine.rank0.log").read_text().count("sync") >= 3  # one per policy


def test_held_out_evaluations_are_logged_once_and_dpo_scores_the_pairs_that_fit(e2e):
    """SFT's and DPO's final held-out evaluation was logged twice at its step (by the callback and again by the
    stage); DPO scored every held-out pair, and TRL drops or cuts one longer than max_length (a cut pair whose two
    sides then agree counts as a wrong one): it scores those within max_length now, and counts the others."""
    import json

    for stage in ("sft", "dpo"):
        rows = [json.loads(x) for x in (e2e["run"] / stage / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r["step"] for r in rows if "eval/loss" in r]
        assert steps and len(steps) == len(set(steps)), (stage, steps)
    final = json.loads((e2e["run"] / "dpo" / "manifest.json").read_text())["final_metrics"]
    assert final["eval/pairs_over_max_length"] >= 0 and final["eval/rewards/accuracy"] >= 0
