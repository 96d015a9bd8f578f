"""PPO with `generation.engine: vllm` on the packaged SmolLM2-135M-Instruct (LoRA, fp32, CPU): it completes, is
SIGKILLed after its first checkpoint and resumes from it, the engine process does not outlive the killed stage and
leaves no synced weights in /dev/shm, and at every iteration the engine's log-probs of what it sampled equal the
training policy's within 1e-3 (so every weight sync, LoRA merged out of place and the tied head included, reached the
engine). Then evaluate samples the policies through vLLM too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, align_cmd, complete_checkpoints, run_align

pytestmark = pytest.mark.slow

PIPELINE = """
name: vllm_ppo
base_model: packaged:smollm2
seed: 5
tracking: {{wandb: disabled}}
stages:
  sft:
    data: {repo}/data_cards/movie_review_snippets.yaml
    learning_rate: 5.0e-5
    max_steps: 2
    per_device_batch_size: 4
    max_length: 48
    logging_steps: 1
    save_steps: 2
    eval_split: null
  ppo:
    policy: sft
    reward: vader
    value_init: policy
    prompts: {repo}/data_cards/movie_review_snippets.yaml
    iterations: 4
    save_every: 2
    rollout_batch_size: 8
    mini_batch_size: 4
    ppo_epochs: 1
    learning_rate: 1.0e-3
    reward_normalization_samples: 8
    lora: {{enabled: true, r: 8, alpha: 16}}
    kl: {{heldout_prompts: 8}}                # the held-out sync path, at a test's size
    generation: {{max_new_tokens: 12, batch_size: 8, engine: vllm}}
  evaluate:
    policies: [sft, ppo]
    baseline: sft
    reward: null
    preferences: null
    reference: sft
    judges: [vader]
    prompts: {repo}/data_cards/movie_review_snippets.yaml
    split: test
    max_prompts: 16
    bootstrap_samples: 100
    generation: {{max_new_tokens: 12, batch_size: 16, engine: vllm}}
"""


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (another test's engines may run beside this one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def kill_after_first_checkpoint(tmp_path: Path, *overrides: str) -> dict:
    """Run sft, then ppo (with `overrides`) until its first checkpoint, SIGKILL the whole process group and check
    that no engine outlives it and no bucket is left in shared memory; returns the killed stage's manifest."""
    ppo = tmp_path / "runs" / "vllm_ppo" / "main" / "ppo"
    first = run_align("run", "p.yaml", "--only", "sft", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "killed_run.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(align_cmd("run", "p.yaml", "--only", "ppo", *overrides), cwd=tmp_path,
                                start_new_session=True, stdout=sink, stderr=subprocess.STDOUT, env=os.environ.copy())
    t0 = time.time()
    try:
        while not complete_checkpoints(ppo / "checkpoints"):
            log = ppo / "stage.log"
            assert proc.poll() is None, (f"ppo exited ({proc.returncode}) before its first checkpoint: "
                                         + out.read_text()[-3000:] + (log.read_text()[-3000:] if log.exists() else ""))
            assert time.time() - t0 < 600, "no checkpoint within 600 s"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = json.loads((ppo / "manifest.json").read_text())
    # never completed; under ZeRO-3 the stage's workers, orphaned by the kill of the runner's group, may record their stop
    assert killed["status"] in ("running", "interrupted"), killed["status"]
    engine_pid = killed["engine"]["pid"]
    deadline = time.time() + 30  # the engine reads EOF from the dead stage's socket and exits
    while _alive(engine_pid) and time.time() < deadline:
        time.sleep(0.5)
    assert not _alive(engine_pid), f"the vLLM engine (pid {engine_pid}) outlived the killed stage"
    # syncs go through a bucket in shared memory (RAM); a killed stage must not leave it there
    assert killed["engine"]["weight_sync"] == "shared"
    assert not Path(killed["engine"]["sync_path"]).exists(), killed["engine"]["sync_path"]
    assert not Path(killed["engine"]["sync_path"]).parent.exists()
    return killed


def gaps_per_iteration(ppo: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    assert all(r["perf/sync_seconds"] > 0 for r in rows if "perf/sync_seconds" in r)
    gaps = {r["step"]: r["rollout/logprob_gap_max"] for r in rows if "rollout/logprob_gap_max" in r}
    print("log-prob gap (max) per iteration:", gaps)
    return gaps


@pytest.mark.distributed
def test_zero3_two_processes_with_vllm_resumes_after_sigkill(tmp_path):
    """Full-weight PPO under 2-process ZeRO-3, one vLLM engine per process, both synced through the node's bucket
    (each process writes its own partitions, none gathers: align/engines/node_bucket.py): killed after its first
    checkpoint, it resumes and completes, and every iteration's engine log-probs equal the trained policy's."""
    (tmp_path / "p.yaml").write_text(PIPELINE.format(repo=REPO))
    ppo = tmp_path / "runs" / "vllm_ppo" / "main" / "ppo"
    zero3 = ("ppo.accelerate=zero3", "ppo.num_processes=2", "ppo.lora.enabled=false", "ppo.learning_rate=1.0e-5",
             "ppo.kl.heldout_prompts=0")
    kill_after_first_checkpoint(tmp_path, *zero3)
    again = run_align("run", "p.yaml", "--only", "ppo", *zero3, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    m = json.loads((ppo / "manifest.json").read_text())
    assert m["status"] == "completed" and m["final_metrics"]["ppo/iterations_run"] == 4
    assert m["resumed_from_iteration"] == 2 and m["world_size"] == 2 and m["zero_stage"] == 3
    assert m["engine"]["sync_transport"] == "node_shared_memory", m["engine"]
    gaps = gaps_per_iteration(ppo)
    assert sorted(gaps) == [1, 2, 3, 4] and max(gaps.values()) < 1e-3, gaps
    assert m["final_metrics"]["rollout/logprob_gap_max"] == max(gaps.values())  # the killed attempt's iterations too


def test_lora_adapters_synced_alone_resume_after_sigkill(tmp_path):
    """generation.lora_sync: adapter: LoRA PPO whose engine gets the adapters alone (vLLM's LoRA support applies
    them): killed after its first checkpoint (the engine and its adapter files gone with it), it resumes with a new
    engine, which its first sync gives the restored adapters, and every iteration's engine log-probs equal the
    trained policy's."""
    (tmp_path / "p.yaml").write_text(PIPELINE.format(repo=REPO))
    ppo = tmp_path / "runs" / "vllm_ppo" / "main" / "ppo"
    adapter = ("ppo.generation.lora_sync=adapter",)
    killed = kill_after_first_checkpoint(tmp_path, *adapter)
    assert killed["engine"]["lora_sync"] == "adapter"
    again = run_align("run", "p.yaml", "--only", "ppo", *adapter, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    m = json.loads((ppo / "manifest.json").read_text())
    assert m["status"] == "completed" and m["final_metrics"]["ppo/iterations_run"] == 4
    assert m["resumed_from_iteration"] == 2 and m["engine"]["lora_sync"] == "adapter"
    gaps = gaps_per_iteration(ppo)
    assert sorted(gaps) == [1, 2, 3, 4] and max(gaps.values()) < 1e-3, gaps


def test_ppo_with_vllm_resumes_after_sigkill_and_keeps_the_logprob_gap_small(tmp_path):
    (tmp_path / "p.yaml").write_text(PIPELINE.format(repo=REPO))
    run_dir = tmp_path / "runs" / "vllm_ppo" / "main"
    ppo = run_dir / "ppo"
    kill_after_first_checkpoint(tmp_path)

    again = run_align("run", "p.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    m = json.loads((ppo / "manifest.json").read_text())
    assert m["status"] == "completed" and m["final_metrics"]["ppo/iterations_run"] == 4
    assert m["resumed_from_iteration"] == 2
    gaps = gaps_per_iteration(ppo)
    assert sorted(gaps) == [1, 2, 3, 4], gaps
    assert max(gaps.values()) < 1e-3, gaps
    ev = json.loads((run_dir / "evaluate" / "manifest.json").read_text())
    assert ev["status"] == "completed"
    assert ev["engine"]["sync_load"] == "in place" and ev["engine"]["sync_read_where_they_lie"] > 0, ev["engine"]
    metrics = json.loads((run_dir / "report" / "metrics.json").read_text())
    assert metrics["eval/engine"] == "vllm"
    for policy in ("sft", "ppo"):  # each policy's weights were synced into the engine before it sampled
        assert metrics[f"eval/{policy}/logprob_gap_max"] < 1e-3, metrics[f"eval/{policy}/logprob_gap_max"]
    assert not _alive(m["engine"]["pid"]), "the completed stage left its engine running"


# Loaded by every Python process of the run below (PYTHONPATH): from the second weight sync on (the first, before
# iteration 1's rollout, goes through), the trainer's sync file gets NaN in one tensor, as a sync that loads wrongly
# would leave the engine. Nothing in align's code knows of it; checkpoints and the
# published model are written by the same safetensors function and are left alone (matched by the sync file's name).
BREAK_SYNC = '''
try:
    import safetensors.torch as _st
except ImportError:  # a process without safetensors (not the trainer)
    _st = None
if _st is not None:
    _save, _syncs = _st.save_file, []

    def save_file(tensors, filename, *args, **kwargs):
        if str(filename).endswith("weights.safetensors.tmp"):
            _syncs.append(filename)
        if len(_syncs) >= 2 and str(filename).endswith("weights.safetensors.tmp"):  # the first sync goes through
            name = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
            tensors = {**tensors, name: tensors[name] * float("nan")}
        return _save(tensors, filename, *args, **kwargs)

    _st.save_file = save_file
'''


def test_ppo_with_vllm_stops_at_the_first_samples_after_a_broken_sync(tmp_path):
    """A weight sync that loads wrongly (NaN in the synced weights) stops PPO at the first samples after it, naming
    the iteration, the sync and the engine's log: here the held-out KL's samples after iteration 1's update, so a
    broken engine can steer neither the KL controller nor the budget. Before the check the stage completed with
    exit 0 and a clean gap in its summary (issue 38). The first sync (before iteration 1's rollout) is left whole, so
    the failure is the held-out path's, the one that runs right after an update's sync. The fault is injected into
    the file transport (weight_sync: file), whose writes a sitecustomize can reach; the check reads only what the
    engine samples, whatever carried the weights."""
    (tmp_path / "p.yaml").write_text(PIPELINE.format(repo=REPO))
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(BREAK_SYNC)
    sft = run_align("run", "p.yaml", "--only", "sft", cwd=tmp_path)
    assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH", "")) if p)
    proc = run_align("run", "p.yaml", "--only", "ppo", "ppo.iterations=2", "ppo.generation.weight_sync=file",
                     cwd=tmp_path, env={"PYTHONPATH": path}, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "iteration 1, held-out KL (after a weight sync of" in out, out[-3000:]
    assert "generation.max_logprob_gap" in out and "engine.rank0.log" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    ppo = tmp_path / "runs" / "vllm_ppo" / "main" / "ppo"
    m = json.loads((ppo / "manifest.json").read_text())
    assert m["status"] == "failed", m["status"]
    assert not (ppo / "model").exists()  # nothing published from a run whose engine was broken
    rows = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()] \
        if (ppo / "metrics.jsonl").exists() else []
    assert rows == [], rows  # iteration 1 stopped before its metrics row: no KL measured on a broken engine
