"""Which checkpoints a stage resumes from (align/runtime/context.py, align/core/rundir.py): a Trainer checkpoint is
complete only with every process's RNG state whole; a checkpoint of another process layout is refused, ZeRO or not;
the fingerprint stamp is written once, whole."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SEED = 1128


def _checkpoint(root, world: int, rng: bool = True):
    ckpt = root / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    if rng:
        for name in (["rng_state.pth"] if world == 1 else [f"rng_state_{r}.pth" for r in range(world)]):
            torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()}, ckpt / name)
    return ckpt


def test_a_checkpoint_is_whole_only_with_every_process_rng_state_whole(tmp_path):
    from align.core.checkpoints import torn_rng_states

    random.seed(SEED)
    print(f"seed {SEED}")
    assert torn_rng_states(_checkpoint(tmp_path / "one", 1), 1) == []
    assert torn_rng_states(_checkpoint(tmp_path / "two", 2), 2) == []
    assert torn_rng_states(_checkpoint(tmp_path / "model-only", 2, rng=False), 2) == []  # save_only_model
    missing = _checkpoint(tmp_path / "missing", 2)
    (missing / "rng_state_1.pth").unlink()  # rank 1 killed before it wrote its state
    assert torn_rng_states(missing, 2) == [missing / "rng_state_1.pth"]
    torn = _checkpoint(tmp_path / "torn", 2)
    data = (torn / "rng_state_1.pth").read_bytes()
    (torn / "rng_state_1.pth").write_bytes(data[:len(data) // 2])  # killed mid-write
    assert torn_rng_states(torn, 2) == [torn / "rng_state_1.pth"]
    state = _checkpoint(tmp_path / "state", 1)
    (state / "trainer_state.json").write_text('{"global_step": ')
    assert torn_rng_states(state, 1) is None


def _series(root, steps_and_faults: list[tuple[int, str]], world: int = 2):
    """checkpoint-<step> directories, each whole, with a torn rank-1 RNG state, or with a torn trainer state."""
    for step, fault in steps_and_faults:
        ckpt = _checkpoint(root / "tmp", world).rename(root / f"checkpoint-{step}")
        if fault == "rng":
            data = (ckpt / "rng_state_1.pth").read_bytes()
            (ckpt / "rng_state_1.pth").write_bytes(data[:10])
        elif fault == "state":
            (ckpt / "trainer_state.json").write_text("{")


def test_the_newest_whole_checkpoint_is_chosen_and_a_torn_newest_one_only_repaired_when_nothing_else_is_left(tmp_path):
    import logging

    from align.core.checkpoints import choose_checkpoint

    random.seed(SEED)
    log = logging.getLogger("test")
    older = tmp_path / "older"
    older.mkdir()
    _series(older, [(2, ""), (4, "rng"), (6, "state")])  # killed while writing 6, and 4 never got rank 1's state
    assert choose_checkpoint(older, 2, log) == older / "checkpoint-2"
    assert sorted(p.name for p in older.glob("checkpoint-*")) == ["checkpoint-2"]
    alone = tmp_path / "alone"
    alone.mkdir()
    _series(alone, [(4, "rng")])  # save_total_limit 1: the whole one before it was rotated away
    assert choose_checkpoint(alone, 2, log) == alone / "checkpoint-4"
    assert not (alone / "checkpoint-4" / "rng_state_1.pth").exists()  # transformers resumes without it
    assert (alone / "checkpoint-4" / "rng_state_0.pth").is_file()
    assert choose_checkpoint(tmp_path / "none", 2, log) is None


def test_a_newer_checkpoint_not_yet_marked_durable_is_passed_over_for_the_newest_marked_one(tmp_path):
    """A node lost after a checkpoint's trainer_state.json was written but before every process's files were synced
    can come back with that checkpoint's weights short: it parsed, was chosen, failed to load, and every rerun chose
    it again. The newest checkpoint marked DURABLE (every file synced) is chosen instead; checkpoints from before
    the marker existed (none marked) are chosen as they were."""
    import logging

    from align.core.checkpoints import DURABLE, choose_checkpoint

    random.seed(SEED)
    print(f"seed {SEED}")
    _series(tmp_path, [(2, ""), (4, ""), (6, "")])
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"w" * (16 if step < 6 else 3))
    unmarked = tmp_path / "unmarked"
    shutil.copytree(tmp_path, unmarked)
    assert choose_checkpoint(unmarked, 2, logging.getLogger("test")) == unmarked / "checkpoint-6"  # as before
    (tmp_path / "checkpoint-2" / DURABLE).write_text("")
    (tmp_path / "checkpoint-4" / DURABLE).write_text("")
    assert choose_checkpoint(tmp_path, 2, logging.getLogger("test")) == tmp_path / "checkpoint-4"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_an_older_checkpoint_whose_removal_was_cut_short_is_not_chosen_over_the_newest(tmp_path):
    """save_total_limit 1, 2 processes: transformers' rotation removes checkpoint-2 right after checkpoint-4's trainer
    state, before rank 1 wrote checkpoint-4's RNG state. Killed then, checkpoint-2 still parsed and had its RNG
    states, so it was chosen and checkpoint-4, the only one with weights and optimizer, was removed: every resume
    failed, or one without optimizer.pt trained on with a fresh optimizer. Now checkpoint-4 resumes."""
    import logging

    from align.core.checkpoints import choose_checkpoint

    random.seed(SEED)
    print(f"seed {SEED}")
    _series(tmp_path, [(2, ""), (4, "rng")])
    for step in (2, 4):
        ckpt = tmp_path / f"checkpoint-{step}"
        (ckpt / f"global_step{step}").mkdir()
        for name in ("model.safetensors", "optimizer.pt", f"global_step{step}/zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            (ckpt / name).write_bytes(b"w" * 16)
    kept = tmp_path / "kept"
    kept.mkdir()
    for ckpt in ("checkpoint-2", "checkpoint-4"):  # both whole but for 4's RNG: 2 is chosen, as before
        shutil.copytree(tmp_path / ckpt, kept / ckpt)
    assert choose_checkpoint(kept, 2, logging.getLogger("test")) == kept / "checkpoint-2"
    (tmp_path / "checkpoint-2" / "model.safetensors").unlink()  # the rotation's rmtree, killed part way
    (tmp_path / "checkpoint-2" / "optimizer.pt").unlink()
    chosen = choose_checkpoint(tmp_path, 2, logging.getLogger("test"))
    assert chosen == tmp_path / "checkpoint-4" and (chosen / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]
    assert not (chosen / "rng_state_1.pth").exists() and (chosen / "rng_state_0.pth").is_file()


@pytest.mark.parametrize("local_main, main", [(True, True), (True, False), (False, False)])
def test_older_checkpoints_go_only_after_every_process_wrote_the_newest_and_it_reached_the_disk(
        tmp_path, monkeypatch, local_main, main):
    """transformers' save_total_limit removed older checkpoints on the main process right after its own writes: a
    process still writing its shard, or a power loss before the page cache was written, left a torn newest and no
    whole one. Now every process waits, each node's first process fsyncs the newest, all wait, then the main one
    rotates (by step) and syncs the directory."""
    import align.runtime.resume as resume

    events: list = []
    for step in (2, 10, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"w")
    (tmp_path / "checkpoint-notes.txt").write_text("a user's file: neither a checkpoint nor removed\n")
    state = SimpleNamespace(wait_for_everyone=lambda: events.append("wait"), is_local_main_process=local_main,
                            is_main_process=main)
    monkeypatch.setattr(resume, "fsync_tree", lambda root: events.append(
        ("fsync", root.name, sorted(p.name for p in tmp_path.iterdir()))))
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "metrics.jsonl").write_text('{"step": 5, "train/loss": 1.0}\n{"step": 10, "train/loss": 0.5}\n')
    callback = resume.durable_checkpoints(SimpleNamespace(state=state, dir=stage), keep=2)
    callback.on_save(SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=10), None)
    every = ["checkpoint-10", "checkpoint-2", "checkpoint-6", "checkpoint-notes.txt", "stage"]
    assert events == ["wait"] + ([("fsync", "checkpoint-10", every)] if local_main else []) + ["wait"]
    kept = ["checkpoint-10", "checkpoint-6", "checkpoint-notes.txt", "stage"]
    assert sorted(p.name for p in tmp_path.iterdir()) == (kept if main else every)
    assert (tmp_path / "checkpoint-10" / "DURABLE").is_file() == main  # after every node synced it
    if main:  # with the metrics rows logged by then: a resume from it keeps those and no more
        assert json.loads((tmp_path / "checkpoint-10" / "DURABLE").read_text()) == {"metrics_rows": 2}


def test_a_resume_keeps_the_metrics_rows_its_checkpoint_saw_and_not_those_logged_at_its_step_after_it(tmp_path):
    """Killed after the last step's checkpoint, during the evaluation that follows: the resumed attempt (nothing left
    to train) evaluates again at the same step, and the killed attempt's evaluation rows at that step were kept
    beside the new ones. Rows are kept up to the count the checkpoint's DURABLE marker records; without one, by step."""
    from align.core.checkpoints import durable_rows, mark_durable
    from align.core.tracking import keep_metrics_until

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 2, "train/loss": 1.0}, {"step": 4, "train/loss": 0.8}]
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mark_durable(ckpt, 2)
    killed = [{"step": 4, "eval/loss": 0.9}, {"step": 5, "train/loss": 0.7}]
    path.write_text(path.read_text() + "".join(json.dumps(r) + "\n" for r in killed) + '{"step": 6, "tr')
    keep_metrics_until(path, 4, durable_rows(ckpt))
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    path.write_text(path.read_text() + "".join(json.dumps(r) + "\n" for r in killed))
    keep_metrics_until(path, 4, durable_rows(tmp_path / "unmarked"))  # no marker: by step, as before
    assert [json.loads(line) for line in path.read_text().splitlines()] == [*rows, killed[0]]


def _stub(tmp_path, old: dict, now: dict):
    from align.runtime.context import LAYOUT

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint-2").mkdir(parents=True)
    (checkpoints / "FINGERPRINT").write_text("abc")
    (checkpoints / LAYOUT).write_text(json.dumps(old))
    return SimpleNamespace(checkpoints=checkpoints, fingerprint="abc", name="sft", layout=lambda: now)


@pytest.mark.parametrize("old, now, refused", [
    ({"world_size": 2, "zero_stage": None}, {"world_size": 4, "zero_stage": None}, True),  # plain DDP, 2 -> 4 GPUs
    ({"world_size": 2, "zero_stage": 2}, {"world_size": 1, "zero_stage": 2}, True),
    ({"world_size": 2, "zero_stage": None}, {"world_size": 2, "zero_stage": None}, False)])
def test_checkpoints_of_another_process_layout_are_refused_with_or_without_zero(tmp_path, old, now, refused):
    from align.runtime.context import StageContext, StageError

    stub = _stub(tmp_path, old, now)
    if refused:
        with pytest.raises(StageError, match=f"written by {old['world_size']} process"):
            StageContext.check_checkpoint_layout(stub)
    else:
        StageContext.check_checkpoint_layout(stub)


def test_the_fingerprint_stamp_is_kept_when_it_matches_and_checkpoints_of_another_are_removed(tmp_path):
    from align.runtime.context import StageContext

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint-2").mkdir(parents=True)
    stamp = checkpoints / "FINGERPRINT"
    stamp.write_text("abc")
    before = stamp.stat().st_mtime_ns, stamp.stat().st_ino
    stub = SimpleNamespace(checkpoints=checkpoints, fingerprint="abc", is_main=True, layout=lambda: {"world_size": 1},
                           state=SimpleNamespace(wait_for_everyone=lambda: None))
    StageContext.prepare_checkpoints(stub)
    assert (stamp.stat().st_mtime_ns, stamp.stat().st_ino) == before and (checkpoints / "checkpoint-2").is_dir()
    stub.fingerprint = "new"
    StageContext.prepare_checkpoints(stub)
    assert stamp.read_text() == "new" and not (checkpoints / "checkpoint-2").exists()


def test_only_an_interrupted_attempt_of_this_fingerprint_from_these_very_inputs_resumes():
    """An upstream stage retrained with the same settings since (`--only sft --force`) gives the same fingerprint
    but another published model: checkpoints trained from the old one must not resume (the policy would come from the
    old SFT, the reference from the new, and the manifest would record the new)."""
    from align.runtime.process import resumes

    old = {"fingerprint": "f1", "status": "interrupted", "input_digests": {"sft": {"id": "a", "files": {"x": "1"}}}}
    same = {"sft": {"id": "a", "files": {"x": "1"}}}
    assert resumes(old, "f1", same)
    assert not resumes(old, "f1", {"sft": {"id": "b", "files": {"x": "2"}}})  # sft published again
    assert not resumes(old, "f2", same) and not resumes({**old, "status": "completed"}, "f1", same)
    assert not resumes(None, "f1", same) and not resumes({}, "f1", {})
    assert resumes({"fingerprint": "f1", "status": "failed"}, "f1", {})  # a first stage: no inputs


def test_a_stage_is_stale_when_an_input_it_recorded_publishes_other_outputs_or_none(tmp_path):
    """One comparison (core/rundir.py moved_inputs) serves `up to date`, `--only`'s refusal and `align status`."""
    from align.core.rundir import moved_inputs

    def manifest(name, **fields):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "manifest.json").write_text(json.dumps(fields))

    pub = {"model": {"publication": "p1", "files": {"a": [1, "00"]}}}
    manifest("sft", output_digests=pub)
    manifest("rm", output_digests={"model": {"publication": "r1", "files": {}}})
    manifest("dpo", input_digests={"sft": pub, "rm": {"model": {"publication": "r0", "files": {}}}})
    assert moved_inputs(tmp_path, "dpo") == ["rm"]  # rm republished (another publication id)
    assert moved_inputs(tmp_path, "dpo", ["sft"]) == []
    manifest("ref", output_digests=pub)
    assert moved_inputs(tmp_path, "dpo", ["sft", "ref"]) == ["ref"]  # an input it never recorded
    (tmp_path / "sft" / "manifest.json").unlink()  # sft's record gone: nothing it publishes is what dpo read
    assert moved_inputs(tmp_path, "dpo") == ["sft", "rm"]
    assert moved_inputs(tmp_path, "nothing-here") == [] and moved_inputs(tmp_path, "nothing-here", ["sft"]) == []


@pytest.mark.parametrize("keep", [True, False])
def test_a_completed_stage_keeps_or_drops_its_checkpoints_as_the_pipeline_says(tmp_path, keep):
    """Checkpoints serve only to resume an interrupted attempt: `keep_checkpoints: false` (the 8B pipelines) removes a
    completed stage's, which at 8B are ~110-220 GB each; the default keeps them. Each node's first process removes
    (a run directory on node-local disks), the others leave them; all of them only once every process is through
    the main process's writing the stage completed (a barrier, reached with the checkpoints still there)."""
    from types import SimpleNamespace

    from align.runtime.process import drop_checkpoints

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint-2").mkdir(parents=True)
    waited = []
    for main in (False, True):
        state = SimpleNamespace(is_local_main_process=main,
                                wait_for_everyone=lambda: waited.append((checkpoints / "checkpoint-2").is_dir()))
        ctx = SimpleNamespace(state=state, pipeline=SimpleNamespace(keep_checkpoints=keep), checkpoints=checkpoints)
        drop_checkpoints(ctx)
        assert (checkpoints / "checkpoint-2").is_dir() == (keep or not main)
    assert waited == ([] if keep else [True, True])


def test_the_run_loss_weighs_each_logged_window_before_a_resume_by_its_steps():
    """train/loss_final_avg after a resume: transformers' training_loss covers only the steps since it."""
    from align.runtime.trl import run_loss

    log = [{"loss": 2.0, "step": 2}, {"loss": 1.0, "step": 4}, {"eval_loss": 9.0, "step": 4}, {"loss": 0.5, "step": 6}]
    assert run_loss(log, 4, 0.25, 6) == pytest.approx((2.0 * 2 + 1.0 * 2 + 0.25 * 2) / 6)  # 1.0833
    assert run_loss(log, 0, 0.75, 6) == 0.75  # not resumed: transformers' own mean
    assert run_loss(log, 6, 0.0, 6) == pytest.approx((2.0 * 2 + 1.0 * 2 + 0.5 * 2) / 6)  # nothing left to train
    assert run_loss(log, 3, 0.25, 6) is None  # step 3 is no logged window's end: no honest mean
    assert run_loss([], 0, 0.0, 0) is None


def _tiny_trainer(out, init: int = SEED, log: int = 1):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(init)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    gen = torch.Generator().manual_seed(SEED)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 12), generator=gen).tolist()]
    args = TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=log, save_steps=log, save_strategy="steps", report_to="none", use_cpu=True,
                             seed=SEED, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows))


@pytest.mark.parametrize("log", [1, 2])
def test_a_resume_from_the_last_checkpoint_trains_no_step_past_max_steps_and_keeps_the_whole_runs_loss(tmp_path, log):
    """Two batches an epoch, max_steps 3: resumed from checkpoint-3 (a stage killed after its last save, before it
    published), transformers trained a 4th step, and train/loss_final_avg was the mean of the steps since the
    resume alone. Resumed from checkpoint-3 or checkpoint-2, the stage ends at step 3 with the uninterrupted run's
    weights and loss; also where step 3 ends no logging window (logging and save steps 2: the final checkpoint,
    always saved, holds the last window's loss)."""
    from align.runtime.trl import train_with_resume

    print(f"seed {SEED}")

    class Ctx:
        name, is_main = "sft", True
        cfg = SimpleNamespace(save_total_limit=2)
        state = SimpleNamespace(wait_for_everyone=lambda: None, is_local_main_process=True, is_main_process=True)
        pipeline = SimpleNamespace(keep_checkpoints=True)

        def __init__(self, ckpt):
            self.dir, self.extra_manifest, self.ckpt = tmp_path, {}, ckpt

        def last_checkpoint(self):
            return self.ckpt

    whole = _tiny_trainer(tmp_path / "a", log=log)
    first = train_with_resume(Ctx(None), whole)
    weights = {k: v.clone() for k, v in whole.model.state_dict().items()}
    assert first["train/global_step"] == 3 and (tmp_path / "a" / "checkpoint-3").is_dir()
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for step in (3, 2):
        again = _tiny_trainer(tmp_path / f"b{step}", init=SEED + 1, log=log)  # other initial weights: the checkpoint's
        ctx = Ctx(str(tmp_path / "a" / f"checkpoint-{step}"))
        final = train_with_resume(ctx, again)
        assert (final["train/global_step"], again.state.global_step, ctx.extra_manifest["resumed_from_step"]) == (
            3, 3, step)
        assert final["train/loss_final_avg"] == pytest.approx(first["train/loss_final_avg"], rel=1e-5), step
        for k, v in again.model.state_dict().items():
            torch.testing.assert_close(v, weights[k], rtol=1e-5, atol=1e-6, msg=f"{k} after resuming at {step}")


def test_a_stage_without_its_headline_metrics_shows_its_training_loss():
    """A DPO stage with no eval split had an empty headline in `align run` and `align status`."""
    from align.config import stage_types
    from align.core.rundir import headline

    dpo = stage_types()["dpo"].HEADLINE
    evaluated = {"final_metrics": {"eval/rewards/accuracy": 0.75, "eval/rewards/margin": 0.5,
                                   "train/loss_final_avg": 0.6}}
    assert headline(evaluated, dpo) == "eval/rewards/accuracy 0.75, eval/rewards/margin 0.5"
    assert headline({"final_metrics": {"train/loss_final_avg": 0.6125}}, dpo) == "train/loss_final_avg 0.6125"
    assert headline({"final_metrics": {}}, dpo) == "" and headline(None, dpo) == ""
    assert headline({"final_metrics": {"train/loss_final_avg": 0.6}}, ()) == ""  # a type that names no headline


def test_a_ppo_checkpoint_reaches_the_disk_before_it_is_marked_and_before_older_ones_go(tmp_path, monkeypatch):
    """PPO wrote COMPLETE and renamed its checkpoint without fsync, then removed the older ones: after a power loss
    the renames and removals could reach the disk before the new files' bytes, leaving a marked checkpoint of empty
    files and none older. Now every file is synced before the marker, and the directory before the removal."""
    import os

    from align.stages.ppo import checkpoint

    events: list[str] = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def fsync(fd):
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda p: (events.append(f"remove {Path(p).name}"),
                                                                real_rmtree(p)))

    class Accelerator:  # accelerate's save_state: each process writes its files, its RNG state last, no barrier
        is_main_process = is_local_main_process = True

        def save_state(self, path, **kwargs):
            os.makedirs(path)
            for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
                Path(path, name).write_bytes(b"w" * 16)
            self.path = path

        def wait_for_everyone(self):  # the other process's RNG state lands by the first barrier after save_state
            if Path(self.path).is_dir() and not Path(self.path, "random_states_1.pkl").exists():
                Path(self.path, "random_states_1.pkl").write_bytes(b"r" * 16)
                events.append("all saved")

    ctx = SimpleNamespace(checkpoints=tmp_path / "checkpoints")
    ctx.checkpoints.mkdir()
    for it in (1, 2):
        (ctx.checkpoints / f"iter-{it}").mkdir()
        (ctx.checkpoints / f"iter-{it}" / "COMPLETE").write_text("{}")
    # a user's copy and notes beside them: int("2.bak") raised in rotation (main process only: the others then
    # waited at the barrier) and in resume, on every later attempt; now they are no checkpoints, left alone
    shutil.copytree(ctx.checkpoints / "iter-2", ctx.checkpoints / "iter-2.bak")
    (ctx.checkpoints / "iter-notes.txt").write_text("kept by hand")
    checkpoint.save_checkpoint(ctx, Accelerator(), 3, keep=2)
    marked = next(i for i, e in enumerate(events) if e.startswith("fsync .COMPLETE") or e == "fsync COMPLETE")
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"):
        assert events.index("all saved") < events.index(f"fsync {name}") < marked  # process 1's file too
    assert events.index("fsync checkpoints") < events.index("remove iter-1")
    assert sorted(p.name for p in ctx.checkpoints.iterdir()) == ["iter-2", "iter-2.bak", "iter-3", "iter-notes.txt"]
    from align.core.checkpoints import step_checkpoints

    assert [p.name for p in step_checkpoints(ctx.checkpoints, "iter-")] == ["iter-2", "iter-3"]  # what resume reads


def test_a_checkpoint_directory_not_named_by_a_step_is_left_alone_by_resume_and_rotation(tmp_path):
    """A user copied `checkpoint-best` beside the Trainer's checkpoints. Resume parsed every `checkpoint-*` name as a
    step: int("best") raised, and every later attempt of the stage failed before loading. Now it is no checkpoint,
    as transformers' own `get_last_checkpoint` reads it: resume picks the newest step, rotation keeps it."""
    import logging

    from align.core.checkpoints import choose_checkpoint, rotate_checkpoints

    random.seed(SEED)
    print(f"seed {SEED}")
    _series(tmp_path, [(2, ""), (4, "")])
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-best")
    (tmp_path / "checkpoint-notes.txt").write_text("kept by hand")
    assert choose_checkpoint(tmp_path, 2, logging.getLogger("test")) == tmp_path / "checkpoint-4"
    assert rotate_checkpoints(tmp_path, 1) == [tmp_path / "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-best",
                                                                     "checkpoint-notes.txt"]
